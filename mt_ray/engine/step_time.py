"""Step time: a model of how long a training step takes on a machine, from its FLOPs, what crosses the host
link and the disk, and the optimizer time the GPU cannot hide.

Apart from the memory models (sizing.py) because it answers another question with other inputs: the machine's
measured matmul rate, link bandwidth, Adam throughput and disk rates (`Machine`; defaults: the lent H100's
figures). The calculator ranks the configurations that fit by it.
"""

from __future__ import annotations

from dataclasses import dataclass

from mt_ray.engine.config import EngineConfig, OptimizerConfig
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

    layer_tflops: float = 500.0  # bf16 decoder-layer fwd+bwd throughput
    h2d_gbps: float = 50.0  # the host link, each direction (pinned copies run at 48-55 GB/s either way)
    adam_gparams_per_s: float = 3.0
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


def predicted_step_seconds(spec: ModelSpec, cfg: EngineConfig, seq: int, global_batch: int,
                           machine: Machine = Machine(), image_tokens: int = 0, stage: Stage = SFT,
                           micro_batch: int | None = None, opt: OptimizerConfig | None = None) -> float:
    """Compute or the host link, whichever bounds, plus what the GPU waits for: the optimizer time
    it cannot hide, and the uploads a prefetch shallower than K leaves exposed.

    Streaming: 8·N·T (full recompute), weights cross twice, and only the embedding's update is
    exposed (layers update under the next forward). Resident: 6·N·T, weights cross once, and the
    whole optimizer pass is exposed (the next step's first micro-batch waits for every layer).
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
    flops = (6 if resident else 8) * (spec.text_params * tokens + attention_flops(spec.text_config, tokens, seq) / 6)
    if runs_chunked(cfg, seq):  # micro-batches of a sequence or more run in chunks
        flops += 2 * chunked_numel(spec) * tokens
    vision = vision_sizes(spec, image_tokens)
    if vision is not None:
        flops += vision.flops(global_batch, image_tokens)
    if stage.head_again:
        flops += 2 * lm_head_numel(spec) * tokens
    if stage.reference:
        flops += 2 * (spec.text_params * tokens + attention_flops(spec.text_config, tokens, seq) / 6)
    kept, n_micro = kept_count(cfg), max(1, global_batch // (micro_batch or global_batch))
    blocks = num_blocks(spec, cfg)
    if kept:
        layers_numel = sum(u.numel for u in spec.layer_units)
        recompute = 2 * (layers_numel * tokens + attention_flops(spec.text_config, tokens, seq) / 6)
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
    exposed = n if resident else spec.unit("embed").numel
    exposed_opt = exposed / (machine.adam_gparams_per_s * 1e9)
    # A block's first micro-batch waits for the K - depth uploads not yet in flight, each pass.
    layer_upload = max(u.numel for u in spec.layer_units) * weight_size / (machine.h2d_gbps * 1e9)
    depth = cfg.prefetch_units or cfg.checkpoint_every
    stall = 0.0 if resident else 2 * blocks * max(0, cfg.checkpoint_every - depth) * layer_upload
    if cfg.state_placement == "host":
        return max(compute, link) + exposed_opt + stall
    clips = (opt or OptimizerConfig()).max_grad_norm > 0
    return _disk_step_seconds(spec, cfg, machine, compute, link, exposed_opt, clips) + stall


# Of a streamed step's FLOPs, the forward's share: one pass of four (forward, recompute, backward's two).
STREAM_FORWARD_SHARE = 1 / 4


def _disk_step_seconds(spec: ModelSpec, cfg: EngineConfig, machine: Machine, compute: float, link: float,
                       exposed_opt: float, clips: bool) -> float:
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
    optimizer_pass = max(machine.disk_seconds(plan.disk_bytes), trained / (machine.adam_gparams_per_s * 1e9))
    if cfg.schedule == "resident":
        return max(compute, link) + optimizer_pass
    window = machine.disk_seconds(cfg.nvme_window * plan.slot_bytes) / 2  # a window's chunks moved one way
    idle = compute * ((1 - STREAM_FORWARD_SHARE) if clips else STREAM_FORWARD_SHARE)
    embed = machine.disk_seconds(plan.file_bytes.get("embed", 0))
    return max(compute + exposed_opt + max(0.0, embed - window), link, idle + optimizer_pass - min(idle, window))
