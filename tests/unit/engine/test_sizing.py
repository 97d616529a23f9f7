"""The calculator's host figure is the engine's own allocation, its device figure is within 10% of the
measured peak, and its batch choice fits its budget."""

import gc

import pytest
import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from mt_ray.engine import EngineConfig, OptimizerConfig, StreamingEngine
from mt_ray.engine.calculator import SEARCHED, recommend
from mt_ray.engine.sizing import device_bytes, host_bytes
from mt_ray.engine.step_time import predicted_step_seconds
from mt_ray.models.discovery import discover
from mt_ray.models.presets import preset_config
from tests.tiny_models import tiny_batches, tiny_config


@pytest.mark.parametrize("clip", [0.0, 1.0])
@pytest.mark.parametrize("kw", [{}, {"stream_master": True, "grad_dtype": "compute", "compute_dtype": "bf16"},
                                {"checkpoint_placement": "host", "checkpoint_every": 2}])
def test_host_bytes_equal_engine_allocation(clip, kw):
    """State, gradient buffers and, with host-placed checkpoints, the slab a step of 2 x (2 x 12) tokens fills."""
    spec = discover(tiny_config("llama"))
    cfg = EngineConfig(device="cpu", **kw)
    opt = OptimizerConfig(max_grad_norm=clip)
    engine = StreamingEngine(spec, cfg, opt, 1)
    try:
        engine.load_random()
        engine.train_step(tiny_batches())  # two micro-batches of 2 rows x 12 tokens
        store = engine.store
        bufs = [store.master, store.exp_avg, store.exp_avg_sq] + ([store.copy] if store.copy is not None else [])
        gb = engine.grad_buffers
        bufs += [gb._buf] if gb.per_unit else gb._slabs
        bufs += [engine.activations.slab] if cfg.checkpoint_placement == "host" else []
        allocated = sum(b.numel() * b.element_size() for b in bufs)
    finally:
        engine.close()
    assert host_bytes(spec, cfg, opt, seq=12, global_batch=4) == allocated


def test_recommendation_fits_its_budget():
    spec = discover(preset_config("qwen2.5-7b"))
    for gpu in (24, 80):
        rec = recommend(spec, 1024, 128, gpu_mem_gb=gpu, host_mem_gb=128)
        assert rec["fits"]
        cfg = EngineConfig(device="cpu", compute_dtype="bf16", **{k: rec[k] for k in SEARCHED})
        assert device_bytes(spec, cfg, rec["micro_batch_size"], 1024, 128)["total"] <= gpu * 0.9 * 2**30
        assert host_bytes(spec, cfg, OptimizerConfig(), 1024, 128) <= 125 * 2**30  # 3 GiB kept for the process


def test_recommendation_keeps_small_models_resident_and_streams_large_ones():
    """The measured crossover: resident with 8k-token micro-batches (1.5B, 3B), streaming at 7B. Measured against
    full recompute (with kept activations the model predicts streaming wins at 1.5B too: not measured yet). At 3B
    the model, which counts the host's whole Adam pass (2 G params/s) against the window a streamed step hides it
    in, predicts the two schedules alike (4.39 s each at 88 x 1k; measured on the H100: resident 5.3 s, stream
    6.06 s: the streamed step's overheads the model does not count)."""
    cfg = EngineConfig(device="cpu", compute_dtype="bf16", keep_activations=0)
    spec = discover(preset_config("qwen2.5-3b"))
    resident, stream = (predicted_step_seconds(spec, cfg.model_copy(update={"schedule": s}), 1024, 88, micro_batch=8)
                        for s in ("resident", "stream"))
    assert resident == pytest.approx(stream, rel=0.02)
    for shape, batch, schedule in (("qwen2.5-1.5b", 64, "resident"), ("qwen2.5-7b", 128, "stream")):
        rec = recommend(discover(preset_config(shape)), 1024, batch, gpu_mem_gb=80, host_mem_gb=1024, cfg=cfg)
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
    assert not rec["fits"] and rec["binding"] == "gpu" and "over the 7.2 GiB budget" in rec["reason"]


def _peak_step_bytes(engine: StreamingEngine, mbs: list[dict]) -> int:
    """Peak bytes allocated on CPU, where every 'device' tensor is a CPU tensor, over two steps: the
    profiler's allocation events replayed in time order. The second step's peak is the steady state's,
    counting what the first left live (gradients still in the outbox), as a GPU's peak would.

    Only blocks allocated in the window count, and the host slab of parked hidden states (host
    memory, allocated in the first step) does not: the CPU allocator also reports frees of blocks an
    earlier profiled window allocated (another test's engine, collected late), which would otherwise
    lower the figure depending on which tests ran before.
    """
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(2):
            engine.train_step(mbs)
        engine.synchronize()
    slab = getattr(engine.activations, "slab", None)
    host_ptrs = {slab.data_ptr()} if slab is not None else set()
    events, pending = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while pending:
        node = pending.pop()
        pending.extend(node.children)
        if node.tag == _EventType.Allocation and node.extra_fields.ptr not in host_ptrs:
            events.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size))
    live = peak = 0
    sizes: dict[int, int] = {}
    for _, ptr, size in sorted(events):
        if size > 0:
            sizes[ptr] = size
            live += size
        elif ptr in sizes:
            live -= sizes.pop(ptr)
        peak = max(peak, live)
    return peak


def _measure(cfg, ecfg: EngineConfig, micro: int, n_micro: int, seq: int = 256) -> int:
    g = torch.Generator().manual_seed(0)
    mbs = [{"input_ids": torch.randint(0, cfg.vocab_size, (micro, seq), generator=g)} for _ in range(n_micro)]
    engine = StreamingEngine(discover(cfg), ecfg, OptimizerConfig(), 4)
    try:
        engine.load_random(0)
        return _peak_step_bytes(engine, mbs)
    finally:
        engine.close()


@pytest.mark.parametrize(("schedule", "placement", "k", "micro", "tied", "chunk"), [
    ("stream", "device", 2, 4, True, 256),  # recompute of a block dominates
    ("stream", "device", 4, 2, False, 256),
    ("stream", "device", 1, 4, False, 512),  # the loss chunk's logits dominate
    ("stream", "host", 4, 2, False, 256),  # checkpoints in host memory: a few micro-batches' on the device
    ("stream", "host", 1, 4, False, 512),
    # The resident model errs high on the H100 (+6..+9% at 1.5B, 3B and 7B); here 0.96-1.02.
    ("resident", "device", 4, 4, True, 256),  # all layers' activations dominate
    ("resident", "device", 4, 2, False, 512),  # weights, gradient sums and the loss chunk weigh most
])
def test_device_model_is_close_to_the_measured_peak(schedule, placement, k, micro, tied, chunk):
    cfg = tiny_config("qwen2", hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=8000, tie_word_embeddings=tied)
    ecfg = EngineConfig(device="cpu", compute_dtype="fp32", schedule=schedule, checkpoint_every=k,
                        loss_chunk_tokens=chunk, checkpoint_placement=placement)
    measured = _measure(cfg, ecfg, micro, 4)
    predicted = device_bytes(discover(cfg), ecfg, micro, 256, 4 * micro)["total"]
    low, high = (0.90, 1.10) if schedule == "stream" else (0.95, 1.25)
    assert low <= predicted / measured <= high, (predicted / 2**20, measured / 2**20)


def test_host_checkpoints_keep_device_memory_flat_as_the_step_grows():
    """Four times the micro-batches: with checkpoints on the device the peak grows by their size, with them
    in host memory it stays, and the device model says both."""
    cfg = tiny_config("qwen2", hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=2000)
    spec = discover(cfg)
    peaks, predicted = {}, {}
    for placement in ("device", "host"):
        ecfg = EngineConfig(device="cpu", compute_dtype="fp32", checkpoint_every=1, checkpoint_placement=placement)
        for n in (4, 16):
            peaks[placement, n] = _measure(cfg, ecfg, 1, n, seq=64)
            predicted[placement, n] = device_bytes(spec, ecfg, 1, 64, n)["total"]
    hidden = 64 * 256 * 4  # one micro-batch's hidden state
    # At least the 4 blocks' checkpoints of 12 more micro-batches (the model also counts their carry)
    assert peaks["device", 16] - peaks["device", 4] >= 0.95 * 4 * 12 * hidden
    assert predicted["device", 16] - predicted["device", 4] == 5 * 12 * hidden
    # With them in host memory only the micro-batches' inputs and layer contexts (token ids, targets, positions,
    # rotary tables: under 512 B per token, a hidden state is 1 KiB) grow.
    assert peaks["host", 16] - peaks["host", 4] <= 12 * 64 * 512
    assert predicted["host", 16] == predicted["host", 4]


@pytest.mark.parametrize("model_type", ["gpt2", "opt", "xlstm", "falcon_mamba", "bloom", "persimmon",
                                        "gemma4_unified_text", "gemma3n_text"])
def test_the_device_model_sizes_families_without_grouped_keys_or_attention_heads(model_type):
    """`keep_activations: auto` sizes every block on CUDA: families whose configs name no key/value heads (GPT-2,
    OPT, ...), no attention heads at all (xLSTM), a head size per layer (Gemma 4) or an MLP width per layer (Gemma 3n)
    are sized too (on the H100 31 matched families failed here, then Gemma 3n)."""
    from tests.family_sweep import tiny_config as family_config

    spec = discover(family_config(model_type))
    for mlp_chunk in (None, 16):
        cfg = EngineConfig(device="cpu", compute_dtype="bf16", checkpoint_every=1, mlp_chunk_tokens=mlp_chunk,
                           keep_activations=1)
        parts = device_bytes(spec, cfg, 2, 64, 4)
        assert parts["recompute"] > 0 and parts["kept_activations"] > 0
