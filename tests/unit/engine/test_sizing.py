"""The calculator's host figure is the engine's own allocation; its batch choice fits its budget."""

import pytest

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
    small = recommend(spec, 1024, 128, gpu_mem_gb=40, host_mem_gb=128)
    big = recommend(spec, 1024, 128, gpu_mem_gb=140, host_mem_gb=128)
    assert small["fits"] and big["fits"]
    assert big["micro_batch_size"] >= small["micro_batch_size"]
    cfg = EngineConfig(device="cpu", compute_dtype="bf16", checkpoint_every=small["checkpoint_every"])
    assert device_bytes(spec, cfg, small["micro_batch_size"], 1024, 128)["total"] <= 40 * 0.9 * 2**30


def test_impossible_shape_says_so():
    spec = discover(preset_config("qwen2.5-7b"))
    rec = recommend(spec, 32768, 64, gpu_mem_gb=8, host_mem_gb=128)
    assert not rec["fits"] and "does not fit" in rec["reason"]
