"""The engine's preference stage: the reference model streamed through the policy's own layer loop, and the
head that turns per-sequence log-probs into the preference loss and its gradient.

The reference is the frozen starting weights, one flat host buffer in the store's layout, in the
compute dtype (bf16 on a GPU: 2 B/param; fp32 where the run computes in fp32), snapshotted when the
weights are loaded (a resume restores the policy from its checkpoint and keeps the snapshot of the
starting weights). Its units are named `ref:<unit>` and ride the weight streamer's plan beside the
policy's: there is one layer loop, and in it each block runs the reference's copy of its layers
forward, without a graph, right after the policy's (`forward_plan`). The reference's hidden state
waits in its own activation slot (`streamed_step_plan(reference=True)`), and its head computes each
sequence's log-prob sum before the policy's head needs it. The resident schedule keeps the
reference's units on the device too and runs each micro-batch through it before the policy.

Reference-free losses (ORPO, SimPO) hold no reference; `pref.reference: precompute` reads the
reference's sums from the batch (`ref_logps`, computed once per dataset) instead: `collecting()` turns
`evaluate` into that forward-only pass, handing each micro-batch's sums out instead of the loss's
(mt_ray/training/reference_cache.py runs it over the dataset with the starting weights and caches them).

Shape key: B batch, T tokens, D hidden, N selected (loss) tokens, S sequences.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from functools import partial

import torch
import torch.nn.functional as F

from mt_ray.engine.batch import MicroBatch
from mt_ray.engine.grpo import GroupObjective, GrpoConfig
from mt_ray.engine.host_store import StoreLayout
from mt_ray.engine.pinning import host_empty, unregister_pinned
from mt_ray.engine.preference import Objective, PreferenceConfig, add_counts, add_sums
from mt_ray.engine.seams import ReferenceSource, UnitVersions, WeightSource
from mt_ray.engine.templates import UnitTemplate, Weights

REF = "ref:"


class ReferenceWeights:
    """The frozen starting weights of every unit, in the host store's layout (`WeightSource` for `ref:` units)."""

    def __init__(self, layout: StoreLayout, dtype: torch.dtype, pin: bool):
        self.layout = layout
        self.pin = pin
        self.buf = host_empty(layout.total, dtype, pin)  # page-locked once: uploaded every step

    def snapshot(self, master: torch.Tensor) -> None:
        """Take the weights just loaded into the store as the reference."""
        self.buf.copy_(master)

    @torch.no_grad()
    def load_named(self, store, state: dict[str, torch.Tensor]) -> None:
        """Another reference than the starting weights, by Hugging Face name (`store` knows each unit's slice)."""
        for unit in store.units:
            for name, view in store.named_views(unit, self.streamed_of(unit.name)).items():
                view.copy_(state[name])

    def streamed_of(self, unit: str) -> torch.Tensor:
        off = self.layout.offsets[unit]
        return self.buf[off : off + self.layout.numels[unit]]

    def close(self) -> None:
        if self.pin:
            unregister_pinned(self.buf)
            self.pin = False


class WithReference:
    """The policy's weight source with the reference's `ref:` units beside it; they never wait for the optimizer."""

    def __init__(self, policy: WeightSource, reference: ReferenceSource, policy_versions: UnitVersions):
        self.policy = policy
        self.reference = reference
        self.policy_versions = policy_versions

    def wait_updated(self, unit: str, version: int) -> None:
        if not unit.startswith(REF):
            self.policy_versions.wait_updated(unit, version)

    def is_updated(self, unit: str, version: int) -> bool:
        return unit.startswith(REF) or self.policy_versions.is_updated(unit, version)

    def streamed_of(self, unit: str) -> torch.Tensor:
        if unit.startswith(REF):
            return self.reference.streamed_of(unit.removeprefix(REF))
        return self.policy.streamed_of(unit)

    def release(self, unit: str, copied) -> None:
        if not unit.startswith(REF):
            self.policy.release(unit, copied)


def build_preference(engine, stage: str, cfg: PreferenceConfig, grpo: GrpoConfig | None, pin: bool,
                     given: ReferenceSource | None = None) -> PreferenceSteps:
    """The preference (or GRPO) stage of `engine`, with a reference to stream unless its loss needs none or
    the reference's log-probs are precomputed: the `given` one (kept by a data-parallel trainer), else a
    snapshot buffer of its own."""
    objective = GroupObjective(grpo or GrpoConfig()) if stage == "grpo" else Objective(stage, cfg)
    streamed = objective.needs_reference and (stage == "grpo" or cfg.reference == "stream")
    if given is not None and not streamed:
        raise ValueError(f"stage {stage} with pref.loss {cfg.loss} and pref.reference {cfg.reference} streams no "
                         "reference, but one was given")
    if streamed and given is None and engine.store is None:
        raise ValueError(f"stage {stage} streams a reference: an engine without a host store (a data-parallel "
                         "worker's) needs its trainer's, as `reference`")
    reference = (given or ReferenceWeights(engine.store.layout, engine.dtype, pin)) if streamed else None
    # A weak reference back: the engine owns its stage, and a closed engine is freed without the garbage collector.
    return PreferenceSteps(weakref.proxy(engine), objective, reference)


def forward_plan(blocks: list[range], tied: bool, reference: bool) -> list[str]:
    """The units a forward pass reads, in order: block by block, each block's reference layers after the
    policy's; the reference's head before the policy's (each with the embedding again where it is tied)."""
    ref = [REF] if reference else []
    plan = ["embed", *(p + "embed" for p in ref)]
    for block in blocks:
        plan += [f"{p}layers.{i}" for p in ["", *ref] for i in block]
    for p in [*ref, ""]:
        plan += [f"{p}head"] + ([f"{p}embed"] if tied else [])
    return plan


@contextlib.contextmanager
def eval_mode(modules: Iterable[torch.nn.Module]) -> Iterator[None]:
    """Modules in eval mode for the block (dropout and router noise off), then back as they were."""
    modules = list(modules)
    was_training = [m.training for m in modules]
    for m in modules:
        m.train(False)
    try:
        yield
    finally:
        for m, mode in zip(modules, was_training, strict=True):
            m.train(mode)


class PreferenceSteps:
    """What a preference stage adds to a `StreamingEngine` step: the reference's passes and the preference head.

    It drives the engine's own loop pieces (`_weights`, `_embed`, `_layer`, `head.bind`, the activation
    store); the engine calls it at the points where a step differs from SFT.
    """

    def __init__(self, engine, objective: Objective, reference: ReferenceSource | None):
        self.e = engine
        self.objective = objective
        self.reference = reference
        self.slot = 0  # the reference's activation slot (set per step)
        self.norm: dict[str, int] = {}
        self.sums: dict[str, torch.Tensor] = {}
        self.collected: list[torch.Tensor] | None = None  # set by `collecting`: each micro-batch's sums [S]
        # GRPO's first step on a rollout trained on again: each micro-batch's token log-probs [N] (the old policy's)
        self.step_logps: list[torch.Tensor] = []

    @contextlib.contextmanager
    def collecting(self) -> Iterator[list[torch.Tensor]]:
        """Within the block, `evaluate` computes each micro-batch's sequence log-prob sums under the current
        weights and appends them (device tensors, [S] each) to the list it yields; no loss, no metrics."""
        self.collected = []
        try:
            yield self.collected
        finally:
            self.collected = None

    @property
    def streams_reference(self) -> bool:
        return self.reference is not None

    def start(self, mbs: list[MicroBatch], counts: dict[str, int] | None = None) -> int:
        """Begin a step or an evaluation over `mbs`; returns what its loss is a mean over (pairs, KTO examples or
        GRPO completions). `counts`: what the loss and metrics are normalised by, where not `mbs`' own (a
        data-parallel worker's share of a global batch: the whole batch's `preference_counts`)."""
        for mb in mbs:
            if mb.seqs is None:
                raise ValueError("a preference or GRPO stage needs batches with seq_role (the preference data "
                                 "pipeline's rows, or GRPO's completions); this micro-batch has none")
            if isinstance(self.objective, GroupObjective) and mb.advantages is None:
                raise ValueError("a GRPO step needs each batch's advantages (one per sequence slot)")
            if (self.objective.needs_reference and not self.streams_reference and mb.ref_logps is None
                    and self.collected is None):
                raise ValueError("pref.reference: precompute needs each batch's ref_logps")
        if counts is None:
            counts = {}
            for mb in mbs:
                counts = add_counts(counts, mb.seqs.counts)
            counts["micro_batches"] = len(mbs)
        self.norm = dict(counts)
        self.sums = {}
        self.step_logps = []
        self.slot = len(self.e._blocks()) + 1
        return self.objective.examples(self.norm)

    def metrics(self) -> dict[str, torch.Tensor]:
        """The step's (or evaluation's) metrics, as device tensors."""
        return self.objective.metrics(self.sums, self.norm)

    # ------------------------------------------------------------------ the reference's passes (streamed)

    def embed(self, mbs: list[MicroBatch]) -> None:
        """Park each micro-batch's reference embedding in the reference's slot."""
        weights = self.e.templates["embed"].bind(self.e._weights(REF + "embed"))
        for j, mb in enumerate(mbs):
            self.e.activations.put((self.slot, j), self.e._embed(weights, mb)[0])

    def block(self, block: range, contexts) -> None:
        """Run the reference's copy of `block` over every micro-batch, forward only."""
        weights: dict[int, Weights] = {}
        with torch.no_grad(), eval_mode(self.e.layer_templates[i].module for i in block):
            for j, ctx in enumerate(contexts):
                x = self.e.activations.get((self.slot, j))
                for i in block:
                    if i not in weights:  # bound when first reached: compute waits for this upload only
                        weights[i] = self.e.layer_templates[i].bind(self.e._weights(f"{REF}layers.{i}"))
                    x = self.e._layer(i, weights[i], x, ctx)[0]  # a router's logits are dropped (no aux loss)
                self.e.activations.put((self.slot, j), x)

    def head(self, mbs: list[MicroBatch]) -> None:
        """Each micro-batch's reference log-prob sums, from the reference's last hidden state."""
        head, weights = self.e.templates["head"], self.e.head.bind(False, REF)
        for j, mb in enumerate(mbs):
            mb.ref_logps = self.objective.reference_of(self._logps(head, weights, self.e.activations.get((self.slot, j)),
                                                                   mb), mb)

    def resident_reference(self, mb: MicroBatch, weights: dict[int, Weights]) -> None:
        """The resident schedule: one micro-batch through the whole reference (its units kept on the device)."""
        with torch.no_grad(), eval_mode(t.module for t in self.e.layer_templates):
            x, ctx = self.e._embed(self.e.templates["embed"].bind(self.e._weights(REF + "embed")), mb)
            for i in range(self.e.spec.num_layers):
                if i not in weights:
                    weights[i] = self.e.layer_templates[i].bind(self.e._weights(f"{REF}layers.{i}"))
                x = self.e._layer(i, weights[i], x, ctx)[0]
            mb.ref_logps = self.objective.reference_of(
                self._logps(self.e.templates["head"], self.e.head.bind(False, REF), x, mb), mb)

    # ------------------------------------------------------------------ the policy's head

    def head_grads(self, head: UnitTemplate, weights: Weights, leaves: list[torch.Tensor],
                   grad_sums: list[torch.Tensor], sel_ND: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """One micro-batch's share of the preference loss; its head-weight gradients go into `grad_sums`.
        Returns the gradient of its selected hidden states and the loss share.

        The loss says what each token's log-prob gradient is (dL/dp), and the chunked forward and backward
        weights each token's log-prob by it. A preference loss's goes through its sequence's sum, so a forward
        without a graph gives every log-prob first; GRPO's is token-wise, so each chunk's coefficients come
        from that chunk's own forward, and the loss and metrics from the log-probs it collected.
        """
        objective = self.objective
        if objective.token_wise:
            g_sel, logp_N = self._weighted_grads(head, weights, leaves, grad_sums, sel_ND, mb, partial(
                objective.token_coefficients, mb=mb, norm=self.norm))
            loss, sums = objective.token_loss(logp_N, mb, self.norm)  # the value and metrics, no graph
            if objective.keeps_logps and mb.old_logps is None:
                self.step_logps.append(logp_N)
        else:
            logp_N = token_logps(head, weights, sel_ND, mb, self.e.cfg.loss_chunk_tokens,
                                 objective.temperature).requires_grad_()
            with torch.enable_grad():
                loss, sums = objective.token_loss(logp_N, mb, self.norm)
                (coef_N,) = torch.autograd.grad(loss, [logp_N])
            g_sel, _ = self._weighted_grads(head, weights, leaves, grad_sums, sel_ND, mb, lambda _, part: coef_N[part])
        add_sums(self.sums, sums)
        return g_sel, loss.detach()

    def _weighted_grads(self, head: UnitTemplate, weights: Weights, leaves: list[torch.Tensor],
                        grad_sums: list[torch.Tensor], sel_ND: torch.Tensor, mb: MicroBatch,
                        coef_of: Callable[[torch.Tensor, slice], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunked forward and backward of each token's log-prob times its coefficient (`coef_of(log-probs,
        chunk)`), head gradients into `grad_sums`. Returns the selected hidden states' gradient and the log-probs."""
        chunk = self.e.cfg.loss_chunk_tokens
        g_sel = torch.empty_like(sel_ND)
        logp_N = torch.empty(mb.num_selected, dtype=torch.float32, device=sel_ND.device)
        for s in range(0, mb.num_selected, chunk):
            part = slice(s, s + chunk)
            x = sel_ND[part].detach().requires_grad_()
            with torch.enable_grad():
                logits_NV = _scaled(head(weights, x).float(), self.objective.temperature)
                logp_n = -F.cross_entropy(logits_NV, mb.loss_target[part], reduction="none")
                g = torch.autograd.grad((logp_n * coef_of(logp_n.detach(), part)).sum(), [x, *leaves])
            logp_N[part] = logp_n.detach()
            g_sel[part] = g[0]
            torch._foreach_add_(grad_sums, [t.reshape(-1) for t in g[1:]])
        return g_sel, logp_N

    def eval_head(self, head: UnitTemplate, weights: Weights, h_BTD: torch.Tensor, mb: MicroBatch) -> None:
        """One micro-batch's metric sums under the current weights (no graph); while `collecting`, what the
        objective keeps of its log-probs instead (a preference loss: each sequence's sum; GRPO: each token's)."""
        logp_N = self._logps(head, weights, h_BTD, mb)
        if self.collected is not None:
            self.collected.append(self.objective.reference_of(logp_N, mb))
            return
        add_sums(self.sums, self.objective.token_loss(logp_N, mb, self.norm)[1])

    def _logps(self, head: UnitTemplate, weights: Weights, h_BTD: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """Each loss token's log-prob from the final hidden states `h_BTD` (no graph)."""
        sel_ND = h_BTD.flatten(0, 1).index_select(0, mb.loss_index)
        return token_logps(head, weights, sel_ND, mb, self.e.cfg.loss_chunk_tokens, self.objective.temperature)


def token_logps(head: UnitTemplate, weights: Weights, sel_ND: torch.Tensor, mb: MicroBatch, chunk: int,
                temperature: float = 1.0) -> torch.Tensor:
    """Each selected token's log-prob of its target under logits / temperature, in chunks (no graph) [N]."""
    logp_N = torch.empty(mb.num_selected, dtype=torch.float32, device=sel_ND.device)
    with torch.no_grad():
        for s in range(0, mb.num_selected, chunk):
            logits_NV = _scaled(head(weights, sel_ND[s : s + chunk]).float(), temperature)
            logp_N[s : s + chunk] = -F.cross_entropy(logits_NV, mb.loss_target[s : s + chunk], reduction="none")
    return logp_N


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Logits / temperature, as TRL's GRPO log-probs are taken (left as they are at 1: no extra rounding)."""
    return logits if temperature == 1.0 else logits / temperature
