"""Step time: a model of how long a training step takes on a machine, from its FLOPs, what crosses the host
link and the disk, and the optimizer time the GPU cannot hide.

Apart from the memory models (sizing.py) because it answers another question with other inputs: the machine's
measured matmul rate, link bandwidth, Adam throughput and disk rates (`Machine`; defaults: the lent H100's
figures). The calculator ranks the configurations that fit by it.
"""

from __future__ import annotations

from dataclasses import dataclass

from mt_ray.engine.config import EngineConfig, OptimizerConfig
from mt_ray.engine.device_state import kept_bytes_per_param
from mt_ray.engine.sizing import (
    SFT,
    Stage,
    kept_count,
    lm_head_numel,
    num_blocks,
    runs_chunked,
    state_files_plan,
    vision_sizes,
)
from mt_ray.models.chunking import token_wise
from mt_ray.models.discovery import ModelSpec


@dataclass(frozen=True)
class Machine:
    """Measured ceilings used for time predictions (H100 PCIe host, see PERFORMANCE.md)."""

    # bf16 decoder-layer throughput, counted as 8·N·T a streamed step: the 7B step at 128 x 1024 ran at 452 model
    # TFLOPS (6·N·T) on an H200 and 445 on an H100 with Liger, 600 counted so (a layer alone: 497-524 as 6·N·T)
    layer_tflops: float = 600.0
    h2d_gbps: float = 50.0  # the host link, each direction (pinned copies run at 48-55 GB/s either way)
    # The host's AdamW over a whole state as the engine runs it, while the next step's weights stream: the one-pass
    # numba kernel (`optimizer.impl: numba`, 26 bytes a parameter through memory) updated the 8.1 B-parameter MoE
    # cut in 3.3-3.4 s busy on an H200's 16-core host (bench/results/moe_qwen3_30b_a3b_12l.json), where it alone
    # reaches 4.1-4.7 G params/s (bench/optimizer_host.py); torch's fused AdamW through an fp32 scratch copy
    # (`impl: torch`) 2 G params/s.
    adam_gparams_per_s: float = 2.6
    torch_adam_gparams_per_s: float = 2.0
    # The routed experts' rate against `layer_tflops` at the Qwen3-30B-A3B shape (2048 wide, 768-wide experts, 8 of
    # 128 a token) on an H200, fitted to the MoE suite's 128 and 512 x 1024 rows: mt-ray's grouped path
    # (`engine.moe_experts: grouped`) about half a dense layer's; transformers' grouped_mm banks about a third.
    experts_efficiency: float = 0.47
    transformers_experts_efficiency: float = 0.31
    # Direct read and write bandwidth of the disk under engine.nvme_path (`mt-ray calc --probe-disk`); None: no
    # disk to hold optimizer state, so the search keeps it in host memory.
    nvme_read_gbps: float | None = None
    nvme_write_gbps: float | None = None
    # Bytes read and written a second with both in flight at once (`measure_disk`'s mixed phase), as the
    # optimizer's read-ahead and write-back run; None: not measured, the two share the drive one after the other.
    nvme_mixed_gbps: float | None = None

    @property
    def has_nvme(self) -> bool:
        return self.nvme_read_gbps is not None and self.nvme_write_gbps is not None

    def disk_seconds(self, nbytes: int) -> float:
        """Reading `nbytes` of state and writing as many back: the read and the write one after the other at their
        own rates, or at the mixed rate where that is slower. On the H100's drive the step held 2.1 GB/s combined
        twice, where the probe's mixed phase said 2.42 and the serial sum 1.94 and 2.07: the step's queue is
        shallower than the probe's, so the mixed rate bounds the step and does not set it."""
        if not nbytes:
            return 0.0
        serial = nbytes / (self.nvme_read_gbps * 1e9) + nbytes / (self.nvme_write_gbps * 1e9)
        if self.nvme_mixed_gbps is None:
            return serial
        return max(serial, 2 * nbytes / (self.nvme_mixed_gbps * 1e9))

    def describe_disk(self) -> str:
        mixed = f", {self.nvme_mixed_gbps:.3g} GB/s both at once" if self.nvme_mixed_gbps is not None else ""
        return f"{self.nvme_read_gbps:.3g} GB/s read, {self.nvme_write_gbps:.3g} GB/s write{mixed}"


def attention_flops(config, tokens: int, span: int) -> float:
    """Causal attention matmul FLOPs (QK^T and PV) of `tokens` tokens each attending within `span`
    (a sequence, or a packed document), forward and backward, counted as 6x like the weights."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_attention_heads * head_dim * span  # causal: half of 2*2
    return 3 * per_token * tokens


def chunked_numel(spec: ModelSpec) -> int:
    """Parameters of the layers' token-wise parts (norms, dense MLPs): what `mlp_chunk_tokens` runs again."""
    total = 0
    for unit in spec.layer_units:
        parts = {name for name, child in spec.layer_kinds[unit.kind].named_children() if token_wise(child)}
        total += sum(p.numel for p in unit.params if p.local_name.split(".")[0] in parts)
    return total


# Of a streamed step's FLOPs, the forward's share: one pass of four (forward, recompute, backward's two).
STREAM_FORWARD_SHARE = 1 / 4


# Exposed optimizer time beyond this share of a step names the step optimizer-bound.
OPTIMIZER_BOUND_SHARE = 0.05


@dataclass(frozen=True)
class StepTime:
    """A predicted step and its parts (seconds): the GPU's compute, the busier direction of the host link, the
    host optimizer's pass over every trained parameter and the part of it the GPU waits for, and the uploads a
    prefetch shallower than K leaves exposed. `total` is the step; `bound` names what sets it."""

    total: float
    compute: float
    link: float
    optimizer: float
    optimizer_exposed: float
    stall: float = 0.0
    disk: bool = False

    @property
    def bound(self) -> str:
        """'optimizer' where the GPU waits for the host's Adam more than OPTIMIZER_BOUND_SHARE of the step, else
        what the rest of the step waits for: 'disk' (state on NVMe), 'link' or 'compute'."""
        if self.optimizer_exposed > OPTIMIZER_BOUND_SHARE * self.total:
            return "optimizer"
        if self.disk and self.total > 1.01 * (max(self.compute, self.link) + self.optimizer_exposed + self.stall):
            return "disk"
        return "link" if self.link > self.compute else "compute"


def compute_params(spec: ModelSpec, machine: Machine, experts: str = "grouped") -> float:
    """The parameters a token computes with, the routed experts' weighted by how much slower they run on the
    `experts` path (`EngineConfig.moe_experts`; `Machine.experts_efficiency`): what the step's FLOPs are counted on at
    `layer_tflops`."""
    efficiency = machine.experts_efficiency if experts == "grouped" else machine.transformers_experts_efficiency
    return spec.active_text_params + spec.routed_active_params * (1 / efficiency - 1)


def adam_seconds(numel: int, machine: Machine, opt: OptimizerConfig) -> float:
    """The host AdamW's pass over `numel` parameters with `opt.impl`'s rate (DeepSpeed's taken as torch's)."""
    rate = machine.adam_gparams_per_s if opt.impl == "numba" else machine.torch_adam_gparams_per_s
    return numel / (rate * 1e9)


def predicted_step_seconds(spec: ModelSpec, cfg: EngineConfig, seq: int, global_batch: int,
                           machine: Machine = Machine(), image_tokens: int = 0, stage: Stage = SFT,
                           micro_batch: int | None = None, opt: OptimizerConfig | None = None) -> float:
    """The step's predicted seconds (`step_time`'s total)."""
    return step_time(spec, cfg, seq, global_batch, machine, image_tokens, stage, micro_batch, opt).total


def step_time(spec: ModelSpec, cfg: EngineConfig, seq: int, global_batch: int, machine: Machine = Machine(),
              image_tokens: int = 0, stage: Stage = SFT, micro_batch: int | None = None,
              opt: OptimizerConfig | None = None) -> StepTime:
    """Compute or the host link, whichever bounds, plus what the GPU waits for: the optimizer time
    it cannot hide, and the uploads a prefetch shallower than K leaves exposed.

    A token computes with its active parameters (a mixture of experts: the routed experts it picks, at their
    own rate, `compute_params`); the link, the gradients and the optimizer carry all of them.
    Streaming: 8·N·T (full recompute), weights cross twice, and the optimizer pass over every trained
    parameter hides under the GPU's work where it is short enough: with clipping the updates wait for the norm
    and run in forward order under the next step's forward, which trails them; without, each unit updates as
    its gradient lands, under the backward, and the next forward waits for the backlog (the embedding, updated
    last, at least). Resident: 6·N·T, weights cross once, and the whole optimizer pass is exposed (the next
    step's first micro-batch waits for every layer).
    Gradients cross back once; hidden states parked in host memory cross both ways (per token,
    each block's checkpoint and the gradient flowing back). An image-text model's tokens compute with the
    language model alone; its vision tower adds `VisionSizes.flops` for `image_tokens` per sample.
    State on NVMe (`state_placement`) crosses the disk both ways once a step, pipelined as `_disk_step_seconds`
    says (`opt`: whether clipping orders the updates; default OptimizerConfig's). Causal attention over each sequence adds its FLOPs (recomputed too when streaming), and
    `mlp_chunk_tokens` one more forward of the layers' token-wise parts (2·N_chunked·T).
    A DPO or KTO head runs the LM head forward once more (2·N_head·T); a streamed reference runs forward
    (2·N·T and its attention) and crosses the link once a step in the compute dtype. Each kept block graph
    (`keep_activations`, one block for one `micro_batch`: default the whole batch) saves its recompute,
    2·N_block·T_micro plus its attention, and a block kept for every micro-batch its backward upload.
    """
    tokens = global_batch * seq
    n = spec.num_params
    resident = cfg.schedule == "resident"
    active = compute_params(spec, machine, cfg.moe_experts)
    opt = opt or OptimizerConfig()
    flops = (6 if resident else 8) * (active * tokens + attention_flops(spec.text_config, tokens, seq) / 6)
    if runs_chunked(cfg, seq):  # micro-batches of a sequence or more run in chunks
        flops += 2 * chunked_numel(spec) * tokens
    vision = vision_sizes(spec, image_tokens)
    if vision is not None:
        flops += vision.flops(global_batch, image_tokens)
    if stage.head_again:
        flops += 2 * lm_head_numel(spec) * tokens
    if stage.reference:
        flops += 2 * (active * tokens + attention_flops(spec.text_config, tokens, seq) / 6)
    kept, n_micro = kept_count(cfg), max(1, global_batch // (micro_batch or global_batch))
    blocks = num_blocks(spec, cfg)
    if kept:
        layers_active = active - (spec.text_params - sum(u.numel for u in spec.layer_units))
        recompute = 2 * (layers_active * tokens + attention_flops(spec.text_config, tokens, seq) / 6)
        flops -= recompute * min(kept, blocks * n_micro) / (blocks * n_micro)
    compute = flops / (machine.layer_tflops * 1e12)
    weight_size = 4 if cfg.stream_master else 2  # per parameter per pass
    h2d = n * weight_size * (1 if resident else 2) + (n * cfg.dtype.itemsize if stage.reference else 0)
    h2d -= min(kept // n_micro, blocks) * cfg.checkpoint_every * max(u.numel for u in spec.layer_units) * weight_size
    d2h = n * cfg.grad_torch_dtype.itemsize
    if cfg.checkpoint_placement == "host" and not resident:
        hidden = tokens * spec.text_config.hidden_size * cfg.dtype.itemsize
        h2d += (3 * blocks + 2) * hidden  # forward and backward fetches of checkpoints and gradients
        d2h += (2 * blocks + 2) * hidden
    link = max(h2d, d2h) / (machine.h2d_gbps * 1e9)
    clips = opt.max_grad_norm > 0
    # The units whose state the engine keeps on the GPU (`stage.device_state_bytes`, a prefix in forward order from
    # the embedding) update there in milliseconds: the host's pass covers the rest.
    on_device = stage.device_state_bytes // kept_bytes_per_param(cfg.grad_torch_dtype)
    optimizer = adam_seconds(max(0, sum(u.numel for u in spec.trainable_units) - on_device), machine, opt)
    embed_opt = 0.0 if on_device >= spec.unit("embed").numel else adam_seconds(spec.unit("embed").numel, machine, opt)
    # A block's first micro-batch waits for the K - depth uploads not yet in flight, each pass.
    layer_upload = max(u.numel for u in spec.layer_units) * weight_size / (machine.h2d_gbps * 1e9)
    depth = cfg.prefetch_units or cfg.checkpoint_every
    stall = 0.0 if resident else 2 * blocks * max(0, cfg.checkpoint_every - depth) * layer_upload
    if cfg.state_placement != "host":
        total = _disk_step_seconds(spec, cfg, machine, compute, link, embed_opt, opt) + stall
        return StepTime(total, compute, link, optimizer, embed_opt, stall, disk=True)
    if resident:
        exposed = optimizer
    else:  # the window the pass hides in: the next forward's (clipping) or the backward's
        window = compute * (STREAM_FORWARD_SHARE if clips else 1 - STREAM_FORWARD_SHARE)
        exposed = max(embed_opt, optimizer - window)
    return StepTime(max(compute, link) + exposed + stall, compute, link, optimizer, exposed, stall)


def _disk_step_seconds(spec: ModelSpec, cfg: EngineConfig, machine: Machine, compute: float, link: float,
                       exposed_opt: float, opt: OptimizerConfig) -> float:
    """A step whose optimizer state is on disk, as the engine's pipeline runs it (state_files.FileTier).

    The optimizer pass reads and writes every chunk of state once (`Machine.disk_seconds`), no faster than the
    CPU updates them. It starts at the step's first gradient and ends with the unit the next step needs first,
    so the disk waits while part of each step computes: without clipping the units update as their gradients
    land, embedding last, and the next forward waits for it (the disk waits through the forward); with clipping
    they update in forward order once the norm is known, the next forward trails the pass, and its backward
    runs after it (the disk waits through the backward). While it waits the disk only finishes the last
    write-backs and reads the next pass's first chunks: a window of them (`nvme_window`). Where compute is the
    longer part, the embedding (updated last, or first with clipping) waits for its chunks beyond the window.
    The resident schedule exposes the whole pass: the next step's first micro-batch needs every unit.
    """
    plan = state_files_plan(spec, cfg)
    trained = sum(u.numel for u in spec.trainable_units)
    optimizer_pass = max(machine.disk_seconds(plan.disk_bytes), adam_seconds(trained, machine, opt))
    clips = opt.max_grad_norm > 0
    if cfg.schedule == "resident":
        return max(compute, link) + optimizer_pass
    window = machine.disk_seconds(cfg.nvme_window * plan.slot_bytes) / 2  # a window's chunks moved one way
    idle = compute * ((1 - STREAM_FORWARD_SHARE) if clips else STREAM_FORWARD_SHARE)
    embed = machine.disk_seconds(plan.file_bytes.get("embed", 0))
    return max(compute + exposed_opt + max(0.0, embed - window), link, idle + optimizer_pass - min(idle, window))
