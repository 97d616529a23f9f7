"""Preference objectives on per-sequence log-probs: DPO (sigmoid, IPO, hinge), ORPO, SimPO and KTO.

A preference stage changes only what the head computes. Where SFT sums each loss token's
cross-entropy, a preference head sums each sequence's token log-probs (`s`, one number per chosen,
rejected, KTO or KL-twin sequence; `n` its loss tokens) and feeds them, with the reference's sums
(`r`), to the loss of TRL's trainers, written out here:

  sigmoid  -(1-e)·logσ(βΔ) - e·logσ(-βΔ),  Δ = (s_c - r_c) - (s_r - r_r)     (DPOTrainer; e: label smoothing)
  ipo      ((s_c - r_c)/n_c - (s_r - r_r)/n_r - 1/(2β))²                      (DPOTrainer, TRL's length-normalised IPO)
  hinge    relu(1 - βΔ)                                                        (DPOTrainer)
  orpo     -β·logσ(log-odds(a_c) - log-odds(a_r)), a = s/n, + the chosen NLL   (ORPOTrainer)
  simpo    -(1-e)·logσ(β(a_c - a_r) - γ) - e·logσ(-(...))                      (CPOTrainer, loss_type simpo, cpo_alpha 0)
  kto      w_d·(1 - σ(β(s - r - z))) or w_u·(1 - σ(β(z - (s - r)))),           (KTOTrainer)
           z = max(0, mean over the micro-batch's KL twins of (s - r)), no gradient

A step's loss is the mean of these over its pairs (KTO: its examples), plus `ftx` times the mean
token NLL of the chosen (KTO: desirable) responses. ORPO's NLL (`pref.orpo_nll`) is, as `ORPOTrainer`'s
`concatenated_forward` takes it, the token mean over the chosen sequences' prompt and response tokens
(`trl`: the head then also selects the chosen prompts' tokens, summed apart from the responses' as
`p`), or each pair's mean response-token NLL averaged over the pairs (`llamafactory`). Since every term
is a function of the sequence sums, the gradient reaching each selected token is dL/ds (or dL/dp) of its
sequence: the head runs one forward without a graph for `s`, then its usual chunked forward and backward
with each token's log-prob weighted by that coefficient (`PreferenceHead`). Rewards, log-probs and
ORPO's `nll_loss`, `log_odds_ratio` and `log_odds_chosen` are reported under TRL's metric names.

Shape key: S sequences of a micro-batch (rows x segment columns), N loss tokens, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

PAIR_LOSSES = ("sigmoid", "ipo", "hinge", "orpo", "simpo")
KTO_LOSSES = ("sigmoid",)
REFERENCE_FREE = ("orpo", "simpo")
STAGES = ("sft", "dpo", "kto", "grpo")
# Sequence roles, as the data pipeline numbers them (mt_ray.data.schema.ROLE_*).
CHOSEN, REJECTED, DESIRABLE, UNDESIRABLE, KL, COMPLETION = 1, 2, 3, 4, 5, 6


class PreferenceConfig(BaseModel):
    """The `pref` section: how a preference stage (`training.stage: dpo | kto`) scores its sequences;
    names as LLaMA-Factory's `pref_*` options."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)

    beta: float = Field(0.1, gt=0)
    """β: the inverse temperature of the preference loss (LLaMA-Factory's pref_beta)."""
    loss: str = "sigmoid"
    """Stage dpo: sigmoid (DPO), ipo, hinge, orpo or simpo (reference-free: no reference is held); stage kto:
    sigmoid (KTO's own loss)."""
    ftx: float = Field(0.0, ge=0)
    """Weight of the SFT term: the mean token NLL of the chosen (KTO: desirable) responses (pref_ftx)."""
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    """cDPO's label smoothing for sigmoid and simpo: the chance that a pair's labels are flipped."""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin γ (LLaMA-Factory's simpo_gamma)."""
    orpo_nll: Literal["trl", "llamafactory"] = "trl"
    """ORPO's NLL term: `trl`: the token mean over the chosen sequences' prompt and response tokens, as TRL's
    ORPOTrainer takes it; `llamafactory`: each pair's mean response-token NLL, averaged over the pairs (LLaMA-Factory's
    orpo `sft_loss`)."""
    kto_chosen_weight: float = Field(1.0, gt=0)
    """KTO: weight of the desirable examples' loss (TRL's desirable_weight)."""
    kto_rejected_weight: float = Field(1.0, gt=0)
    """KTO: weight of the undesirable examples' loss (TRL's undesirable_weight)."""
    reference: Literal["stream", "precompute"] = "stream"
    """Where the reference's log-probs come from: `stream`: a forward-only pass of the frozen starting weights
    (held in host memory in the compute dtype), streamed through the same layer loop as the policy's step;
    `precompute`: once per dataset before training (KTO: over the run's own batches, whose KL twins follow the
    data order), cached on disk."""


def check_stage(stage: str, cfg: PreferenceConfig) -> None:
    """Refuse a `pref.loss` the stage cannot run, in one line that lists the valid ones."""
    valid = {"dpo": PAIR_LOSSES, "kto": KTO_LOSSES}.get(stage)
    if valid is not None and cfg.loss not in valid:
        raise ValueError(f"pref.loss: {cfg.loss!r} is not a loss stage {stage} runs; use one of {', '.join(valid)}")


@dataclass
class Sequences:
    """Where a micro-batch's sequences are (device index tensors, made on the host) and its host counts."""

    index: torch.Tensor  # [N] the sequence of each selected token; a chosen prompt's token (`prompt_nll`): S + its
    # sequence, so its log-prob sums apart
    num: int  # S
    tokens: torch.Tensor  # [S] loss tokens of each sequence (float)
    chosen: torch.Tensor  # pair k's chosen and rejected sequence (DPO), or the desirable ones (KTO)
    rejected: torch.Tensor
    kl: torch.Tensor  # KTO's KL twins
    counts: dict[str, int]  # pairs, chosen_tokens, chosen_sequence_tokens, desirable, undesirable, kl_batches,
    # completions, loss_tokens
    slots: int = 0  # sums the head's log-probs add into: S, or 2S with the chosen prompts' tokens

    def __post_init__(self) -> None:
        self.slots = self.slots or self.num


def chosen_continues(seq_role: torch.Tensor, segment_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] the tokens of a chosen sequence whose next token is in that sequence: the tokens whose next-token
    NLL `ORPOTrainer` takes (prompt and response; a sequence's first token is predicted by none of them)."""
    same = torch.zeros_like(segment_ids, dtype=torch.bool)
    same[:, :-1] = segment_ids[:, :-1] == segment_ids[:, 1:]
    return same & (seq_role.gather(1, segment_ids) == CHOSEN)


def sequences_of(seq_role: torch.Tensor, segment_ids: torch.Tensor, loss_index: torch.Tensor, to_device,
                 prompt_N: torch.Tensor | None = None) -> Sequences:
    """Index a micro-batch's sequences from its host tensors: `seq_role` [B, W], `segment_ids` [B, T] and the
    flat positions of the selected tokens; `prompt_N` marks those that are a chosen prompt's (no label: their log-probs
    sum into slots of their own, after the S sequences')."""
    B, W = seq_role.shape
    T = segment_ids.shape[1]
    index = (loss_index // T) * W + segment_ids.reshape(-1)[loss_index]
    labelled = index if prompt_N is None else index[~prompt_N]
    if prompt_N is not None:
        index = torch.where(prompt_N, index + B * W, index)
    roles = seq_role.reshape(-1)
    tokens = torch.bincount(labelled, minlength=B * W)

    def where(*kinds: int) -> torch.Tensor:
        return torch.isin(roles, torch.tensor(kinds)).nonzero().squeeze(1)

    chosen = where(CHOSEN) if (roles == CHOSEN).any() else where(DESIRABLE)
    rejected = where(REJECTED) if (roles == REJECTED).any() else where(UNDESIRABLE)
    kl = where(KL)
    good = where(CHOSEN, DESIRABLE)
    counts = {"pairs": int((roles == CHOSEN).sum()), "chosen_tokens": int(tokens[good].sum()),
              "chosen_sequence_tokens": int(chosen_continues(seq_role, segment_ids).sum()),
              "desirable": int((roles == DESIRABLE).sum()), "undesirable": int((roles == UNDESIRABLE).sum()),
              "kl_batches": int(kl.numel() > 0), "completions": int((roles == COMPLETION).sum()),
              "loss_tokens": int(labelled.numel())}
    return Sequences(to_device(index), B * W, to_device(tokens.float()), to_device(chosen), to_device(rejected),
                     to_device(kl), counts, B * W * (1 if prompt_N is None else 2))


class Objective:
    """The loss of a preference stage as a function of a micro-batch's sequence sums."""

    token_wise = False  # a token's gradient depends on its whole sequence (GRPO's `GroupObjective` is token-wise)

    def __init__(self, stage: str, cfg: PreferenceConfig):
        check_stage(stage, cfg)
        self.stage = stage
        self.cfg = cfg
        self.needs_reference = stage == "kto" or cfg.loss not in REFERENCE_FREE
        self.average = stage == "dpo" and cfg.loss in REFERENCE_FREE  # ORPO, SimPO: mean token log-probs
        self.orpo = stage == "dpo" and cfg.loss == "orpo"
        self.prompt_nll = self.orpo and cfg.orpo_nll == "trl"  # the head selects the chosen prompts' tokens too
        self.temperature = 1.0

    def reference_of(self, logp_N: torch.Tensor, mb) -> torch.Tensor:
        """What the reference contributes: each sequence's log-prob sum [S]."""
        return _sequence_sums(logp_N, mb.seqs)[: mb.seqs.num]

    def token_loss(self, logp_N: torch.Tensor, mb, norm: dict[str, int]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """`loss` of the micro-batch's sequence sums, from its token log-probs (so its gradient reaches each token)."""
        sums, S = _sequence_sums(logp_N, mb.seqs), mb.seqs.num
        return self.loss(sums[:S], mb.ref_logps, mb.seqs.tokens, mb.seqs, norm, sums[S:] if self.prompt_nll else None)

    def examples(self, counts: dict[str, int]) -> int:
        """What the step's loss is a mean over: pairs, or KTO examples."""
        return counts["pairs"] if self.stage == "dpo" else counts["desirable"] + counts["undesirable"]

    def loss(self, s_S: torch.Tensor, r_S: torch.Tensor | None, n_S: torch.Tensor, seqs: Sequences,
             norm: dict[str, int], p_S: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """This micro-batch's share of the step's loss (normalised by the step's counts `norm`) and its
        metric sums (summed over its pairs or examples; `metrics` turns them into means). `p_S`: each sequence's
        prompt-token log-prob sum (ORPO's `trl` NLL)."""
        if self.stage == "kto":
            loss, sums = self._kto(s_S, r_S, seqs)
        else:
            loss, sums = self._pairs(s_S, r_S, n_S, seqs)
        nll = -s_S.index_select(0, seqs.chosen).sum()
        sums["nll"] = nll.detach()
        total = loss / max(1, self.examples(norm))
        if self.cfg.ftx:
            total = total + self.cfg.ftx * nll / max(1, norm["chosen_tokens"])
        if self.orpo:
            orpo_nll = self._orpo_nll(nll, s_S, n_S, seqs, p_S)
            sums["orpo_nll"] = orpo_nll.detach()
            total = total + orpo_nll / self._orpo_nll_count(norm)
        return total, sums

    def _orpo_nll(self, nll: torch.Tensor, s_S: torch.Tensor, n_S: torch.Tensor, seqs: Sequences,
                  p_S: torch.Tensor | None) -> torch.Tensor:
        """The micro-batch's sum of ORPO's NLL term: over the chosen sequences' prompt and response tokens (`trl`),
        or of each chosen response's mean token NLL (`llamafactory`)."""
        if self.cfg.orpo_nll == "llamafactory":
            return -(s_S.index_select(0, seqs.chosen) / n_S.index_select(0, seqs.chosen).clamp(min=1)).sum()
        return nll - p_S.index_select(0, seqs.chosen).sum()

    def _orpo_nll_count(self, counts: dict[str, int]) -> int:
        """What ORPO's NLL sum is a mean over: the chosen sequences' predicted tokens (`trl`), or the pairs."""
        return max(1, counts["pairs"] if self.cfg.orpo_nll == "llamafactory" else counts["chosen_sequence_tokens"])

    def _pairs(self, s_S, r_S, n_S, seqs):
        cfg, beta = self.cfg, self.cfg.beta
        s_c, s_r = s_S.index_select(0, seqs.chosen), s_S.index_select(0, seqs.rejected)
        n_c, n_r = n_S.index_select(0, seqs.chosen).clamp(min=1), n_S.index_select(0, seqs.rejected).clamp(min=1)
        if self.average:
            s_c, s_r = s_c / n_c, s_r / n_r
            rew_c, rew_r = beta * s_c.detach(), beta * s_r.detach()
        else:
            rew_c = beta * (s_c - r_S.index_select(0, seqs.chosen)).detach()
            rew_r = beta * (s_r - r_S.index_select(0, seqs.rejected)).detach()
        extra = {}
        if cfg.loss == "orpo":
            log_odds = (s_c - s_r) - (_log1mexp(s_c) - _log1mexp(s_r))
            ratio = F.logsigmoid(log_odds)
            losses = -beta * ratio
            # TRL's names: `log_odds_ratio` is the mean logσ of the log-odds, `log_odds_chosen` the mean log-odds
            extra = {"log_odds_ratio": ratio.detach().sum(), "log_odds_chosen": log_odds.detach().sum()}
        elif cfg.loss == "simpo":
            losses = _smoothed(beta * (s_c - s_r) - cfg.simpo_gamma, cfg.label_smoothing)
        else:
            lr_c, lr_r = s_c - r_S.index_select(0, seqs.chosen), s_r - r_S.index_select(0, seqs.rejected)
            if cfg.loss == "sigmoid":
                losses = _smoothed(beta * (lr_c - lr_r), cfg.label_smoothing)
            elif cfg.loss == "hinge":
                losses = torch.relu(1 - beta * (lr_c - lr_r))
            else:  # ipo
                losses = (lr_c / n_c - lr_r / n_r - 1 / (2 * beta)) ** 2
        sums = {"loss": losses.detach().sum(), "rewards/chosen": rew_c.sum(), "rewards/rejected": rew_r.sum(),
                "rewards/accuracies": (rew_c > rew_r).float().sum(), "rewards/margins": (rew_c - rew_r).sum(),
                "logps/chosen": s_c.detach().sum(), "logps/rejected": s_r.detach().sum(), **extra}
        return losses.sum(), sums

    def _kto(self, s_S, r_S, seqs):
        cfg, beta = self.cfg, self.cfg.beta
        ratio_S = (s_S - r_S).detach()
        kl_twins = ratio_S.index_select(0, seqs.kl)
        z = (kl_twins.sum() / max(1, seqs.kl.numel())).clamp(min=0)
        lr_d = s_S.index_select(0, seqs.chosen) - r_S.index_select(0, seqs.chosen)
        lr_u = s_S.index_select(0, seqs.rejected) - r_S.index_select(0, seqs.rejected)
        loss = (cfg.kto_chosen_weight * (1 - torch.sigmoid(beta * (lr_d - z)))).sum() + \
            (cfg.kto_rejected_weight * (1 - torch.sigmoid(beta * (z - lr_u)))).sum()
        sums = {"loss": loss.detach(), "rewards/chosen": beta * lr_d.detach().sum(),
                "rewards/rejected": beta * lr_u.detach().sum(), "kl": z,
                "logps/chosen": s_S.index_select(0, seqs.chosen).detach().sum(),
                "logps/rejected": s_S.index_select(0, seqs.rejected).detach().sum()}
        return loss, sums

    def metrics(self, sums: dict[str, torch.Tensor], counts: dict[str, int]) -> dict[str, torch.Tensor]:
        """Means of the metric sums over the step's (or an eval set's) `counts`, under TRL's names, and the
        loss they add up to (`loss`)."""
        if self.stage == "kto":
            d, u = max(1, counts["desirable"]), max(1, counts["undesirable"])
            out = {"rewards/chosen": sums["rewards/chosen"] / d, "rewards/rejected": sums["rewards/rejected"] / u,
                   "logps/chosen": sums["logps/chosen"] / d, "logps/rejected": sums["logps/rejected"] / u,
                   "kl": sums["kl"] / max(1, counts["kl_batches"])}
            out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
        else:
            p = max(1, counts["pairs"])
            out = {k: v / p for k, v in sums.items() if k.startswith(("rewards/", "logps/", "log_odds_"))}
        out["loss"] = sums["loss"] / max(1, self.examples(counts))
        if self.cfg.ftx:
            sft = sums["nll"] / max(1, counts["chosen_tokens"])
            out["sft_loss" if self.orpo else "nll_loss"] = sft
            out["loss"] = out["loss"] + self.cfg.ftx * sft
        if self.orpo:
            out["nll_loss"] = sums["orpo_nll"] / self._orpo_nll_count(counts)
            out["loss"] = out["loss"] + out["nll_loss"]
        return out


def _sequence_sums(logp_N: torch.Tensor, seqs: Sequences) -> torch.Tensor:
    return torch.zeros(seqs.slots, dtype=logp_N.dtype, device=logp_N.device).index_add(0, seqs.index, logp_N)


def add_sums(total: dict[str, torch.Tensor], part: dict[str, torch.Tensor]) -> None:
    for k, v in part.items():
        total[k] = total[k] + v if k in total else v


def add_counts(total: dict[str, int], part: dict[str, int]) -> dict[str, int]:
    return {k: total.get(k, 0) + v for k, v in part.items()}


def _smoothed(logits: torch.Tensor, eps: float) -> torch.Tensor:
    """cDPO: -(1-e)·logσ(x) - e·logσ(-x)."""
    loss = -F.logsigmoid(logits)
    return loss if not eps else (1 - eps) * loss - eps * F.logsigmoid(-logits)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate near 0 and far below it (TRL's log1mexp)."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))
