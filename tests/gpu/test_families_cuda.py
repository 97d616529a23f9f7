"""CUDA: every family trains from its own checkpoint on packed rows in the resident schedule and with
Liger's kernels, as transformers' eager model does on each document alone (tests/unit/engine/test_families.py
on the CPU, default settings); and every model type the CPU sweep trains at parity (tests/family_sweep.py) does
so on CUDA with the default settings (varlen attention, streamed schedule). fp32 compute, so the comparison is
of the arithmetic, not of bf16 rounding.

Runs only where a GPU is present (the lent device machine); CPU CI skips it.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
)

from mt_ray.errors import ModelNotSupportedError
from tests.family_checks import (
    assert_same_step,
    documents,
    engine_step,
    packed_micro_batch,
    reference_step,
    save_checkpoint,
)
from tests.family_sweep import save_tiny, sweep_case
from tests.tiny_models import CHECKPOINT_FAMILIES, checkpoint_config
from tests.vlm_sweep import image_text_case

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


@pytest.mark.parametrize("model_type", sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
def test_every_family_the_sweep_trains_trains_on_cuda(model_type, tmp_path):
    """Refused and skipped types are the CPU sweep's business (tests/unit/engine/test_family_sweep.py)."""
    outcome = sweep_case(model_type, tmp_path, device="cuda", tolerances=dict(rtol=1e-3, atol=1e-6),
                         compute_dtype="fp32")
    if outcome.status in ("refused", "skipped"):
        pytest.skip(f"{outcome.status} (as on the CPU): {outcome.reason.splitlines()[0]}")
    assert outcome.status == "matched", outcome.reason


@pytest.mark.parametrize("model_type", sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES))
def test_every_image_text_family_the_sweep_trains_trains_on_cuda(model_type, tmp_path):
    """The image-text sweep's step (tower frozen, then trained) with the engine on CUDA, transformers' eager model
    on the CPU as the reference."""
    outcome = image_text_case(model_type, tmp_path, device="cuda", tolerances=dict(rtol=1e-3, atol=1e-6),
                              compute_dtype="fp32")
    if outcome.status in ("refused", "skipped"):
        pytest.skip(f"{outcome.status} (as on the CPU): {outcome.reason.splitlines()[0]}")
    assert outcome.status == "matched", outcome.reason


@pytest.mark.parametrize(("chunk", "floor_scale"), [(8, 8192), (64, 3)], ids=["chunk-in-row", "temperature-floor"])
def test_llama4_packed_rows_train_as_each_document_alone_on_cuda(tmp_path, chunk, floor_scale):
    """tests/unit/models/test_packing_probe.py's Llama 4 case (chunks shorter than the row, or a temperature floor
    shorter than it) with the engine and the reference on CUDA: the probe's verdict holds on the GPU's kernels."""
    save_tiny("llama4_text", tmp_path, attention_chunk_size=chunk, floor_scale=floor_scale, no_rope_layers=[1, 0])
    docs = documents()
    ref_loss, before, ref_state = reference_step(tmp_path, docs, device="cuda")
    result, state = engine_step(tmp_path, [packed_micro_batch(docs)], device="cuda", compute_dtype="fp32")
    assert_same_step(state, before, ref_state, result.loss.item(), ref_loss, rtol=1e-3, atol=1e-6)


needs_liger = pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="needs liger-kernel")

# Families whose Liger function (liger-kernel 0.8.5) fails on this test's model: refused, saying so.
LIGER_FAILS = {
    # Liger's qwen3_moe function patches `mlp.experts` of every layer; this model's odd layers are dense
    # (decoder_sparse_step 2). Released Qwen3-MoE checkpoints are sparse throughout: see the test below.
    "qwen3_moe": "apply_liger_kernel_to_qwen3_moe failed on this 'qwen3_moe' model "
                 r"\(AttributeError: 'Qwen3MoeMLP' object has no attribute 'experts'\)",
}


@needs_liger
@pytest.mark.parametrize("family", list(CHECKPOINT_FAMILIES))
def test_liger_kernels_train_every_family_they_cover(family, tmp_path, family_module_restored):
    """Liger's fused kernels change the arithmetic (fp32 loss within 5e-4 of torch's in
    tests/gpu/test_cuda_engine.py); a family Liger has no kernels for, or whose Liger function fails on
    the model, is refused, saying so. MoE families keep transformers' experts (TF32: mt_ray/models/kernels.py)."""
    from mt_ray.models.kernels import load_liger_fns

    config = checkpoint_config(family)
    family_module_restored(config.model_type)
    if config.model_type in load_liger_fns() and family not in LIGER_FAILS:
        assert_liger_step_matches(family, tmp_path)
        return
    reason = LIGER_FAILS.get(family, f"Liger has no kernels for model_type '{config.model_type}'")
    save_checkpoint(family, tmp_path)
    with pytest.raises(ModelNotSupportedError, match=f"{reason}.*use kernels: torch"):
        engine_step(tmp_path, [packed_micro_batch(documents())], device="cuda", kernels="liger")


@needs_liger
def test_liger_kernels_train_a_qwen3_moe_sparse_in_every_layer(tmp_path, family_module_restored):
    """The layout of released Qwen3-MoE checkpoints, which Liger's qwen3_moe function does run on."""
    family_module_restored("qwen3_moe")
    assert_liger_step_matches("qwen3_moe", tmp_path, decoder_sparse_step=1)


def assert_liger_step_matches(family: str, folder, **overrides) -> None:
    save_checkpoint(family, folder, **overrides)
    docs = documents()
    # The reference first: Liger's swaps reach models built after them in this process.
    ref_loss, before, ref_state = reference_step(folder, docs, device="cuda")
    result, state = engine_step(folder, [packed_micro_batch(docs)], device="cuda", compute_dtype="fp32",
                                kernels="liger")
    assert_same_step(state, before, ref_state, result.loss.item(), ref_loss, rel=5e-4, rtol=1e-2, atol=1e-5)
