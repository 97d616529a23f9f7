"""The calculator's host figure is the engine's own allocation, its device figure is within 10% of the
measured peak, and its batch choice fits its budget."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from mt_ray.engine import EngineConfig, OptimizerConfig, StreamingEngine
from mt_ray.engine.sizing import device_bytes, host_bytes, recommend
from mt_ray.models.discovery import discover
from mt_ray.models.presets import preset_config
from tests.tiny_models import tiny_config


@pytest.mark.parametrize("clip", [0.0, 1.0])
@pytest.mark.parametrize("kw", [{}, {"stream_master": True, "grad_dtype": "compute", "compute_dtype": "bf16"}])
def test_host_bytes_equal_engine_allocation(clip, kw):
    spec = discover(tiny_config("llama"))
    cfg = EngineConfig(device="cpu", **kw)
    opt = OptimizerConfig(max_grad_norm=clip)
    engine = StreamingEngine(spec, cfg, opt, 1)
    try:
        store = engine.store
        bufs = [store.master, store.exp_avg, store.exp_avg_sq] + ([store.copy] if store.copy is not None else [])
        gb = engine.grad_buffers
        bufs += [gb._buf] if gb.per_unit else gb._slabs
        allocated = sum(b.numel() * b.element_size() for b in bufs)
    finally:
        engine.close()
    assert host_bytes(spec, cfg, opt) == allocated


def test_recommendation_fits_and_grows_with_memory():
    spec = discover(preset_config("qwen2.5-7b"))
    small = recommend(spec, 1024, 128, gpu_mem_gb=24, host_mem_gb=128)
    big = recommend(spec, 1024, 128, gpu_mem_gb=80, host_mem_gb=128)
    assert small["fits"] and big["fits"]
    assert big["micro_batch_size"] > small["micro_batch_size"]
    cfg = EngineConfig(device="cpu", compute_dtype="bf16", checkpoint_every=small["checkpoint_every"])
    assert device_bytes(spec, cfg, small["micro_batch_size"], 1024, 128)["total"] <= 24 * 0.9 * 2**30


def test_recommendation_keeps_small_models_resident_and_streams_large_ones():
    """The measured crossover: resident with 8k-token micro-batches (1.5B, 3B), streaming at 7B."""
    for shape, batch, schedule in (("qwen2.5-1.5b", 64, "resident"), ("qwen2.5-3b", 88, "resident"),
                                   ("qwen2.5-7b", 128, "stream")):
        rec = recommend(discover(preset_config(shape)), 1024, batch, gpu_mem_gb=80, host_mem_gb=1024)
        assert rec["schedule"] == schedule, shape
        assert rec["micro_batch_size"] * 1024 >= (8192 if schedule == "resident" else 1024)
    tight = recommend(discover(preset_config("qwen2.5-1.5b")), 1024, 64, gpu_mem_gb=24, host_mem_gb=1024)
    assert tight["schedule"] == "stream"  # 24 GB: no 8k-token micro-batch fits beside the whole model


def test_liger_kernels_shrink_the_modelled_activations_as_measured():
    """H100, 3B resident, micro 11 x 1024, Liger, loss chunk 2048: 58.0 GiB measured (81.9 modelled
    before the model knew Liger's norms and SwiGLU keep less)."""
    spec = discover(preset_config("qwen2.5-3b"))
    cfg = EngineConfig(device="cuda", compute_dtype="bf16", schedule="resident", kernels="liger", stream_master=True,
                       grad_dtype="compute", loss_chunk_tokens=2048)
    predicted = device_bytes(spec, cfg, 11, 1024, 88)["total"] / 2**30
    assert 58.0 <= predicted <= 58.0 * 1.1
    torch_kernels = device_bytes(spec, cfg.model_copy(update={"kernels": "torch"}), 11, 1024, 88)["total"] / 2**30
    assert torch_kernels > 1.3 * predicted


def test_impossible_shape_says_so():
    spec = discover(preset_config("qwen2.5-7b"))
    rec = recommend(spec, 32768, 64, gpu_mem_gb=8, host_mem_gb=128)
    assert not rec["fits"] and "does not fit" in rec["reason"]


def _peak_step_bytes(engine: StreamingEngine, mbs: list[dict]) -> int:
    """Peak bytes allocated during one step on CPU (the profiler's allocation events replayed in
    time order), where every 'device' tensor is a CPU tensor and the host store exists beforehand."""
    engine.train_step(mbs)  # warm-up: lazily built tables are not part of a step's peak
    engine.synchronize()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        engine.train_step(mbs)
        engine.synchronize()
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize(("schedule", "k", "micro", "tied", "chunk"), [
    ("stream", 2, 4, True, 256),  # recompute of a block dominates
    ("stream", 4, 2, False, 256),
    ("stream", 1, 4, False, 512),  # the loss chunk's logits dominate
    # The resident model errs high (H100: +6..+9% at 1.5B, 3B and 7B): never under, at most 30% over (this
    # CPU profile of one step reads 166-177 MiB depending on what ran before it in the process; CI read 166).
    ("resident", 4, 4, True, 256),  # all layers' activations dominate
    ("resident", 4, 2, False, 512),  # weights, gradient sums and the loss chunk weigh most
])
def test_device_model_is_close_to_the_measured_peak(schedule, k, micro, tied, chunk):
    cfg = tiny_config("qwen2", hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=8000, tie_word_embeddings=tied)
    spec = discover(cfg)
    ecfg = EngineConfig(device="cpu", compute_dtype="fp32", schedule=schedule, checkpoint_every=k,
                        loss_chunk_tokens=chunk)
    g = torch.Generator().manual_seed(0)
    mbs = [{"input_ids": torch.randint(0, 8000, (micro, 256), generator=g)} for _ in range(4)]
    engine = StreamingEngine(spec, ecfg, OptimizerConfig(), 4)
    try:
        engine.load_random(0)
        measured = _peak_step_bytes(engine, mbs)
    finally:
        engine.close()
    predicted = device_bytes(spec, ecfg, micro, 256, 4 * micro)["total"]
    low, high = (0.90, 1.10) if schedule == "stream" else (1.0, 1.30)
    assert low <= predicted / measured <= high, (predicted / 2**20, measured / 2**20)
