"""The head of a step: final norm + LM head + loss, forward and backward together, in chunks of selected tokens.

Its own module because the head is where the vocabulary lives: each chunk's fp32 logits exist only while that
chunk's loss and gradient are taken, so full-vocabulary logits never do. A tied embedding makes the embedding
matrix the head's `lm_head.weight`; its gradient waits on the device for the embedding's own part.

Tensor shape key: B batch, T tokens, D hidden, N selected tokens, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from mt_ray.engine.batch import MicroBatch
from mt_ray.engine.reference import PreferenceSteps
from mt_ray.engine.step_grads import StepGrads
from mt_ray.engine.templates import UnitTemplate, Weights
from mt_ray.models.discovery import ModelSpec

WeightsOf = Callable[[str], torch.Tensor]


class LossHead:
    """The chunked token loss over final hidden states, for a training step (with gradients) and an evaluation.

    `weights(unit)` is the engine's flat device weights of a unit; `pref` a preference stage, whose head replaces
    the token loss with per-sequence log-probs fed to its loss.
    """

    def __init__(self, spec: ModelSpec, template: UnitTemplate, weights: WeightsOf, grads: StepGrads,
                 chunk_tokens: int, device: torch.device, pref: PreferenceSteps | None = None):
        self.spec = spec
        self.template = template
        self.weights = weights
        self.grads = grads
        self.chunk = chunk_tokens
        self.device = device
        self.pref = pref
        # Where the embedding matrix lies in the embed unit's flat buffer (pre-layer modules' weights follow it).
        embed_params = spec.unit("embed").params
        at = next(i for i, p in enumerate(embed_params) if p.local_name == "weight")
        self.embed_shape = embed_params[at].shape
        self.embed_at = slice(sum(p.numel for p in embed_params[:at]), sum(p.numel for p in embed_params[:at + 1]))

    def bind(self, requires_grad: bool, prefix: str = "") -> Weights:
        """The head's weights (`prefix` REF: the reference's), with the embedding matrix as `lm_head.weight` when tied."""
        weights = self.template.bind(self.weights(prefix + "head"), requires_grad=requires_grad)
        if self.spec.tied:
            emb = self.weights(prefix + "embed")[self.embed_at].view(self.embed_shape).detach()
            weights["lm_head.weight"] = emb.requires_grad_() if requires_grad else emb
        return weights

    def train(self, hiddens: Iterable[torch.Tensor], mbs: list[MicroBatch], inv_n: float, final: bool,
              on_grad: Callable[[int, torch.Tensor], None]) -> torch.Tensor:
        """Loss over each micro-batch's final hidden state, in chunks of selected tokens; hands each
        micro-batch's gradient to `on_grad` as soon as it is complete and returns the loss sum."""
        head = self.template
        weights = self.bind(requires_grad=True)
        leaves = head.leaves(weights)
        sums = list(self.grads.sum_of("head").split(head.sizes))[: len(leaves)]
        if self.spec.tied:
            leaves.append(weights["lm_head.weight"])
            # The tied embedding's head gradient waits on the device for the embedding's own part.
            sums.append(self.grads.sum_of("embed")[self.embed_at])
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        for j, (h_BTD, mb) in enumerate(zip(hiddens, mbs, strict=True)):
            h_ND = h_BTD.flatten(0, 1)  # [B*T, ...]: a widened stream keeps its per-token shape
            sel_ND = h_ND.index_select(0, mb.loss_index)
            if self.pref is not None:  # per-sequence log-probs into the preference loss instead
                g_sel, loss = self.pref.head_grads(head, weights, leaves, sums, sel_ND, mb)
                loss_sum += loss
            else:
                g_sel = torch.empty_like(sel_ND)
                for s in range(0, mb.num_selected, self.chunk):
                    x = sel_ND[s : s + self.chunk].detach().requires_grad_()
                    with torch.enable_grad():
                        loss = chunk_loss(head, weights, x, mb.loss_target[s : s + self.chunk])
                        g = torch.autograd.grad(loss * inv_n, [x, *leaves])
                    g_sel[s : s + self.chunk] = g[0]
                    torch._foreach_add_(sums, [t.reshape(-1) for t in g[1:]])
                    loss_sum += loss.detach()
            on_grad(j, torch.zeros_like(h_ND).index_copy_(0, mb.loss_index, g_sel).view_as(h_BTD))
        if final:
            head_sum = self.grads.sums.pop("head")
            if not self.spec.unit("head").frozen:  # an empty head (tied, no final norm) has nothing to send
                self.grads.send("head", head_sum)
        return loss_sum

    def eval(self, hiddens: Iterable[torch.Tensor], mbs: list[MicroBatch]) -> torch.Tensor:
        """The summed loss of the final hidden states, in the training head's chunks, with no graph."""
        head = self.template
        weights = self.bind(requires_grad=False)
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        for h_BTD, mb in zip(hiddens, mbs, strict=True):
            if self.pref is not None:
                self.pref.eval_head(head, weights, h_BTD, mb)
                continue
            sel_ND = h_BTD.flatten(0, 1).index_select(0, mb.loss_index)
            for s in range(0, mb.num_selected, self.chunk):
                loss_sum += chunk_loss(head, weights, sel_ND[s : s + self.chunk], mb.loss_target[s : s + self.chunk])
        return loss_sum


def chunk_loss(head: UnitTemplate, weights: Weights, x_ND: torch.Tensor, target_N: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of one chunk of selected tokens, from fp32 logits that live only for this chunk."""
    logits_NV = head(weights, x_ND).float()
    return torch.nn.functional.cross_entropy(logits_NV, target_N, reduction="sum")
