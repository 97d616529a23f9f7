"""Kept activations on CUDA: the backward's kept block graphs give full recompute's losses and weights, with the
copy streams and events of a real device (on CPU they are bit-identical: tests/unit/engine/test_kept_blocks.py)."""

import pytest
import torch

from tests.tiny_models import reference_model, tiny_batches, tiny_config
from tests.unit.engine.test_parity import OPT, train_engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize(("family", "dtype", "keep"), [
    ("llama", "fp32", 3), ("llama", "bf16", "auto"), ("qwen3_moe", "fp32", 2), ("qwen3_moe", "bf16", "auto")])
def test_kept_graphs_train_as_full_recompute_on_cuda(family, dtype, keep):
    cfg = tiny_config(family)
    weights = reference_model(cfg).state_dict()
    batches = [tiny_batches(n_micro=3, seed=s, seq=64) for s in range(3)]
    kw = {"device": "cuda", "compute_dtype": dtype, "checkpoint_every": 1, "prefetch_units": 1}
    recompute = train_engine(cfg, weights, batches, OPT, {**kw, "keep_activations": 0})
    kept = train_engine(cfg, weights, batches, OPT, {**kw, "keep_activations": keep})
    tol = {"fp32": (1e-5, 1e-6), "bf16": (1e-3, 1e-4)}[dtype]
    assert kept[0] == pytest.approx(recompute[0], rel=tol[0])
    for name, w in recompute[1].items():
        torch.testing.assert_close(kept[1][name], w, rtol=tol[0], atol=tol[1], msg=name)
