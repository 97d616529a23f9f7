"""CUDA: long-context knobs. Norms and dense MLPs in sequence chunks (`mlp_chunk_tokens`) train the same
step in less GPU memory; one 32k-token sequence through a small Qwen2-shaped model, a recompute block per layer.

Runs only where a GPU is present (the lent device machine); CPU CI skips it.
"""

from __future__ import annotations

import pytest
import torch

from mt_ray.engine import EngineConfig, OptimizerConfig, StreamingEngine
from mt_ray.models.discovery import discover
from tests.tiny_models import tiny_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

OPT = OptimizerConfig(lr=1e-2, eps=1.0, max_grad_norm=1.0)
TOKENS = 32768


def step(state: dict | None, **engine_kw) -> tuple[float, dict, dict, float]:
    """One bf16 step on one sequence: (loss, weights before, weights after, peak GPU GiB of the step)."""
    cfg = tiny_config("qwen2", hidden_size=256, intermediate_size=1376, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, num_hidden_layers=2, max_position_embeddings=TOKENS)
    engine = StreamingEngine(discover(cfg), EngineConfig(device="cuda", checkpoint_every=1, **engine_kw), OPT,
                             total_steps=1)
    try:
        if state is None:
            engine.load_random(seed=0)
        else:
            engine.load_state_dict(state)
        before = {n: w.clone() for n, w in engine.state_dict().items()}  # live views of the master: the step updates them
        ids = torch.randint(3, 96, (1, TOKENS), generator=torch.Generator().manual_seed(0))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        loss = engine.train_step([{"input_ids": ids}]).loss.item()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**30
        return loss, before, engine.state_dict(), peak
    finally:
        engine.close()


@pytest.mark.parametrize("kernels", ["torch", "liger"])
def test_chunked_mlp_and_norms_train_the_same_step_in_less_memory(kernels, family_module_restored):
    """Chunks wrap whichever forward the kernels left: transformers' own, or Liger's fused ones."""
    if kernels == "liger":
        pytest.importorskip("liger_kernel")
        family_module_restored("qwen2")
    loss, before, after, peak = step(None, kernels=kernels)
    c_loss, c_before, c_after, c_peak = step(before, kernels=kernels, mlp_chunk_tokens=2048)
    assert c_loss == pytest.approx(loss, rel=1e-3)
    update = torch.cat([(after[n] - before[n]).reshape(-1) for n in before])
    c_update = torch.cat([(c_after[n] - c_before[n]).reshape(-1) for n in before])
    assert float((c_update - update).norm() / update.norm()) < 2e-2
    # the MLP's intermediates (four of 1376 a token with torch's code, three with Liger's) no longer stay
    assert c_peak < peak - 0.1, (c_peak, peak)
