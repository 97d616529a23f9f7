"""The streaming engine: one training step of a model whose state lives in host memory.

Schedule of a step (L layers, blocks of K layers, M micro-batches):
  forward   embed every micro-batch, then block by block: every micro-batch through the block's
            K layers while their weights are resident (one upload serves the whole batch); the
            hidden state entering each block is parked (the checkpoints), and so is the last
            block's output.
  head      final norm + LM head + loss, forward and backward together, in token chunks so
            full-vocabulary fp32 logits never exist (head_loss.py); each micro-batch's gradient is parked.
  backward  block by block from the last: upload the block's K layers once, then per
            micro-batch recompute the block from its checkpoint and run it backward layer by
            layer (layer_backward.py), parking the gradient for the block before. A layer's gradient
            leaves the device as soon as the last micro-batch has contributed to it (step_grads.py).
            Finally the embedding.
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

Loading, exporting and checkpointing the weights are the engine's too (weights_io.py), and its parts are
built, and refused where they do not go together, in engine_parts.py.

Tensor shape key: B batch, T tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from functools import partial

import torch

from mt_ray.engine.activations import build_activation_store, streamed_step_plan
from mt_ray.engine.batch import MicroBatch, prepare_micro_batch
from mt_ray.engine.config import EngineConfig, OptimizerConfig
from mt_ray.engine.device_plan import eligible_units, plan_device_units, state_bytes
from mt_ray.engine.engine_parts import (
    StepWeights,
    apply_model_options,
    build_grad_path,
    build_streamer,
    check_placement,
    check_seams,
    maybe_cap_device_memory,
)
from mt_ray.engine.grpo import GrpoConfig, RolloutConfig
from mt_ray.engine.head_loss import LossHead
from mt_ray.engine.kept_blocks import KeptBlocks
from mt_ray.engine.layer_backward import LayerBackward, Segment, run_layers
from mt_ray.engine.optimizer import lr_at
from mt_ray.engine.preference import PreferenceConfig
from mt_ray.engine.reference import REF, build_preference, eval_mode, forward_plan
from mt_ray.engine.results import EvalResult, StepResult
from mt_ray.engine.seams import GradSink, ReferenceSource, WeightSource
from mt_ray.engine.sizing import Stage
from mt_ray.engine.step_grads import ReduceGrad, StepGrads
from mt_ray.engine.templates import UnitTemplate, Weights, build_templates
from mt_ray.engine.transfer import GradBuffers, StreamSet
from mt_ray.engine.vision_stage import VisionStage, feature_leaves
from mt_ray.engine.weights_io import WeightsIO
from mt_ray.models.attention import resolve_attention
from mt_ray.models.context import LayerContext, LayerContextBuilder
from mt_ray.models.discovery import ModelSpec
from mt_ray.models.router_loss import RouterLoss

logger = logging.getLogger(__name__)


class StreamingEngine(WeightsIO):
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
        check_seams(spec, stage, grad_sink, weight_source)
        self.spec = spec
        self.cfg = cfg
        self.opt_cfg = opt_cfg
        self.total_steps = total_steps
        self.device = cfg.resolve_device()
        self.dtype = cfg.dtype
        self.step_idx = 0
        maybe_cap_device_memory(self.device, cfg.gpu_memory_limit_gb)
        apply_model_options(spec, cfg, self.device)
        # Before any state is sized or allocated: a family the layer context refuses is refused by name first.
        self.context = LayerContextBuilder(spec, self.device)
        pin = self.device.type == "cuda"
        local = grad_sink is None
        check_placement(spec, cfg, stage, local)
        self.grad_dtype = cfg.grad_torch_dtype
        self.store, self.grad_buffers, self.optimizers, self.worker = build_grad_path(
            spec, cfg, opt_cfg, grad_sink, grad_buffers, pin)
        self.streams = StreamSet(self.device)
        self.pref = build_preference(self, stage, pref or PreferenceConfig(), grpo, pin, reference) \
            if stage != "sft" else None
        self._streams_reference = self.pref is not None and self.pref.streams_reference
        self.resident = cfg.schedule == "resident"
        source, versions = (self.store, self.worker) if local else (weight_source, weight_source)
        self.streamer = build_streamer(spec, cfg, self.streams, source, versions,
                                       self.pref.reference if self._streams_reference else None)
        self._weights = StepWeights(self.streamer, self.resident)
        self.grads = StepGrads(spec, self.device, self.grad_dtype, self.streams, self.grad_buffers, self.worker, pin)
        # Block graphs the backward uses instead of a recompute, as many as fit beside what the stage holds.
        self.kept = KeptBlocks(spec, self.streams, Stage.of(stage, pref, grpo, rollout))
        self.activations = build_activation_store(cfg.checkpoint_placement, self.streams, self.dtype,
                                                  cfg.host_memory_limit_gb)
        self.templates = build_templates(spec, self.device, self.context.stream)
        self.layer_templates = [self.templates[u.kind] for u in spec.layer_units]
        self.head = LossHead(spec, self.templates["head"], self._weights, self.grads, cfg.loss_chunk_tokens,
                             self.device, self.pref)
        self.layer_backward = LayerBackward(spec, self.layer_templates, self.grads)
        self.vision = VisionStage(spec, self.templates, self.device, self._weights, self.grads.add) if spec.vision else None
        kinds = [self.templates[k].module for k in spec.layer_kinds]
        self.router_loss = RouterLoss(spec, kinds) if RouterLoss.wanted(spec) else None
        self._device_state_planned = False  # `_keep_state_on_device`, at the first step

    @property
    def reduce_grad(self) -> ReduceGrad | None:
        """Set by a data-parallel worker that sums gradients between GPUs (`cluster.grad_reduce: nccl`): a
        collective every engine calls in the same unit order, returning the sum where this engine ships it."""
        return self.grads.reduce

    @reduce_grad.setter
    def reduce_grad(self, reduce: ReduceGrad | None) -> None:
        self.grads.reduce = reduce

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
        if not self._device_state_planned:
            self._keep_state_on_device(len(mbs), *mbs[0].input_ids_BT.shape)
        self.streamer.start(self._upload_plan(mbs), version=self.step_idx)
        self.grads.start(lr)
        self._weights.clear()
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
                loss_sum = self.head.train(self._carried(len(mbs)), mbs, 1.0 / n_norm, True,
                                           lambda j, g: park.put((carry, j), g))
                for b in reversed(range(carry)):
                    self._backward_block(b, contexts, aux_grads)
                self._backward_embed(self._carried(len(mbs)), mbs, contexts, final=True)
                if imaged:
                    self.vision.backward(imaged, tapes)
        self._weights.clear()
        self.kept.clear()
        self.grads.finish(self.vision.trainable if self.vision else ())
        self.step_idx += 1
        loss = loss_sum / n_norm if self.pref is None else loss_sum  # a preference head normalises its own
        if self._aux_sum is not None:
            loss = loss + self.router_loss.coef * self._aux_sum
        return StepResult(loss, self.grads.norm_sq.sqrt(), lr, sum(m.num_tokens for m in mbs), n_loss, self._aux_sum,
                          self.pref.metrics() if self.pref is not None else None)

    def _keep_state_on_device(self, n_micro: int, micro_batch: int, seq: int) -> None:
        """Before the first step's forward: keep the optimizer state of the first units on the GPU where it fits
        beside this step (`engine.device_optimizer_units`, `device_plan.py`), refused where a number cannot."""
        self._device_state_planned = True
        local = self.store is not None  # a trainer's grad sink keeps the state elsewhere (`build_grad_path`)
        eligible = eligible_units(self.spec, self.worker.unit_order, set(self.optimizers)) if local else []
        units = plan_device_units(self.spec, self.cfg, self.opt_cfg, local, eligible, self.kept.budget_gb(self.cfg),
                                  self.kept.stage, micro_batch, seq, n_micro, self.kept.last_count)
        if not units:
            return
        self.synchronize()  # the host buffers hold every update so far before the state moves
        self.store.keep_on_device(units, self.device)
        self.grads.on_device = frozenset(units)
        held = state_bytes(self.spec, self.cfg, units)
        self.kept.hold_state(held)
        params = sum(self.spec.unit(u).numel for u in units)
        logger.info("optimizer state of %d of %d units (%.2f B of %.2f B parameters, %.1f GiB) kept on %s: updated "
                    "there, the rest on the host", len(units), len(self.worker.unit_order), params / 1e9,
                    self.spec.num_params / 1e9, held / 2**30, self.device)

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
        self._weights.clear()
        self.activations.start(streamed_step_plan(len(self._blocks()), len(mbs), False, self._streams_reference),
                               self._hidden_numels(mbs))
        modules = [t.module for t in self.templates.values()] + ([self.vision.embed.module] if self.vision else [])
        with eval_mode(modules), torch.no_grad():
            if imaged:
                self.vision.forward(imaged)
            self._forward(mbs)
            loss_sum = self.head.eval(self._carried(len(mbs)), mbs)
        self._weights.clear()
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

    def set_device_optimizer_units(self, units: str | int) -> None:
        """Change `device_optimizer_units` between steps, planned again at the next (benchmarks compare it on one
        host store): the units kept on the device come home first."""
        self.synchronize()
        if self.store is not None:
            self.store.drop_device_state()
        self.grads.on_device = frozenset()
        self.kept.hold_state(0)
        self.cfg = self.cfg.model_copy()
        self.cfg.device_optimizer_units = units  # validated on assignment
        self._device_state_planned = False

    def memory_metrics(self) -> dict[str, float]:
        """Peak device memory (CUDA only) and peak host bytes per parameter, for the run's metrics."""
        metrics = {}
        if self.device.type == "cuda":
            metrics["gpu_mem_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        metrics["host_bytes_per_param"] = self.store.rss_bytes_per_param()
        return metrics

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

    def _blocks(self) -> list[range]:
        K, L = self.cfg.checkpoint_every, self.spec.num_layers
        return [range(s, min(s + K, L)) for s in range(0, L, K)]

    def _prepare(self, micro_batches: list[dict[str, torch.Tensor]]) -> list[MicroBatch]:
        prompt_nll = self.pref is not None and self.pref.objective.prompt_nll  # ORPO's NLL over the chosen prompts
        return [prepare_micro_batch(b, self.device, self.context.document_images, prompt_nll) for b in micro_batches]

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
                            weights[i] = self._bind_layer(i)
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
            loss_sum += self.head.train([segments[-1].out.detach()], [mb], inv_n, final,
                                        lambda _, g: head_grad.append(g))
            g = self.layer_backward(segments, weights, head_grad.pop(), final, aux_grads, ctx)
            self._backward_embed([g], [mb], [ctx], final)
            if tapes:
                self.vision.backward([mb], tapes, final=j == last_imaged)
        return loss_sum

    def _layer(self, i: int, weights: Weights, x: torch.Tensor, ctx: LayerContext):
        """Layer i's output hidden state, and its router logits when a router loss records them."""
        out = ctx.run(partial(self.layer_templates[i], weights), i, x)
        return out, self.router_loss.take() if self.router_loss else None

    def _bind_layer(self, i: int, requires_grad: bool = False) -> Weights:
        """Layer i's weights from its next upload (or the step's kept copy when resident)."""
        return self.layer_templates[i].bind(self._weights(f"layers.{i}"), requires_grad=requires_grad)

    def _run_layers(self, layers: range, x: torch.Tensor, ctx: LayerContext,
                    weights: dict[int, Weights]) -> list[Segment]:
        """`layers` with autograd (`run_layers`), each bound as the loop reaches it and run through `_layer`."""
        return run_layers(layers, x, ctx, weights, partial(self._bind_layer, requires_grad=True), self._layer)

    def _router_loss_grads(self, logits: dict[int, torch.Tensor], weight: float) -> dict[int, torch.Tensor]:
        """One micro-batch's router loss, added to the step's; returns what it sends into each layer."""
        if not logits:
            return {}
        aux, grads = self.router_loss.gradients(logits, weight)
        self._aux_sum += aux * weight
        return grads

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
            g = self.layer_backward(segments, used, park.get((carry, j)), j == last, aux_grads[j], ctx)
            park.put((carry, j), g)
        self.kept.release(b)

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
            self.grads.add("embed", gs[:len(leaves)], final and j == len(mbs) - 1, embed.frozen_numel)


__all__ = ["EvalResult", "StreamingEngine", "StepResult", "UnitTemplate", "Weights"]
