"""Resource calculator: host and device memory of a run, and the batch shape that fits.

Host memory is exact (it is the engine's own allocation plan). Device memory is a model of the
schedule's peak (streaming: the backward of one block: checkpoints of every micro-batch, K layers
plus prefetched ones, one micro-batch's recompute activations, fp32 gradient accumulators;
resident: every weight and gradient sum and one micro-batch's activations through all layers),
with per-token activation bytes counted from the decoder layer's shapes. Step time is predicted
from the machine's matmul rate and link bandwidth (defaults: the lent H100's measured figures).
An image-text model adds its vision tower: given the image tokens per sample, the block outputs a
step keeps on the device (every block's, for every sample with images) and the tower's compute.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from mt_ray.engine.config import EngineConfig, OptimizerConfig
from mt_ray.engine.host_store import plan_layout
from mt_ray.models.discovery import ModelSpec
from mt_ray.models.vision import VISION_PROJECTOR

GIB = 1024**3
# Larger micro-batches gain nothing measurable on an H100 (7B: 16 x 1k and 1 x 16k run alike), while
# the backward's temporaries, which the device model does not count, grow with them.
MAX_MICRO_TOKENS = 16384
# The resident schedule saves the recompute but exposes the optimizer pass, and its micro-batch
# shares the GPU with every weight and gradient sum. Measured on the H100 (seq 1024), it wins with
# 8k-token micro-batches (1.5B: 2.34 vs 2.67 s; 3B: 5.3 vs 6.06 s) and loses with 2k (7B: 18.5 vs 15.8 s).
RESIDENT_MIN_MICRO_TOKENS = 8192


@dataclass(frozen=True)
class Machine:
    """Measured ceilings used for time predictions (H100 PCIe host, see PERFORMANCE.md)."""

    layer_tflops: float = 500.0  # bf16 decoder-layer fwd+bwd throughput
    h2d_gbps: float = 50.0
    adam_gparams_per_s: float = 3.0


def grad_buffer_bytes(numels: dict[str, int], dtype: torch.dtype, per_unit: bool, slabs: int) -> int:
    """Host bytes of gradient landing buffers (all units with clipping, else a few slabs)."""
    return dtype.itemsize * (sum(numels.values()) if per_unit else slabs * max(numels.values()))


def grad_buffers_per_unit(cfg: EngineConfig, opt: OptimizerConfig) -> bool:
    """Whether every unit needs its own host gradient buffer rather than a few recycled slabs.

    With clipping every gradient waits for the global norm. In the resident schedule all gradients
    leave within the last micro-batch's backward, much faster than the optimizer drains slabs, so
    the engine thread could block on a slab while the GPU waits. That is reasoning, not a measured
    gain: on the H100 the 3B resident step without clipping (micro 4) took 6.06 s with slabs and
    6.31 s with per-unit buffers, both slower than the 5.9 s with clipping, for a cause not found.
    """
    return opt.max_grad_norm > 0 or cfg.schedule == "resident"


def host_bytes(spec: ModelSpec, cfg: EngineConfig, opt: OptimizerConfig) -> int:
    """Exactly what the engine allocates in host memory for state and gradient buffers."""
    dtype = cfg.dtype
    copy = None if cfg.stream_master or dtype == torch.float32 else dtype
    numels = {u.name: u.numel for u in spec.trainable_units}  # frozen units send no gradient
    per_unit = grad_buffers_per_unit(cfg, opt)
    return plan_layout(spec, copy).nbytes + grad_buffer_bytes(numels, cfg.grad_torch_dtype, per_unit, cfg.grad_slabs)


def activation_bytes_per_token(spec: ModelSpec, dtype_bytes: int = 2, kernels: str = "torch") -> int:
    """Bytes autograd keeps per token for one decoder layer.

    transformers' norms hold fp32 temporaries and its MLP keeps act(gate) as well. Liger's norms
    keep only their input, which the layer holds anyway, and its SwiGLU recomputes act(gate)
    (H100, 3B resident, micro 11: 92.6 KB per token per layer measured, 92.5 modelled).
    """
    c = spec.text_config
    d = c.hidden_size
    head_dim = getattr(c, "head_dim", None) or d // c.num_attention_heads
    q = c.num_attention_heads * head_dim
    kv = c.num_key_value_heads * head_dim
    inter = getattr(c, "intermediate_size", 4 * d)
    attn = (d + 3 * q + 4 * kv + d) * dtype_bytes  # qkv, rotary temporaries, attention out, o_proj in
    if kernels == "liger":
        return attn + (d + 3 * inter) * dtype_bytes  # gate, up, act*up
    norms = 2 * d * (4 + 4 + dtype_bytes)  # two RMSNorms: fp32 input, fp32 normalised, its cast back
    mlp = (d + 4 * inter) * dtype_bytes  # gate, up, act(gate), act*up
    return norms + attn + mlp


def logit_bytes(dtype_bytes: int) -> int:
    """Device bytes per (token, vocab entry) of one loss chunk: logits, fp32 log-probabilities and
    their gradient; below fp32 also the logits' fp32 upcast and the gradient cast back."""
    return dtype_bytes + 4 + 4 + (4 + dtype_bytes if dtype_bytes < 4 else 0)


@dataclass(frozen=True)
class VisionSizes:
    """An image-text model's vision side, for `image_tokens` image tokens per sample."""

    patches: int  # per sample: image tokens times the tokens one merges (Qwen-VL: 2x2)
    tower_params: int
    tower_trains: bool
    projector_params: int
    projector_trains: bool
    hidden: int
    depth: int

    def kept_bytes(self, samples: int, dtype_bytes: int) -> int:
        """Every block's output for `samples` samples: kept on the device from the vision forward to its backward."""
        return samples * self.patches * self.hidden * self.depth * dtype_bytes

    def flops(self, samples: int, image_tokens: int) -> float:
        """Matmul FLOPs of a step: the tower once forward (recomputed and run backward when it trains: 8x
        instead of 2x), the projector forward, and again with its backward when anything trains."""
        tower = (8 if self.tower_trains else 2) * self.tower_params * self.patches
        projector = (8 if self.tower_trains or self.projector_trains else 2) * self.projector_params * image_tokens
        return samples * float(tower + projector)


def vision_sizes(spec: ModelSpec, image_tokens: int) -> VisionSizes | None:
    """None for a text model."""
    if spec.vision is None:
        return None
    vc = spec.config.vision_config
    tower = [u for u in spec.units if u.name.startswith("vision.") and u.name != VISION_PROJECTOR]
    projector = spec.unit(VISION_PROJECTOR)
    merge = getattr(vc, "spatial_merge_size", 1) ** 2
    return VisionSizes(image_tokens * merge, sum(u.numel for u in tower), not tower[0].frozen, projector.numel,
                       not projector.frozen, vc.hidden_size, len(spec.vision.blocks))


def device_bytes(spec: ModelSpec, cfg: EngineConfig, micro_batch: int, seq: int, global_batch: int,
                 image_tokens: int = 0) -> dict[str, int]:
    """Peak device memory of a step, by part (bytes); `image_tokens` per sample for an image-text model."""
    vision = vision_sizes(spec, image_tokens)
    if cfg.schedule == "resident":
        parts = _resident_device_bytes(spec, cfg, micro_batch * seq)
        if vision is not None and image_tokens:
            parts["vision_outputs"] = vision.kept_bytes(micro_batch, cfg.dtype.itemsize)
            parts["total"] += parts["vision_outputs"]
        return parts
    c = spec.text_config
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
        "recompute": k * mb_tokens * activation_bytes_per_token(spec, size, cfg.kernels),
        # fp32 sums of a block, plus the gradients on their way out (cast, or the sums themselves)
        "grad_accumulators": k * layer * 4 + (2 * layer * grad_size if grad_size < 4 else 0),
    }
    # The loss phase instead holds the head's fp32 gradient sum and one autograd gradient, and one
    # chunk of logits; the peak is whichever phase is larger.
    head_phase = _loss_chunk_bytes(spec, cfg, mb_tokens) + _lm_head_numel(spec) * 4
    parts["head_or_embed_extra"] = max(0, head_phase - parts["recompute"] - parts["grad_accumulators"])
    if vision is not None and image_tokens:  # every micro-batch's vision tape lives through the language model
        parts["vision_outputs"] = vision.kept_bytes(global_batch, size)
    parts["total"] = sum(parts.values())
    return parts


def _resident_device_bytes(spec: ModelSpec, cfg: EngineConfig, mb_tokens: int) -> dict[str, int]:
    """The resident schedule's peak: at a later micro-batch's loss, every weight, every fp32 gradient
    sum and that micro-batch's activations through all layers are held, plus one loss chunk."""
    size, grad_size = cfg.dtype.itemsize, cfg.grad_torch_dtype.itemsize
    layer = max(u.numel for u in spec.layer_units)
    parts = {
        "weights": spec.num_params * size + (layer * 4 if cfg.stream_master else 0),
        "grad_sums": spec.num_params * 4 + (2 * layer * grad_size if grad_size < 4 else 0),
        "activations": spec.num_layers * mb_tokens * activation_bytes_per_token(spec, size, cfg.kernels)
        + 2 * mb_tokens * spec.text_config.hidden_size * size,
        "loss_chunk": _loss_chunk_bytes(spec, cfg, mb_tokens),
    }
    parts["total"] = sum(parts.values())
    return parts


def _lm_head_numel(spec: ModelSpec) -> int:
    return spec.unit("embed" if spec.tied else "head").numel


def _loss_chunk_bytes(spec: ModelSpec, cfg: EngineConfig, mb_tokens: int) -> int:
    """One chunk of logits with its fp32 temporaries, and the LM head's autograd gradient."""
    size = cfg.dtype.itemsize
    chunk = min(cfg.loss_chunk_tokens, mb_tokens)
    return _lm_head_numel(spec) * size + chunk * spec.text_config.vocab_size * logit_bytes(size)


def predicted_step_seconds(spec: ModelSpec, cfg: EngineConfig, seq: int, global_batch: int,
                           machine: Machine = Machine(), image_tokens: int = 0) -> float:
    """Compute or streaming, whichever bounds, plus the optimizer time the GPU waits for.

    Streaming: 8·N·T (full recompute), weights cross twice, and only the embedding's update is
    exposed (layers update under the next forward). Resident: 6·N·T, weights cross once, and the
    whole optimizer pass is exposed (the next step's first micro-batch waits for every layer).
    """
    tokens = global_batch * seq
    resident = cfg.schedule == "resident"
    flops = (6 if resident else 8) * spec.text_params * tokens
    vision = vision_sizes(spec, image_tokens)
    if vision is not None:
        flops += vision.flops(global_batch, image_tokens)
    compute = flops / (machine.layer_tflops * 1e12)
    stream_bytes = spec.num_params * (4 if cfg.stream_master else 2) * (1 if resident else 2)
    stream = stream_bytes / (machine.h2d_gbps * 1e9)
    exposed_opt = (spec.num_params if resident else spec.unit("embed").numel) / (machine.adam_gparams_per_s * 1e9)
    return max(compute, stream) + exposed_opt


def recommend(spec: ModelSpec, seq: int, global_batch: int, gpu_mem_gb: float, host_mem_gb: float,
              cfg: EngineConfig | None = None, opt: OptimizerConfig | None = None,
              max_micro_tokens: int = MAX_MICRO_TOKENS, image_tokens: int = 0) -> dict:
    """The schedule and the largest micro-batch (up to `max_micro_tokens` tokens) that fit the GPU.

    The resident schedule when a micro-batch of at least RESIDENT_MIN_MICRO_TOKENS fits beside the
    whole model; else streaming with K=4 (the measured default; prefetch depth follows K) unless
    only another K fits. Also the host memory needed and the predicted step time. `image_tokens`: an
    image-text model's image tokens per sample (part of `seq`).
    """
    cfg = cfg or EngineConfig(device="cpu", compute_dtype="bf16")
    opt = opt or OptimizerConfig()
    budget = gpu_mem_gb * GIB * 0.9  # headroom for the allocator and the CUDA context
    sizes = [mb for mb in _divisors_desc(global_batch) if mb * seq <= max_micro_tokens] or [1]

    def option(schedule: str, k: int, mb: int) -> tuple[EngineConfig, int, int]:
        c = cfg.model_copy(update={"schedule": schedule, "checkpoint_every": k})
        return c, mb, device_bytes(spec, c, mb, seq, global_batch, image_tokens)["total"]

    resident = (option("resident", cfg.checkpoint_every, mb) for mb in sizes if mb * seq >= RESIDENT_MIN_MICRO_TOKENS)
    streamed = (option("stream", k, mb) for mb in sizes for k in (4, 2, 8, 1))
    best = next((o for o in itertools.chain(resident, streamed) if o[2] <= budget), None)  # best first
    chosen = best[0] if best else cfg
    host = host_bytes(spec, chosen, opt)
    out = {
        "params": spec.num_params, "seq": seq, "global_batch": global_batch,
        "host_gib": host / GIB, "host_bytes_per_param": host / spec.num_params, "host_fits": host <= host_mem_gb * GIB,
        "predicted_step_s": predicted_step_seconds(spec, chosen, seq, global_batch, image_tokens=image_tokens),
    }
    vision = vision_sizes(spec, image_tokens)
    if vision is not None:
        out.update(vision_tower_params=vision.tower_params, vision_projector_params=vision.projector_params,
                   image_tokens=image_tokens, vision_patches_per_sample=vision.patches)
    if best is None:
        out.update(fits=False, reason="even one sequence per micro-batch does not fit; lower seq or global_batch")
    else:
        out.update(fits=True, schedule=chosen.schedule, checkpoint_every=chosen.checkpoint_every,
                   micro_batch_size=best[1], device_gib=best[2] / GIB)
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
    vision = vision_sizes(spec, 0)
    if vision is not None:
        bf16_copy = 2  # the streamed compute-dtype copy, as above
        tower_bytes = vision.tower_params * (4 + bf16_copy + (0 if not vision.tower_trains else 8 + bf16_copy))
        lines += [
            f"vision tower: {vision.depth} blocks, {vision.tower_params / 1e6:.1f} M params "
            f"({'trained' if vision.tower_trains else 'frozen: no moments, no gradient'}), "
            f"host memory {tower_bytes / GIB:.2f} GiB",
            f"projector: {vision.projector_params / 1e6:.1f} M params ({'trained' if vision.projector_trains else 'frozen'})",
            f"language model: {spec.text_params / 1e9:.3f} B params",
        ]
    return "\n".join(lines)


def _divisors_desc(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]
