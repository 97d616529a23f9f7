"""CUDA: every family trains from its own checkpoint on packed rows in the resident schedule and with
Liger's kernels, as transformers' eager model does on each document alone (tests/unit/engine/test_families.py
on the CPU, default settings). fp32 compute, so the comparison is of the arithmetic, not of bf16 rounding.

Runs only where a GPU is present (the lent device machine); CPU CI skips it.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from mt_ray.errors import ModelNotSupportedError
from tests.family_checks import (
    assert_same_step,
    documents,
    engine_step,
    packed_micro_batch,
    reference_step,
    save_checkpoint,
)
from tests.tiny_models import CHECKPOINT_FAMILIES, checkpoint_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def exact_fp32(monkeypatch):
    """cuDNN convolutions (short convolutions, Mamba) default to TF32, which is not fp32 arithmetic."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


@pytest.mark.parametrize("family", list(CHECKPOINT_FAMILIES))
def test_resident_schedule_trains_every_family_from_its_checkpoint(family, tmp_path):
    save_checkpoint(family, tmp_path)
    docs = documents()
    result, state = engine_step(tmp_path, [packed_micro_batch(docs)], device="cuda", compute_dtype="fp32",
                                schedule="resident")
    ref_loss, before, ref_state = reference_step(tmp_path, docs, device="cuda")
    assert_same_step(state, before, ref_state, result.loss.item(), ref_loss, rtol=1e-3, atol=1e-6)


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="needs liger-kernel")
@pytest.mark.parametrize("family", list(CHECKPOINT_FAMILIES))
def test_liger_kernels_train_every_family_they_cover(family, tmp_path, family_module_restored):
    """Liger's fused kernels change the arithmetic (fp32 loss within 5e-4 of torch's in
    tests/gpu/test_cuda_engine.py); a family Liger has no kernels for is refused, saying so."""
    from mt_ray.models.kernels import load_liger_fns

    model_type = checkpoint_config(family).model_type
    family_module_restored(model_type)
    save_checkpoint(family, tmp_path)
    docs = documents()
    mb = packed_micro_batch(docs)
    if model_type not in load_liger_fns():
        with pytest.raises(ModelNotSupportedError, match=f"Liger has no kernels for model_type '{model_type}'"):
            engine_step(tmp_path, [mb], device="cuda", kernels="liger")
        return
    # The reference first: Liger's swaps reach models built after them in this process.
    ref_loss, before, ref_state = reference_step(tmp_path, docs, device="cuda")
    result, state = engine_step(tmp_path, [mb], device="cuda", compute_dtype="fp32", kernels="liger")
    assert_same_step(state, before, ref_state, result.loss.item(), ref_loss, rel=5e-4, rtol=1e-2, atol=1e-5)
