"""Resource calculator: host and device memory of a run, and the batch shape that fits.

Host memory is exact (it is the engine's own allocation plan). Device memory is a model of the
schedule's peak (the backward of one block: checkpoints of every micro-batch, K resident layers
plus prefetched ones, one micro-batch's recompute activations, fp32 gradient accumulators),
with per-token activation bytes counted from the decoder layer's shapes. Step time is predicted
from the machine's matmul rate and link bandwidth (defaults: the lent H100's measured figures).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mt_ray.engine.config import EngineConfig, OptimizerConfig
from mt_ray.engine.host_store import plan_layout
from mt_ray.models.discovery import ModelSpec

GIB = 1024**3
# Larger micro-batches gain nothing measurable on an H100 (7B: 16 x 1k and 1 x 16k run alike), while
# the backward's temporaries, which the device model does not count, grow with them.
MAX_MICRO_TOKENS = 16384


@dataclass(frozen=True)
class Machine:
    """Measured ceilings used for time predictions (H100 PCIe host, see PERFORMANCE.md)."""

    layer_tflops: float = 500.0  # bf16 decoder-layer fwd+bwd throughput
    h2d_gbps: float = 50.0
    adam_gparams_per_s: float = 3.0


def grad_buffer_bytes(numels: dict[str, int], dtype: torch.dtype, per_unit: bool, slabs: int) -> int:
    """Host bytes of gradient landing buffers (all units with clipping, else a few slabs)."""
    return dtype.itemsize * (sum(numels.values()) if per_unit else slabs * max(numels.values()))


def host_bytes(spec: ModelSpec, cfg: EngineConfig, opt: OptimizerConfig) -> int:
    """Exactly what the engine allocates in host memory for state and gradient buffers."""
    dtype = cfg.dtype
    copy = None if cfg.stream_master or dtype == torch.float32 else dtype
    numels = {u.name: u.numel for u in spec.units}
    return plan_layout(spec, copy).nbytes + grad_buffer_bytes(numels, cfg.grad_torch_dtype, opt.max_grad_norm > 0, cfg.grad_slabs)


def activation_bytes_per_token(spec: ModelSpec, dtype_bytes: int = 2) -> int:
    """Bytes autograd keeps per token for one decoder layer (norms hold fp32 temporaries)."""
    c = spec.config
    d = c.hidden_size
    head_dim = getattr(c, "head_dim", None) or d // c.num_attention_heads
    q = c.num_attention_heads * head_dim
    kv = c.num_key_value_heads * head_dim
    inter = getattr(c, "intermediate_size", 4 * d)
    norms = 2 * d * (4 + 4 + dtype_bytes)  # two RMSNorms: fp32 input, fp32 normalised, its cast back
    attn = (d + 3 * q + 4 * kv + d) * dtype_bytes  # qkv, rotary temporaries, attention out, o_proj in
    mlp = (d + 4 * inter) * dtype_bytes  # gate, up, act(gate), act*up
    return norms + attn + mlp


def logit_bytes(dtype_bytes: int) -> int:
    """Device bytes per (token, vocab entry) of one loss chunk: logits, fp32 log-probabilities and
    their gradient; below fp32 also the logits' fp32 upcast and the gradient cast back."""
    return dtype_bytes + 4 + 4 + (4 + dtype_bytes if dtype_bytes < 4 else 0)


def device_bytes(spec: ModelSpec, cfg: EngineConfig, micro_batch: int, seq: int, global_batch: int) -> dict[str, int]:
    """Peak device memory of a step, by part (bytes)."""
    c = spec.config
    d, k, n_layers = c.hidden_size, cfg.checkpoint_every, spec.num_layers
    size, grad_size = cfg.dtype.itemsize, cfg.grad_torch_dtype.itemsize
    layer = max(u.numel for u in spec.layer_units)
    depth = cfg.prefetch_units or k
    hold = max(k, 2)  # units the schedule uses at once (a block, or the head with a tied embedding)
    tokens, mb_tokens = global_batch * seq, micro_batch * seq
    parts = {
        "weights": (depth + hold) * layer * size + (layer * 4 if cfg.stream_master else 0),
        "checkpoints": math.ceil(n_layers / k) * tokens * d * size,
        "hidden_and_grad": 2 * tokens * d * size,
        "recompute": k * mb_tokens * activation_bytes_per_token(spec, size),
        # fp32 sums of a block, plus the gradients on their way out (cast, or the sums themselves)
        "grad_accumulators": k * layer * 4 + (2 * layer * grad_size if grad_size < 4 else 0),
    }
    # The loss phase instead holds the head's fp32 gradient sum and one autograd gradient, and one
    # chunk of logits; the peak is whichever phase is larger.
    lm_head = spec.unit("embed" if spec.tied else "head").numel
    head_phase = lm_head * (4 + size) + min(cfg.loss_chunk_tokens, mb_tokens) * c.vocab_size * logit_bytes(size)
    parts["head_or_embed_extra"] = max(0, head_phase - parts["recompute"] - parts["grad_accumulators"])
    parts["total"] = sum(parts.values())
    return parts


def predicted_step_seconds(spec: ModelSpec, cfg: EngineConfig, seq: int, global_batch: int,
                           machine: Machine = Machine()) -> float:
    """Compute (8·N·T with full recompute) or streaming, whichever bounds; optimizer start-up exposed."""
    tokens = global_batch * seq
    compute = 8 * spec.num_params * tokens / (machine.layer_tflops * 1e12)
    stream_bytes = spec.num_params * (4 if cfg.stream_master else 2) * 2
    stream = stream_bytes / (machine.h2d_gbps * 1e9)
    exposed_opt = spec.unit("embed").numel / (machine.adam_gparams_per_s * 1e9)
    return max(compute, stream) + exposed_opt


def recommend(spec: ModelSpec, seq: int, global_batch: int, gpu_mem_gb: float, host_mem_gb: float,
              cfg: EngineConfig | None = None, opt: OptimizerConfig | None = None,
              max_micro_tokens: int = MAX_MICRO_TOKENS) -> dict:
    """The largest micro-batch (up to `max_micro_tokens` tokens) that fits the GPU, with K=4 (the
    measured default; prefetch depth follows K) unless only another K fits it; host needs and step time."""
    cfg = cfg or EngineConfig(device="cpu", compute_dtype="bf16")
    opt = opt or OptimizerConfig()
    budget = gpu_mem_gb * GIB * 0.9  # headroom for the allocator and the CUDA context
    sizes = [mb for mb in _divisors_desc(global_batch) if mb * seq <= max_micro_tokens] or [1]

    def need(k: int, mb: int) -> int:
        return device_bytes(spec, cfg.model_copy(update={"checkpoint_every": k}), mb, seq, global_batch)["total"]

    candidates = ((k, mb, need(k, mb)) for mb in sizes for k in (4, 2, 8, 1))  # best first
    best = next((c for c in candidates if c[2] <= budget), None)
    host = host_bytes(spec, cfg, opt)
    out = {
        "params": spec.num_params, "seq": seq, "global_batch": global_batch,
        "host_gib": host / GIB, "host_bytes_per_param": host / spec.num_params, "host_fits": host <= host_mem_gb * GIB,
        "predicted_step_s": predicted_step_seconds(spec, cfg, seq, global_batch),
    }
    if best is None:
        out.update(fits=False, reason="even one sequence per micro-batch does not fit; lower seq or global_batch")
    else:
        out.update(fits=True, checkpoint_every=best[0], micro_batch_size=best[1], device_gib=best[2] / GIB)
    return out


def render_recommendation(rec: dict) -> str:
    lines = [f"{k:>22}: {v:.3g}" if isinstance(v, float) else f"{k:>22}: {v}" for k, v in rec.items()]
    return "\n".join(lines)


def describe_model(spec: ModelSpec) -> str:
    """Layer kinds, parameter counts and host bytes needed, for `mt-ray info`."""
    kinds: dict[str, int] = {}
    for u in spec.layer_units:
        kinds[u.kind] = kinds.get(u.kind, 0) + 1
    bf16 = host_bytes(spec, EngineConfig(device="cpu", compute_dtype="bf16", grad_dtype="compute"),
                      OptimizerConfig(max_grad_norm=0))
    lines = [
        f"model_type: {spec.config.model_type}",
        f"parameters: {spec.num_params / 1e9:.3f} B (embedding {spec.unit('embed').numel / 1e6:.1f} M, "
        f"head {spec.unit('head').numel / 1e6:.1f} M, tied={spec.tied})",
        f"layers: {spec.num_layers}",
        *[f"  {kind}: {n} layers, {next(u.numel for u in spec.layer_units if u.kind == kind) / 1e6:.1f} M params each"
          for kind, n in kinds.items()],
        f"host memory (bf16 copy, no clipping): {bf16 / GIB:.1f} GiB ({bf16 / spec.num_params:.1f} B/param)",
    ]
    return "\n".join(lines)


def _divisors_desc(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]
