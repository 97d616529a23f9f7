"""The parts a `StreamingEngine` is built from, and the checks that refuse a combination before any is allocated.

Kept out of the engine so that its constructor reads as the list of its parts: which combinations of seams and
placements run, the model's kernels and attention, the gradient path (host store, landing buffers, optimizers
and their thread) and the weight streamer.
"""

from __future__ import annotations

import logging

import torch

from mt_ray.engine.config import EngineConfig, OptimizerConfig
from mt_ray.engine.host_store import HostStore, state_placement
from mt_ray.engine.optimizer import UnitOptimizer
from mt_ray.engine.optimizer_worker import OptimizerWorker
from mt_ray.engine.reference import WithReference
from mt_ray.engine.seams import GradSink, ReferenceSource, UnitVersions, WeightSource
from mt_ray.engine.sizing import grad_buffer_bytes, grad_buffers_per_unit
from mt_ray.engine.transfer import GradBuffers, StreamSet, WeightStreamer, WithOwners
from mt_ray.errors import ConfigError
from mt_ray.models.attention import resolve_attention
from mt_ray.models.chunking import apply_token_chunks
from mt_ray.models.discovery import ModelSpec
from mt_ray.models.grouped_experts import apply_grouped_experts
from mt_ray.models.kernels import apply_kernels

logger = logging.getLogger(__name__)


def check_seams(spec: ModelSpec, stage: str, grad_sink: GradSink | None, weight_source: WeightSource | None) -> None:
    """Refuse seams given apart, and a preference or GRPO stage on an image-text model."""
    if (grad_sink is None) != (weight_source is None):
        raise ValueError("grad_sink and weight_source are given together or not at all")
    if stage != "sft" and spec.vision is not None:
        raise ValueError(f"stage {stage} runs on a text model, for now")


def check_placement(spec: ModelSpec, cfg: EngineConfig, stage: str, local: bool) -> None:
    """Refuse a state placement the engine does not run with the given trainer (`local`: its own) and stage."""
    if not local and cfg.state_placement != "host":
        raise ConfigError(f"engine.state_placement: {cfg.state_placement} runs on a single engine for now (the "
                          "data-parallel shards keep their state in shared memory); use cluster.num_workers: 1, "
                          "or state_placement: host")
    if spec.mirrors and (not local or cfg.state_placement == "nvme"):
        raise ConfigError(f"'{spec.config.model_type}' ties weights between layers, which train as one tensor on "
                          "a single engine with the master in host memory for now; use cluster.num_workers: 1 "
                          "and engine.state_placement: host or nvme_moments")
    if stage != "sft" and cfg.state_placement == "nvme":
        raise ConfigError(f"stage {stage} snapshots the master as its reference, which state_placement: nvme keeps "
                          "on disk; use state_placement: nvme_moments or host")


def maybe_cap_device_memory(device: torch.device, limit_gb: float | None) -> None:
    """Let the caching allocator hand out at most `limit_gb` GiB (a smaller card, emulated): past it,
    an allocation fails as it would on that card."""
    if limit_gb is None or device.type != "cuda":
        return
    index = device.index if device.index is not None else torch.cuda.current_device()  # both need an index
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, limit_gb * 2**30 / total), index)


def apply_model_options(spec: ModelSpec, cfg: EngineConfig, device: torch.device) -> None:
    """Set the attention backend, kernels and token chunks on `spec`'s modules: before any allocation, and before
    the templates are built from them."""
    spec.config._attn_implementation = resolve_attention(spec, cfg.attn_implementation, device, cfg.dtype)
    apply_kernels(spec, cfg.kernels, device)
    if cfg.moe_experts == "grouped" and (notice := apply_grouped_experts(spec.skeleton)) is not None:
        logger.warning(notice)
    apply_token_chunks(spec, cfg.mlp_chunk_tokens)  # around whichever forward the kernels left


def build_grad_path(spec: ModelSpec, cfg: EngineConfig, opt_cfg: OptimizerConfig, grad_sink: GradSink | None,
                    grad_buffers: GradBuffers | None, pin: bool,
                    ) -> tuple[HostStore | None, GradBuffers, dict[str, UnitOptimizer], OptimizerWorker | GradSink]:
    """Where gradients go: the host store, the landing buffers (`grad_buffers`, else pinned ones of its own), the
    optimizers and the thread that runs them; given `grad_sink`, only the buffers and the sink (a trainer that
    keeps the weights elsewhere: no master weights or moments here)."""
    # The master on disk cannot be streamed: the copy stays, even in fp32.
    copy_dtype = None if (cfg.stream_master or cfg.dtype == torch.float32) and cfg.state_placement != "nvme" \
        else cfg.dtype
    numels = {u.name: u.numel for u in spec.trainable_units}  # frozen units send no gradient
    local = grad_sink is None
    # An outside sink ships each gradient on at once and frees its slab: a few slabs suffice.
    per_unit = local and grad_buffers_per_unit(cfg, opt_cfg)
    grad_bytes = grad_buffer_bytes(numels, cfg.grad_torch_dtype, per_unit, cfg.grad_slabs)
    store = HostStore(spec, copy_dtype, pin, grad_bytes, cfg.host_memory_limit_gb,
                      placement=state_placement(cfg)) if local else None
    buffers = grad_buffers or GradBuffers(numels, cfg.grad_torch_dtype, pin, per_unit=per_unit, slabs=cfg.grad_slabs)
    if not local:
        return store, buffers, {}, grad_sink
    optimizers = {u.name: UnitOptimizer(store, u, opt_cfg) for u in spec.trainable_units}
    worker = OptimizerWorker(store, optimizers, buffers, list(numels), opt_cfg.max_grad_norm,
                             cfg.optimizer_thread_count if pin else None)
    return store, buffers, optimizers, worker


def build_streamer(spec: ModelSpec, cfg: EngineConfig, streams: StreamSet, source: WeightSource,
                   versions: UnitVersions, reference: ReferenceSource | None) -> WeightStreamer:
    """The weight streamer over `source` (and a streamed `reference`'s units), uploading a unit once `versions`
    says its update has landed."""
    if spec.mirrors:  # a layer's mirrors take their values from their owners' updates
        versions = WithOwners(versions, {u: {m.owner for m in ms} for u, ms in spec.mirrors.items()})
    if reference is not None:
        source = versions = WithReference(source, reference, versions)
    # Streaming holds at most one block of K units at once, or the head with a tied embedding;
    # the resident schedule holds every unit (and the reference's) for the whole step.
    hold = len(spec.units) * (1 if reference is None else 2) if cfg.schedule == "resident" \
        else max(cfg.checkpoint_every, 2)
    return WeightStreamer(source, streams, cfg.dtype, cfg.prefetch_units or cfg.checkpoint_every, hold, versions)


class StepWeights:
    """A unit's flat device weights in a step: its next upload, or, when resident, the step's kept copy.

    A part of its own, not an engine method, so that the parts it is handed to (the head, the vision stage)
    hold no reference back to the engine: a closed engine is then freed, device memory included, as soon as
    its last reference goes, not whenever the garbage collector next runs.
    """

    def __init__(self, streamer: WeightStreamer, resident: bool):
        self.streamer = streamer
        self.resident = resident
        self._kept: dict[str, torch.Tensor] = {}

    def __call__(self, unit: str) -> torch.Tensor:
        flat = self._kept.get(unit)
        if flat is None:
            flat = self.streamer.next(unit)
            if self.resident:
                self._kept[unit] = flat
        return flat

    def clear(self) -> None:
        """Drop the step's kept copies (at a step's start and end)."""
        self._kept.clear()
