"""The streaming engine: one training step of a model whose state lives in host memory.

Schedule of a step (L layers, blocks of K layers, M micro-batches):
  forward   embed every micro-batch, then block by block: every micro-batch through the block's
            K layers while their weights are resident (one upload serves the whole batch); the
            hidden state entering each block is parked (the checkpoints), and so is the last
            block's output.
  head      final norm + LM head + loss, forward and backward together, in token chunks so
            full-vocabulary fp32 logits never exist; each micro-batch's gradient is parked.
  backward  block by block from the last: upload the block's K layers once, then per
            micro-batch recompute the block from its checkpoint and run it backward layer by
            layer, parking the gradient for the block before. A layer's gradient leaves the
            device as soon as the last micro-batch has contributed to it. Finally the embedding.
            The first `keep_activations` block graphs in backward order (kept_blocks.py) are kept from
            the forward instead, and a block kept for every micro-batch is not uploaded again.
So each unit's weights cross the bus twice a step (forward, backward), and the optimizer
thread updates units while the backward pass continues. Parked hidden states wait on the
device or in pinned host memory (`checkpoint_placement`, see activations.py): slot b < L/K holds
block b's checkpoint, slot L/K the last block's output, then the gradient flowing back.

An evaluation (`evaluate`) is the forward and the head's chunked loss alone: one pass of the
weights, no gradient, nothing for the optimizer, and the templates in eval mode; its hidden
states are parked as a training step's are.

The resident schedule (`schedule: resident`, for models that fit) uploads each unit once a step
and keeps it, with an fp32 gradient sum per unit, on the device; every micro-batch then runs
embed -> layers -> head -> backward with its activations kept, so nothing is recomputed
(6·N·T instead of 8·N·T FLOPs). Gradients leave during the last micro-batch's backward.

Packed rows keep their documents apart: attention through each micro-batch's document bounds
(the varlen backend, `auto`'s choice on CUDA) or the masks transformers builds from the position
ids (SDPA, eager, flex), and layers with linear attention, short convolutions or Mamba by running each
document through them alone (`LayerContext`). A MoE config with `output_router_logits` adds the
family's router load-balancing loss (`RouterLoss`).

An image-text model adds its vision tower and projector (`VisionStage`): their units stream
before the language model's in the forward and after them in the backward; the image features
enter through the body's own scatter over the image tokens. Frozen units (the tower, by
default) have no moments and send no gradient.

A preference stage (`stage: dpo | kto`, see preference.py and reference.py) streams the reference's
units through the same loop, each block's after the policy's, and replaces the head's token loss with
per-sequence log-probs fed to the preference loss; the backward is unchanged. GRPO (`stage: grpo`,
grpo.py) is the same head with a per-token loss, and a reference only where its β is above 0.

Tensor shape key: B batch, T tokens, D hidden, N selected tokens, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import NamedTuple

import torch

from mt_ray.engine.activations import build_activation_store, streamed_step_plan
from mt_ray.engine.batch import MicroBatch, prepare_micro_batch
from mt_ray.engine.config import EngineConfig, OptimizerConfig
from mt_ray.engine.grad_sums import accumulate, spans_of
from mt_ray.engine.grpo import GrpoConfig, RolloutConfig
from mt_ray.engine.host_store import HostStore, state_placement
from mt_ray.engine.kept_blocks import KeptBlocks
from mt_ray.engine.optimizer import Spans, UnitOptimizer, counts_behind, lr_at, restore_counts
from mt_ray.engine.optimizer_worker import OptimizerWorker
from mt_ray.engine.preference import PreferenceConfig
from mt_ray.engine.reference import REF, WithReference, build_preference, eval_mode, forward_plan
from mt_ray.engine.seams import GradSink, ReferenceSource, WeightSource
from mt_ray.engine.sizing import Stage, grad_buffer_bytes, grad_buffers_per_unit
from mt_ray.engine.templates import UnitTemplate, Weights, build_templates
from mt_ray.engine.transfer import GradBuffers, Outbox, StreamSet, WeightStreamer, WithOwners
from mt_ray.engine.vision_stage import VisionStage, feature_leaves
from mt_ray.errors import ConfigError
from mt_ray.models.attention import resolve_attention
from mt_ray.models.chunking import apply_token_chunks
from mt_ray.models.context import LayerContext, LayerContextBuilder
from mt_ray.models.discovery import ModelSpec
from mt_ray.models.kernels import apply_kernels
from mt_ray.models.router_loss import RouterLoss
from mt_ray.models.side_channels import backward_terms, take_grads
from mt_ray.models.weights import export_hf, init_random, load_safetensors


class Segment(NamedTuple):
    """One recomputed layer ready for backward: its input (a leaf), output, router logits (where a router loss
    records them), what the body added after it, as a leaf (Qwen3-VL's deepstack features), and its arguments
    that carry a gradient to the embedding, as leaves with their keys (`LayerContext.track_inputs`)."""

    layer: int
    x: torch.Tensor
    out: torch.Tensor
    logits: torch.Tensor | None
    injected: torch.Tensor | None
    inputs: list[tuple[tuple[int, int, str], torch.Tensor]]


@dataclass
class StepResult:
    """What a step returns. Tensors stay on the device: read them only when logging.

    `loss` is what the step minimised: the mean token cross-entropy, plus `router_aux_loss_coef`
    times `aux_loss` where the MoE config asks for the router's load-balancing loss (as
    transformers' own loss); `aux_loss` is that loss, its micro-batches weighted by loss tokens.
    """

    loss: torch.Tensor
    grad_norm: torch.Tensor
    lr: float
    num_tokens: int
    num_loss_tokens: int
    aux_loss: torch.Tensor | None = None
    metrics: dict[str, torch.Tensor] | None = None  # a preference stage's rewards and log-probs (TRL's names)


@dataclass
class EvalResult:
    """What `evaluate` returns: the summed token loss (on the device: read it once per eval) and its counts."""

    loss_sum: torch.Tensor
    num_loss_tokens: int
    num_tokens: int
    pref_sums: dict[str, torch.Tensor] | None = None  # a preference stage's metric sums, and what they count
    pref_counts: dict[str, int] | None = None


class StreamingEngine:
    """Trains a model held in host memory by streaming its units through one device.

    `grad_sink` and `weight_source` (given together) replace the local optimizer thread and
    host store, for a trainer that keeps the weights elsewhere (mt_ray.cluster); the engine
    then allocates no master weights or moments of its own. `stage` `dpo` or `kto` trains on
    preference rows with the `pref` loss (such a trainer passes the `reference` it keeps), `grpo` on
    sampled completions with the `grpo` loss.
    """

    def __init__(self, spec: ModelSpec, cfg: EngineConfig, opt_cfg: OptimizerConfig, total_steps: int,
                 grad_sink: GradSink | None = None, weight_source: WeightSource | None = None,
                 grad_buffers: GradBuffers | None = None, stage: str = "sft", pref: PreferenceConfig | None = None,
                 grpo: GrpoConfig | None = None, reference: ReferenceSource | None = None,
                 rollout: RolloutConfig | None = None):
        """`grad_buffers`: where gradients land on the host, given by a trainer whose buffers are shared memory
        (mt_ray.cluster); by default the engine allocates its own pinned ones. `reference`: a preference stage's
        reference weights, given by a trainer that keeps them (with `weight_source`); by default a snapshot of
        the loaded weights in host memory. `rollout`: GRPO's rollout copy, its placement resolved (what
        `keep_activations: auto` leaves room for beside the step)."""
        if (grad_sink is None) != (weight_source is None):
            raise ValueError("grad_sink and weight_source are given together or not at all")
        if stage != "sft" and spec.vision is not None:
            raise ValueError(f"stage {stage} runs on a text model, for now")
        self.spec = spec
        self.cfg = cfg
        self.opt_cfg = opt_cfg
        self.total_steps = total_steps
        self.device = cfg.resolve_device()
        self.dtype = cfg.dtype
        self.step_idx = 0
        if cfg.gpu_memory_limit_gb is not None and self.device.type == "cuda":
            _cap_device_memory(self.device, cfg.gpu_memory_limit_gb)
        spec.config._attn_implementation = resolve_attention(spec, cfg.attn_implementation, self.device, self.dtype)
        apply_kernels(spec, cfg.kernels, self.device)  # before any allocation, and before the templates
        apply_token_chunks(spec, cfg.mlp_chunk_tokens)  # around whichever forward the kernels left
        # Before any state is sized or allocated: a family the layer context refuses is refused by name first.
        self.context = LayerContextBuilder(spec, self.device)
        pin = self.device.type == "cuda"
        # The master on disk cannot be streamed: the copy stays, even in fp32.
        copy_dtype = None if (cfg.stream_master or self.dtype == torch.float32) and cfg.state_placement != "nvme" \
            else self.dtype
        self.grad_dtype = grad_dtype = cfg.grad_torch_dtype
        numels = {u.name: u.numel for u in spec.trainable_units}  # frozen units send no gradient
        local = grad_sink is None
        # An outside sink ships each gradient on at once and frees its slab: a few slabs suffice.
        per_unit = local and grad_buffers_per_unit(cfg, opt_cfg)
        grad_bytes = grad_buffer_bytes(numels, grad_dtype, per_unit, cfg.grad_slabs)
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
        self.store = HostStore(spec, copy_dtype, pin, grad_bytes, cfg.host_memory_limit_gb,
                               placement=state_placement(cfg)) if local else None
        # Set by a data-parallel worker that sums gradients between GPUs (`cluster.grad_reduce: nccl`): a
        # collective every engine calls in the same unit order, returning the sum where this engine ships it.
        self.reduce_grad: Callable[[str, torch.Tensor], torch.Tensor | None] | None = None
        self.grad_buffers = grad_buffers or GradBuffers(numels, grad_dtype, pin, per_unit=per_unit, slabs=cfg.grad_slabs)
        self.optimizers = {u.name: UnitOptimizer(self.store, u, opt_cfg) for u in spec.trainable_units} if local else {}
        self.worker = grad_sink if not local else OptimizerWorker(
            self.store, self.optimizers, self.grad_buffers, list(numels),
            opt_cfg.max_grad_norm, cfg.optimizer_thread_count if pin else None,
        )
        self.streams = StreamSet(self.device)
        depth = cfg.prefetch_units or cfg.checkpoint_every
        source, versions = (self.store, self.worker) if local else (weight_source, weight_source)
        if spec.mirrors:  # a layer's mirrors take their values from their owners' updates
            versions = WithOwners(versions, {u: {m.owner for m in ms} for u, ms in spec.mirrors.items()})
        self.pref = build_preference(self, stage, pref or PreferenceConfig(), grpo, pin, reference) \
            if stage != "sft" else None
        self._streams_reference = self.pref is not None and self.pref.streams_reference
        if self._streams_reference:
            source = versions = WithReference(source, self.pref.reference, versions)
        self.resident = cfg.schedule == "resident"
        # Streaming holds at most one block of K units at once, or the head with a tied embedding;
        # the resident schedule holds every unit (and the reference's) for the whole step.
        hold = len(spec.units) * (2 if self._streams_reference else 1) if self.resident else max(cfg.checkpoint_every, 2)
        self.streamer = WeightStreamer(source, self.streams, self.dtype, depth, hold, versions)
        self.outbox = Outbox(self.streams)
        # Block graphs the backward uses instead of a recompute, as many as fit beside what the stage holds.
        self.kept = KeptBlocks(spec, self.streams, Stage.of(stage, pref, grpo, rollout))
        self.activations = build_activation_store(cfg.checkpoint_placement, self.streams, self.dtype,
                                                  cfg.host_memory_limit_gb)
        self.templates = build_templates(spec, self.device, self.context.stream)
        self.layer_templates = [self.templates[u.kind] for u in spec.layer_units]
        # Layers holding or owning weights tied between layers, by index.
        # Each unit's trainable tensors' sizes, in order: the slices of its gradient sum (`grad_sums.accumulate`).
        self._grad_sizes = {u.name: [p.numel for p in u.params if p.trainable] for u in spec.units}
        self._tie_layers = {int(name.split(".")[1]) for unit, mirrors in spec.mirrors.items()
                            for name in (unit, *(m.owner for m in mirrors))}
        self.vision = VisionStage(spec, self.templates, self.device, self._weights, self._add_grad) if spec.vision else None
        kinds = [self.templates[k].module for k in spec.layer_kinds]
        self.router_loss = RouterLoss(spec, kinds) if RouterLoss.wanted(spec) else None
        # Where the embedding matrix lies in the embed unit's flat buffer (pre-layer modules' weights follow it).
        embed_params = spec.unit("embed").params
        at = next(i for i, p in enumerate(embed_params) if p.local_name == "weight")
        self._embed_shape = embed_params[at].shape
        self._embed_at = slice(sum(p.numel for p in embed_params[:at]), sum(p.numel for p in embed_params[:at + 1]))
        # Reused every step: with clipping, step t+1 cannot finish its forward before the worker
        # has read step t's norm (layer updates wait for it), so it is never overwritten early.
        self._norm_sq_host = torch.zeros((), dtype=torch.float32, pin_memory=pin)

    # ------------------------------------------------------------------ public API

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]], loss_normaliser: int | None = None,
                   pref_counts: dict[str, int] | None = None) -> StepResult:
        """One optimizer step over `micro_batches` (the loss is normalised over all of them).

        `loss_normaliser` replaces this step's own loss-token count, and `pref_counts` a preference
        stage's own counts (pairs, KTO examples, chosen tokens: `preference_counts`): a data-parallel
        worker passes those of the whole global batch, so the workers' gradients sum to the gradient
        of the global mean loss, and their metric shares to its metrics.
        """
        mbs = self._prepare(micro_batches)
        n_loss = sum(mb.num_loss_tokens for mb in mbs)
        n_norm = n_loss if loss_normaliser is None else loss_normaliser
        if self.pref is not None and self.pref.start(mbs, pref_counts) == 0:
            raise ValueError("this step holds no preference pair, KTO example or GRPO completion")
        if n_norm == 0:
            raise ValueError("this step has no token that carries loss (every label is -100)")
        lr = lr_at(self.step_idx, self.opt_cfg, self.total_steps)
        self.kept.start(self.cfg, len(self._blocks()), len(mbs), *mbs[0].input_ids_BT.shape)
        self.streamer.start(self._upload_plan(mbs), version=self.step_idx)
        self._norm_sq = torch.zeros((), dtype=torch.float32, device=self.device)
        self._lr = lr
        self._grad_sums: dict[str, torch.Tensor] = {}
        self._ungraded: dict[str, set[int]] = {}  # per unit: its tensors no contribution has reached yet
        self._kept: dict[str, torch.Tensor] = {}
        self._sent: set[str] = set()
        # Router loss: each micro-batch weighted by its share of the step's loss tokens.
        self._aux_sum = torch.zeros((), dtype=torch.float32, device=self.device) if self.router_loss else None
        aux_weights = [mb.num_loss_tokens / n_norm for mb in mbs]

        if self.resident:
            loss_sum = self._resident_step(mbs, 1.0 / n_norm, aux_weights)
        else:
            with self.kept.misses_reported(self.cfg, len(mbs), *mbs[0].input_ids_BT.shape):  # `auto` out of memory
                imaged = [mb for mb in mbs if mb.image_calls]
                tapes = self.vision.forward(imaged) if imaged else []
                park, carry = self.activations, len(self._blocks())
                park.start(streamed_step_plan(carry, len(mbs), True, self._streams_reference),
                           self._hidden_numels(mbs))
                contexts, aux_grads = self._forward(mbs, aux_weights)
                loss_sum = self._head(self._carried(len(mbs)), mbs, 1.0 / n_norm, True,
                                      lambda j, g: park.put((carry, j), g))
                for b in reversed(range(carry)):
                    self._backward_block(b, contexts, aux_grads)
                self._backward_embed(self._carried(len(mbs)), mbs, contexts, final=True)
                if imaged:
                    self.vision.backward(imaged, tapes)
        self._kept.clear()
        self.kept.clear()
        for unit in self.vision.trainable if self.vision else ():
            if unit not in self._sent:  # no image this step: the unit is not updated (torch skips a None grad)
                self.worker.submit(unit, None, None, lr)

        with self.streams.on(self.streams.d2h):
            # The clip coefficient needs the global norm on the host; only the worker waits for it.
            self.streams.wait(self.streams.d2h, self.streams.record(self.streams.compute))
            self._norm_sq_host.copy_(self._norm_sq, non_blocking=True)
            norm_ready = self.streams.record(self.streams.d2h)
        self.outbox.add(self._norm_sq, norm_ready)  # a later step must not reuse it before the copy
        self.worker.end_step(self._norm_sq_host, norm_ready, lr)
        self.step_idx += 1
        loss = loss_sum / n_norm if self.pref is None else loss_sum  # a preference head normalises its own
        if self._aux_sum is not None:
            loss = loss + self.router_loss.coef * self._aux_sum
        return StepResult(loss, self._norm_sq.sqrt(), lr, sum(m.num_tokens for m in mbs), n_loss, self._aux_sum,
                          self.pref.metrics() if self.pref is not None else None)

    def evaluate(self, micro_batches: list[dict[str, torch.Tensor]]) -> EvalResult:
        """Summed next-token loss of `micro_batches` under the weights after `step_idx` steps: forward only.

        No gradient is computed or sent, no optimizer state changes and the step count stays.
        The templates run in eval mode (no dropout or router noise), as after `model.eval()`. The
        loss is the token cross-entropy alone: a MoE router's auxiliary loss is a training term.
        Every micro-batch passes each block while it is resident, and their hidden states wait
        where a training step's do: give as many as a training step holds.
        """
        mbs = self._prepare(micro_batches)
        imaged = [mb for mb in mbs if mb.image_calls]
        if self.pref is not None:
            self.pref.start(mbs)
        plan = forward_plan(self._blocks(), self.spec.tied and not self.resident, self._streams_reference)
        self.streamer.start((self.vision.plan()[0] if imaged else []) + plan, version=self.step_idx)
        self._kept = {}
        self.activations.start(streamed_step_plan(len(self._blocks()), len(mbs), False, self._streams_reference),
                               self._hidden_numels(mbs))
        modules = [t.module for t in self.templates.values()] + ([self.vision.embed.module] if self.vision else [])
        with eval_mode(modules), torch.no_grad():
            if imaged:
                self.vision.forward(imaged)
            self._forward(mbs)
            loss_sum = self._eval_head(self._carried(len(mbs)), mbs)
        self._kept.clear()
        pref = (self.pref.sums, self.pref.norm) if self.pref is not None else (None, None)
        return EvalResult(loss_sum, sum(mb.num_loss_tokens for mb in mbs), sum(mb.num_tokens for mb in mbs), *pref)

    def sequence_logps(self, micro_batches: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Each micro-batch's sequence log-prob sums [S] under the current weights (an `evaluate` pass, forward
        only): the starting weights' are what `pref.reference: precompute` caches."""
        with self.pref.collecting() as sums:
            self.evaluate(micro_batches)
            return list(sums)

    def kept_logps(self) -> list[torch.Tensor]:
        """GRPO above one iteration: each micro-batch's token log-probs [N] as the last step computed them, where
        its batch carried no old ones (a rollout's first step: the sampling policy's, kept for the steps after)."""
        return list(self.pref.step_logps)

    def set_attention(self, requested: str) -> str:
        """Switch the attention backend between steps, resolved as `EngineConfig.attn_implementation` is at
        start; returns the backend now in use. Benchmarks compare backends on one host store this way."""
        self.spec.config._attn_implementation = resolve_attention(self.spec, requested, self.device, self.dtype)
        self.context = LayerContextBuilder(self.spec, self.device)
        self.templates["head"].module.use_stream(self.context.stream)
        return self.spec.config._attn_implementation

    def set_keep_activations(self, keep: str | int) -> None:
        """Change `keep_activations` between steps, resolved at the next (benchmarks compare it on one host store)."""
        self.cfg = self.cfg.model_copy()
        self.cfg.keep_activations = keep  # validated on assignment

    def synchronize(self) -> None:
        """Wait until every update of the steps run so far is in the master weights."""
        for unit in self.worker.unit_order:
            self.worker.wait_updated(unit, self.step_idx)

    def load_random(self, seed: int = 0) -> None:
        """Initialise weights as the family's `from_config` does (on the device when it is a GPU); they are a
        preference stage's reference, as all weights loaded below (a checkpoint restores the policy only)."""
        init_random(self.spec, self.store.load_named, seed, self.device)
        self._snapshot_reference()

    def load_pretrained(self, folder: str | Path) -> None:
        """Read a safetensors checkpoint folder straight into the host store."""
        load_safetensors(self.spec, folder, self.store.load_named)
        self._snapshot_reference()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy weights given by Hugging Face name (e.g. another model's state_dict) into the store."""
        self.synchronize()
        for unit in self.spec.units:
            self.store.load_named(unit, state)
        self._snapshot_reference()

    def load_reference(self, state: dict[str, torch.Tensor]) -> None:
        """Make `state` (by Hugging Face name) the preference stage's reference instead of the starting weights."""
        self.pref.reference.load_named(self.store, state)

    def export(self, out_dir: str | Path, tokenizer=None, dtype: torch.dtype = torch.float32,
               extra_files: tuple[Path, ...] = ()) -> Path:
        """Write the trained weights as a Hugging Face folder that `from_pretrained` loads (`extra_files`
        copied in: an image-text model's processor files)."""
        return export_hf(self.spec, self.state_dict(), out_dir, tokenizer, dtype, extra_files=extra_files)

    def checkpoint_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """Everything a checkpoint needs: the flat fp32 master/moment buffers and the step.

        The tensors are the live buffers (no copies); call between steps. State on NVMe has no such buffers:
        `save_checkpoint` writes it from its files by range.
        """
        self.synchronize()
        return self.store.flat_state(), self._checkpoint_meta()

    def _checkpoint_meta(self) -> dict:
        meta = {"step": self.step_idx, "layout": self.store.layout.describe()}
        behind = counts_behind(self.optimizers, self.step_idx)
        return {**meta, "adam_counts": behind} if behind else meta

    def checkpoint_buffers(self) -> dict[str, torch.Tensor]:
        """The live buffers a checkpoint is read into in place, so a resume holds the state once."""
        return self.checkpoint_state()[0]

    def load_checkpoint_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        """Restore buffers and step from `checkpoint_state()` output, so training continues exactly."""
        self.synchronize()
        self.store.layout.check_matches(meta["layout"])
        self.store.load_flat_state(tensors)
        self._restore_step(meta)

    def _restore_step(self, meta: dict) -> None:
        restore_counts(self.optimizers, meta["step"], meta.get("adam_counts", {}))
        self.step_idx = meta["step"]
        self.worker.reset_versions(self.step_idx)

    def save_checkpoint(self, manager, step: int, extra_meta: dict) -> str:
        """Write the state through `manager` (a `CheckpointManager`); returns the checkpoint's URI. State on
        NVMe is read from its files a block at a time as the shards are written."""
        if not self.store.placement.on_disk:
            tensors, meta = self.checkpoint_state()
            return manager.save(step, tensors, {**meta, **extra_meta})
        self.synchronize()
        self.store.settle()
        return manager.save_ranges(step, self.store.flat_ranges(), {**self._checkpoint_meta(), **extra_meta})

    def restore_checkpoint(self, manager, uri: str | None = None) -> dict:
        """Read a checkpoint (`uri`, or the newest that verifies) into the live state; returns its meta. State on
        NVMe is written into its files one stored piece (at most `shard_bytes`) at a time."""
        if not self.store.placement.on_disk:
            tensors, meta = manager.load(uri, out=self.checkpoint_buffers())
            self.load_checkpoint_state(tensors, meta)
            return meta
        self.synchronize()
        self.store.settle()
        meta = manager.load_with(self._read_into_files, uri)
        self._restore_step(meta)
        return meta

    def _read_into_files(self, stored) -> dict:
        """Copy a stored checkpoint (`StoredCheckpoint`) into the state files, piece by piece."""
        self.store.layout.check_matches(stored.manifest.meta["layout"])
        for name in self.store.flat_parts():
            for piece in stored.manifest.tensors[name].pieces:
                buf = torch.empty(piece.numel, dtype=torch.float32)
                stored.read_range(name, piece.start, piece.start + piece.numel, buf)
                self.store.access_flat(name, piece.start, buf, write=True)
        return stored.manifest.meta

    def memory_metrics(self) -> dict[str, float]:
        """Peak device memory (CUDA only) and peak host bytes per parameter, for the run's metrics."""
        metrics = {}
        if self.device.type == "cuda":
            metrics["gpu_mem_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        metrics["host_bytes_per_param"] = self.store.rss_bytes_per_param()
        return metrics

    def state_dict(self) -> dict[str, torch.Tensor]:
        """fp32 master weights by Hugging Face name, after all pending updates."""
        self.synchronize()
        return self.store.state_dict()

    def streamed_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights the layer loop uploads, by Hugging Face name, after all pending updates (views of the host
        copy in the compute dtype, or of the fp32 master where none is kept): what a rollout copy loads."""
        self.synchronize()
        return {k: v for unit in self.spec.units
                for k, v in self.store.named_views(unit, self.store.streamed_of(unit.name)).items()}

    def close(self) -> None:
        if self.router_loss is not None:
            self.router_loss.close()
        self.worker.close()
        self.activations.close()
        self.grad_buffers.close()
        if self.store is not None:
            self.store.close()
        if self._streams_reference:
            self.pref.reference.close()

    # ------------------------------------------------------------------ schedule

    def _snapshot_reference(self) -> None:
        if self._streams_reference:
            self.pref.reference.snapshot(self.store.master)

    def _blocks(self) -> list[range]:
        K, L = self.cfg.checkpoint_every, self.spec.num_layers
        return [range(s, min(s + K, L)) for s in range(0, L, K)]

    def _prepare(self, micro_batches: list[dict[str, torch.Tensor]]) -> list[MicroBatch]:
        return [prepare_micro_batch(b, self.device, self.context.document_images) for b in micro_batches]

    def _upload_plan(self, mbs: list[MicroBatch]) -> list[str]:
        layers = [f"layers.{i}" for i in range(self.spec.num_layers)]
        vision_fwd, vision_bwd = self.vision.plan() if any(mb.image_calls for mb in mbs) else ([], [])
        if self.resident:
            ref = [REF + u for u in ["embed", *layers, "head"]] if self._streams_reference else []
            return [*dict.fromkeys(vision_fwd), *ref, "embed", *layers, "head"]
        plan = vision_fwd + forward_plan(self._blocks(), self.spec.tied, self._streams_reference)
        for b, block in reversed(list(enumerate(self._blocks()))):
            plan += [] if self.kept.whole(b) else [f"layers.{i}" for i in block]
        return plan + ["embed"] + vision_bwd

    def _weights(self, unit: str) -> torch.Tensor:
        """The unit's flat device weights: the next upload, or the step's kept copy when resident."""
        flat = self._kept.get(unit)
        if flat is None:
            flat = self.streamer.next(unit)
            if self.resident:
                self._kept[unit] = flat
        return flat

    def _hidden_numels(self, mbs: list[MicroBatch]) -> list[int]:
        return [mb.input_ids_BT.numel() * self.context.stream.numel for mb in mbs]

    def _carried(self, n_micro: int) -> Iterator[torch.Tensor]:
        """Each micro-batch's carry in turn (the last block's output, or the gradient flowing back)."""
        carry = len(self._blocks())
        return (self.activations.get((carry, j)) for j in range(n_micro))

    def _embed(self, weights: Weights, mb: MicroBatch) -> tuple[torch.Tensor, LayerContext]:
        """A micro-batch's embedded input and its layers' context (no graph)."""
        with torch.no_grad():
            h0 = self.templates["embed"](weights, mb.input_ids_BT)
            return self.context(h0, mb.input_ids_BT, mb.positions, mb.documents, mb.images, mb.image_features, weights)

    def _forward(self, mbs: list[MicroBatch], aux_weights: list[float] | None = None):
        """Park every micro-batch's embedding, then run each block over every micro-batch in turn without a
        graph, parking its output (the next block's checkpoint). Returns each micro-batch's layer context
        and, given `aux_weights`, the router loss's gradients into each MoE layer's router logits."""
        park, contexts = self.activations, []
        embed = self.templates["embed"].bind(self._weights("embed"))
        for j, mb in enumerate(mbs):
            h0, ctx = self._embed(embed, mb)
            contexts.append(ctx)
            park.put((0, j), h0)
        del embed  # the streamer may free the embedding's upload before the layers need the memory
        if self._streams_reference:
            self.pref.embed(mbs)
        router_logits: list[dict[int, torch.Tensor]] = [{} for _ in mbs]
        with torch.no_grad():
            for b, block in enumerate(self._blocks()):
                weights: dict[int, Weights] = {}
                for j, ctx in enumerate(contexts):
                    x = park.get((b, j))
                    if self.kept.keeps(b, j):  # with a graph, which the backward uses instead of a recompute
                        segments = self._run_layers(block, x, ctx, weights)
                        self.kept.put(b, j, segments, weights)
                        router_logits[j].update({s.layer: s.logits.detach() for s in segments if s.logits is not None})
                        park.put((b + 1, j), segments[-1].out.detach())
                        continue
                    for i in block:
                        if i not in weights:  # bound when first reached: compute waits for this upload only
                            weights[i] = self.layer_templates[i].bind(self._weights(f"layers.{i}"))
                        x, logits = self._layer(i, weights[i], x, ctx)
                        if logits is not None:
                            router_logits[j][i] = logits
                    park.put((b + 1, j), x)
                if self._streams_reference:
                    self.pref.block(block, contexts)
        if self._streams_reference:
            self.pref.head(mbs)
        aux_grads = [] if aux_weights is None else [
            self._router_loss_grads(lg, w) for lg, w in zip(router_logits, aux_weights, strict=True)]
        return contexts, aux_grads

    def _resident_step(self, mbs: list[MicroBatch], inv_n: float, aux_weights: list[float]) -> torch.Tensor:
        """Each micro-batch forward and backward in turn, activations kept, weights bound once."""
        weights: dict[int, Weights] = {}
        ref_weights: dict[int, Weights] = {}  # the reference's layers (a preference stage), bound once too
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        head_grad: list[torch.Tensor] = []  # the head hands each micro-batch's gradient over here
        last_imaged = max((j for j, mb in enumerate(mbs) if mb.image_calls), default=-1)
        if last_imaged >= 0:  # the vision units arrive first (`_upload_plan`), whichever micro-batch has images
            for unit in dict.fromkeys(self.vision.plan()[0]):
                self._weights(unit)
        for j, mb in enumerate(mbs):
            final = j == len(mbs) - 1
            tapes = self.vision.forward([mb]) if mb.image_calls else []
            if self._streams_reference:
                self.pref.resident_reference(mb, ref_weights)
            h, ctx = self._embed(self.templates["embed"].bind(self._weights("embed")), mb)
            segments = self._run_layers(range(self.spec.num_layers), h, ctx, weights)
            aux_grads = self._router_loss_grads({s.layer: s.logits for s in segments if s.logits is not None},
                                                aux_weights[j])
            loss_sum += self._head([segments[-1].out.detach()], [mb], inv_n, final, lambda _, g: head_grad.append(g))
            g = self._backward_layers(segments, weights, head_grad.pop(), final, aux_grads, ctx)
            self._backward_embed([g], [mb], [ctx], final)
            if tapes:
                self.vision.backward([mb], tapes, final=j == last_imaged)
        return loss_sum

    def _layer(self, i: int, weights: Weights, x: torch.Tensor, ctx: LayerContext):
        """Layer i's output hidden state, and its router logits when a router loss records them."""
        out = ctx.run(partial(self.layer_templates[i], weights), i, x)
        return out, self.router_loss.take() if self.router_loss else None

    def _router_loss_grads(self, logits: dict[int, torch.Tensor], weight: float) -> dict[int, torch.Tensor]:
        """One micro-batch's router loss, added to the step's; returns what it sends into each layer."""
        if not logits:
            return {}
        aux, grads = self.router_loss.gradients(logits, weight)
        self._aux_sum += aux * weight
        return grads

    def _bind_head(self, requires_grad: bool, prefix: str = "") -> Weights:
        """The head's weights (`prefix` REF: the reference's), with the embedding matrix as `lm_head.weight` when tied."""
        weights = self.templates["head"].bind(self._weights(prefix + "head"), requires_grad=requires_grad)
        if self.spec.tied:
            emb = self._weights(prefix + "embed")[self._embed_at].view(self._embed_shape).detach()
            weights["lm_head.weight"] = emb.requires_grad_() if requires_grad else emb
        return weights

    def _head(self, hiddens: Iterable[torch.Tensor], mbs: list[MicroBatch], inv_n: float, final: bool,
              on_grad: Callable[[int, torch.Tensor], None]) -> torch.Tensor:
        """Loss over each micro-batch's final hidden state, in chunks of selected tokens; hands each
        micro-batch's gradient to `on_grad` as soon as it is complete and returns the loss sum."""
        head = self.templates["head"]
        weights = self._bind_head(requires_grad=True)
        leaves = head.leaves(weights)
        sums = list(self._grad_sum("head", self.spec.unit("head").numel).split(head.sizes))[: len(leaves)]
        if self.spec.tied:
            leaves.append(weights["lm_head.weight"])
            # The tied embedding's head gradient waits on the device for the embedding's own part.
            sums.append(self._grad_sum("embed", self.spec.unit("embed").numel)[self._embed_at])
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        chunk = self.cfg.loss_chunk_tokens
        for j, (h_BTD, mb) in enumerate(zip(hiddens, mbs, strict=True)):
            h_ND = h_BTD.flatten(0, 1)  # [B*T, ...]: a widened stream keeps its per-token shape
            sel_ND = h_ND.index_select(0, mb.loss_index)
            if self.pref is not None:  # per-sequence log-probs into the preference loss instead
                g_sel, loss = self.pref.head_grads(head, weights, leaves, sums, sel_ND, mb)
                loss_sum += loss
            else:
                g_sel = torch.empty_like(sel_ND)
                for s in range(0, mb.num_loss_tokens, chunk):
                    x = sel_ND[s : s + chunk].detach().requires_grad_()
                    with torch.enable_grad():
                        loss = _chunk_loss(head, weights, x, mb.loss_target[s : s + chunk])
                        g = torch.autograd.grad(loss * inv_n, [x, *leaves])
                    g_sel[s : s + chunk] = g[0]
                    torch._foreach_add_(sums, [t.reshape(-1) for t in g[1:]])
                    loss_sum += loss.detach()
            on_grad(j, torch.zeros_like(h_ND).index_copy_(0, mb.loss_index, g_sel).view_as(h_BTD))
        if final:
            head_sum = self._grad_sums.pop("head")
            if not self.spec.unit("head").frozen:  # an empty head (tied, no final norm) has nothing to send
                self._send_grad("head", head_sum)
        return loss_sum

    def _eval_head(self, hiddens: Iterable[torch.Tensor], mbs: list[MicroBatch]) -> torch.Tensor:
        """The summed loss of the final hidden states, in the training head's chunks, with no graph."""
        head = self.templates["head"]
        weights = self._bind_head(requires_grad=False)
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        chunk = self.cfg.loss_chunk_tokens
        for h_BTD, mb in zip(hiddens, mbs, strict=True):
            if self.pref is not None:
                self.pref.eval_head(head, weights, h_BTD, mb)
                continue
            sel_ND = h_BTD.flatten(0, 1).index_select(0, mb.loss_index)
            for s in range(0, mb.num_loss_tokens, chunk):
                loss_sum += _chunk_loss(head, weights, sel_ND[s : s + chunk], mb.loss_target[s : s + chunk])
        return loss_sum

    def _backward_block(self, b: int, contexts: list[LayerContext], aux_grads: list[dict[int, torch.Tensor]]) -> None:
        """Recompute block b from each micro-batch's checkpoint (or take its kept graph) and run it
        backward, parking the gradient of its input for the block before."""
        park, carry = self.activations, len(self._blocks())
        block = self._blocks()[b]
        weights: dict[int, Weights] = {}
        last = len(contexts) - 1
        for j, ctx in enumerate(contexts):
            x = park.get((b, j))  # taken as planned even when kept (host placement fetches in plan order)
            segments, used = self.kept.take(b, j) if self.kept.keeps(b, j) else (
                self._run_layers(block, x, ctx, weights), weights)
            g = self._backward_layers(segments, used, park.get((carry, j)), j == last, aux_grads[j], ctx)
            park.put((carry, j), g)
        self.kept.release(b)

    def _run_layers(self, layers: range, x: torch.Tensor, ctx: LayerContext,
                    weights: dict[int, Weights]) -> list[Segment]:
        """Run `layers` with autograd, each from a detached input so each can go backward alone.

        Weights missing from `weights` are bound as the loop reaches them, so a layer's compute
        waits only for its own upload.
        """
        segments = []
        with torch.enable_grad():
            for i in layers:
                if i not in weights:
                    weights[i] = self.layer_templates[i].bind(self._weights(f"layers.{i}"), requires_grad=True)
                x = x.detach().requires_grad_()
                injected = ctx.track_injection(i)
                inputs = ctx.track_inputs(i)
                out, logits = self._layer(i, weights[i], x, ctx)
                segments.append(Segment(i, x, out, logits, injected, inputs))
                x = out
        return segments

    def _backward_layers(self, segments: list[Segment], weights: dict[int, Weights], g: torch.Tensor, final: bool,
                         aux_grads: dict[int, torch.Tensor], ctx: LayerContext) -> torch.Tensor:
        """Backward through `_run_layers`' segments, last first, freeing each graph as it goes;
        a MoE layer's router logits take the router loss's gradient with them, and what the body added
        after a layer keeps its gradient in `ctx` (for the embedding's backward)."""
        while segments:
            i, x, out, logits, injected, inputs = segments.pop()
            template = self.layer_templates[i]
            read, stored, stored_grads = backward_terms(ctx.channels, i)  # what it shares with later layers
            outputs = [out, *([logits] if i in aux_grads else []), *stored]
            out_grads = [g, *([aux_grads[i]] if i in aux_grads else []), *stored_grads]
            leaves = template.leaves(weights[i])
            mirrors = template.mirror_leaves(weights[i])
            carried = [leaf for _, leaf in inputs]
            # A carried argument the layer does not read (Zamba's Mamba layers get the embedding too) and a tied weight
            # another layer uses (Zamba2's adapter of another layer) get no gradient here: zeros.
            unused = bool(carried) or i in self._tie_layers
            gs = torch.autograd.grad(outputs, [x, *leaves, *mirrors, *([] if injected is None else [injected]),
                                               *read, *carried], out_grads, allow_unused=unused, materialize_grads=unused)
            take_grads(ctx.channels, i, gs[len(gs) - len(carried) - len(read):len(gs) - len(carried)])
            g = gs[0]
            self._add_mirror_grads(f"layers.{i}", gs[1 + len(leaves):1 + len(leaves) + len(mirrors)])
            self._add_grad(f"layers.{i}", gs[1:1 + len(leaves)], final, template.frozen_numel)
            if injected is not None:
                ctx.injection.grads[i] = gs[1 + len(leaves) + len(mirrors)]
            ctx.input_grads.update({key: grad for (key, _), grad in zip(inputs, gs[len(gs) - len(carried):], strict=True)})
        return g

    def _backward_embed(self, grads: Iterable[torch.Tensor], mbs: list[MicroBatch], contexts: list[LayerContext],
                        final: bool) -> None:
        """The embedding's gradient, and the image features' (into the embedding's output and, for Qwen3-VL's
        deepstack, into what the layers' backward found for the features added after them)."""
        embed = self.templates["embed"]
        weights = embed.bind(self._weights("embed"), requires_grad=True)
        leaves = embed.leaves(weights)
        for j, (g, mb, done) in enumerate(zip(grads, mbs, contexts, strict=True)):
            calls = [feature_leaves(f) for f in mb.image_features or ()]  # each get_image_features call's
            features, flat = [f for f, _ in calls], [t for _, ts in calls for t in ts]
            with torch.enable_grad():
                h0, ctx = self.context(embed(weights, mb.input_ids_BT), mb.input_ids_BT, mb.positions,
                                       mb.documents, mb.images, features, weights)
                added, added_grads = ctx.injected_grads(done)
                gs = torch.autograd.grad([h0, *added], [*leaves, *flat], [g, *added_grads], allow_unused=bool(flat))
            grads = iter(gs[len(leaves):])  # the image features' gradient, call by call, for the vision stage
            mb.feature_grads = [[next(grads) for _ in ts] for _, ts in calls]
            self._add_grad("embed", gs[:len(leaves)], final and j == len(mbs) - 1, embed.frozen_numel)

    # ------------------------------------------------------------------ gradients out

    def _grad_sum(self, unit: str, numel: int) -> torch.Tensor:
        """This step's fp32 gradient sum of `unit` on the device, zeroed on first use."""
        if unit not in self._grad_sums:
            self._grad_sums[unit] = torch.zeros(numel, dtype=torch.float32, device=self.device)
        return self._grad_sums[unit]

    def _add_mirror_grads(self, unit: str, grads) -> None:
        """Add the gradients of `unit`'s mirrors to their owners' sums, which wait on the device: an owner sits in an
        earlier layer, whose backward comes later, so its gradient ships with every layer's part in it."""
        for mirror, g in zip(self.spec.mirrors.get(unit, ()), grads, strict=True):
            owner_sum = self._grad_sum(mirror.owner, self.spec.unit(mirror.owner).numel)
            owner_sum[mirror.owner_offset : mirror.owner_offset + mirror.numel] += g.reshape(-1)

    def _add_grad(self, unit: str, grads, final: bool, frozen_numel: int = 0) -> None:
        """Add a micro-batch's gradients (None: that tensor got none) to the unit's sum; the final contribution
        ships it, with the tensors no contribution reached (a sum begun by `_grad_sum` counts as reaching all)."""
        prior = self._grad_sums.pop(unit, None)
        sizes = self._grad_sizes[unit]
        acc, missing = accumulate(prior, grads, sizes, frozen_numel, self.device)
        ungraded = missing if prior is None else self._ungraded.pop(unit, set()) & missing
        if final:
            self._send_grad(unit, acc, spans_of(sizes, ungraded))
        else:
            self._grad_sums[unit], self._ungraded[unit] = acc, ungraded

    def _send_grad(self, unit: str, acc: torch.Tensor, skip: Spans = ()) -> None:
        """Ship a finished fp32 gradient to the host and queue its optimizer update (`skip`: spans without one)."""
        self._sent.add(unit)
        if self.reduce_grad is not None and (acc := self.reduce_grad(unit, acc)) is None:
            return  # another engine ships the sum
        self._norm_sq += torch.linalg.vector_norm(acc).square()
        grad = acc.to(self.grad_dtype)
        done_on_compute = self.streams.record(self.streams.compute)
        for lo, hi in self.grad_buffers.pieces(unit):  # each piece is handed on as it lands
            host = self.grad_buffers.acquire(unit, lo, hi)
            with self.streams.on(self.streams.d2h):
                self.streams.wait(self.streams.d2h, done_on_compute)  # gradient fully computed
                host.copy_(grad[lo:hi], non_blocking=True)
                landed = self.streams.record(self.streams.d2h)
            self.worker.submit(unit, host, landed, self._lr, skip)
        self.outbox.add(grad, landed)  # keeps it alive until the last copy has read it


def _cap_device_memory(device: torch.device, limit_gb: float) -> None:
    """Let the caching allocator hand out at most `limit_gb` GiB (a smaller card, emulated): past it,
    an allocation fails as it would on that card."""
    index = device.index if device.index is not None else torch.cuda.current_device()  # both need an index
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, limit_gb * 2**30 / total), index)


def _chunk_loss(head: UnitTemplate, weights: Weights, x_ND: torch.Tensor, target_N: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of one chunk of selected tokens, from fp32 logits that live only for this chunk."""
    logits_NV = head(weights, x_ND).float()
    return torch.nn.functional.cross_entropy(logits_NV, target_N, reduction="sum")


__all__ = ["EvalResult", "StreamingEngine", "StepResult", "UnitTemplate", "Weights"]
