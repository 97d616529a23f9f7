"""Checkpoints in pinned host memory on real streams: the copies out (d2h) and back (h2d) are ordered
by events alone, so a missing wait would read a slab region before its copy landed. Same losses and
weights as checkpoints on the device, GPU memory flat as the step grows, and a GPU cap that holds.

Runs only where a GPU is present (the lent device machine); CPU CI skips it.
"""

import pytest
import torch

from mt_ray.engine import EngineConfig, OptimizerConfig, StreamingEngine
from mt_ray.models.discovery import discover
from tests.tiny_models import reference_model, tiny_batches, tiny_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

OPT = OptimizerConfig(lr=2e-3, weight_decay=0.1, max_grad_norm=1.0, warmup_steps=1)
# A micro-batch's hidden state is 2 x 512 x 1024 fp32 (4 MiB): copies long enough to race.
CFG = dict(hidden_size=1024, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=8,
           num_key_value_heads=4)


def train(placement: str, k: int, steps: list[list[dict]], **engine_kw):
    cfg = tiny_config("llama", **CFG)
    cfg._attn_implementation = "eager"  # deterministic backward: the two placements must agree exactly
    engine = StreamingEngine(discover(cfg), EngineConfig(device="cuda", compute_dtype="fp32", checkpoint_every=k,
                                                         checkpoint_placement=placement, **engine_kw),
                             OPT, total_steps=len(steps))
    try:
        engine.load_state_dict(reference_model(cfg).state_dict())
        torch.cuda.reset_peak_memory_stats()
        losses = [engine.train_step(s).loss.item() for s in steps]
        peak = torch.cuda.max_memory_allocated()
        return losses, engine.state_dict(), peak
    finally:
        engine.close()


@pytest.mark.parametrize("k", [1, 2])
def test_host_checkpoints_train_as_device_checkpoints_on_cuda(k):
    # Steps of different lengths: the slab is pinned once and reused by the shorter step.
    steps = [tiny_batches(n_micro=4, seq=512), tiny_batches(n_micro=4, seq=384, seed=1),
             tiny_batches(n_micro=4, seq=512, seed=2)]
    device = train("device", k, steps)
    host = train("host", k, steps)
    assert host[0] == pytest.approx(device[0], rel=1e-6, abs=0)
    for name, w in device[1].items():
        torch.testing.assert_close(host[1][name], w, atol=1e-6, rtol=1e-5, msg=name)


def test_host_checkpoints_keep_gpu_memory_flat_as_the_step_grows():
    # Full recompute: kept block graphs (`keep_activations: auto`) grow with the micro-batches by design.
    peaks = {(place, n): train(place, 1, [tiny_batches(n_micro=n, seq=512)] * 2, keep_activations=0)[2]
             for place in ("device", "host") for n in (2, 8)}
    hidden = 2 * 512 * 1024 * 4  # one micro-batch's hidden state
    grown = peaks["device", 8] - peaks["device", 2]
    assert grown >= 2 * 6 * hidden  # at least two checkpoints each of the 6 more micro-batches (CPU: 20 hidden states)
    # Only the micro-batches' inputs and layer contexts grow (CPU: 1.1 hidden states)
    assert peaks["host", 8] - peaks["host", 2] < 0.1 * grown


def test_a_gpu_cap_fails_an_allocation_past_it():
    """engine.gpu_memory_limit_gb caps the caching allocator: what a smaller card would refuse fails."""
    cfg = tiny_config("llama")
    engine = StreamingEngine(discover(cfg), EngineConfig(device="cuda", gpu_memory_limit_gb=1.0), OPT, total_steps=1)
    try:
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    finally:
        engine.close()
        torch.cuda.set_per_process_memory_fraction(1.0)
