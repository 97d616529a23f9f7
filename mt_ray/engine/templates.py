"""Stateless unit templates: one weightless device module per kind of unit.

A template is a module of the model's skeleton whose parameters stay on the meta device;
the weights of whichever unit is being computed are bound per call with
`torch.func.functional_call`, as views of that unit's flat device buffer. So there is one
module per layer *kind* (dense, MoE, sliding-window, ...), never one per layer, and no
autograd graph lives longer than the call that built it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from mt_ray.models.discovery import ModelSpec, ParamInfo, meta_free_buffers_to

Weights = dict[str, torch.Tensor]


class UnitTemplate:
    """Binds a flat weight buffer to a weightless module and calls it."""

    def __init__(self, module: nn.Module, params: list[ParamInfo], device: torch.device):
        self.module = meta_free_buffers_to(module, device)
        self.params = params
        self.sizes = [p.numel for p in params]

    def bind(self, flat: torch.Tensor, requires_grad: bool = False) -> Weights:
        """Shaped views of `flat` by local parameter name (leaves of autograd when asked)."""
        views = {}
        for p, chunk in zip(self.params, flat.split(self.sizes), strict=True):
            v = chunk.view(p.shape)
            views[p.local_name] = v.detach().requires_grad_() if requires_grad else v
        return views

    def __call__(self, weights: Weights, *args: Any, **kwargs: Any) -> Any:
        # Not strict: buffers (rotary tables, embedding scales) come from the module itself.
        return functional_call(self.module, weights, args, kwargs, tie_weights=False)


class HeadModule(nn.Module):
    """Final norm + LM head (+ logit soft-capping where the family uses it), on selected tokens."""

    def __init__(self, norm: nn.Module, lm_head: nn.Linear, softcap: float | None):
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head
        self.softcap = softcap

    def forward(self, h_ND: torch.Tensor) -> torch.Tensor:
        logits_NV = self.lm_head(self.norm(h_ND))
        if self.softcap:
            logits_NV = torch.tanh(logits_NV / self.softcap) * self.softcap
        return logits_NV


def build_templates(spec: ModelSpec, device: torch.device) -> dict[str, UnitTemplate]:
    """One template per unit kind: 'embed', 'head' and each distinct decoder-layer kind."""
    embed = spec.skeleton.get_input_embeddings()
    norm = getattr(spec.base, spec.norm_attr)
    head = HeadModule(norm, spec.skeleton.get_output_embeddings(), getattr(spec.config, "final_logit_softcapping", None))
    # A tied head binds only the norm from its own unit; the engine adds the embedding matrix.
    templates = {
        "embed": UnitTemplate(embed, spec.unit("embed").params, device),
        "head": UnitTemplate(head, spec.unit("head").params, device),
    }
    for kind, module in spec.layer_kinds.items():
        params = next(u.params for u in spec.layer_units if u.kind == kind)
        templates[kind] = UnitTemplate(module, params, device)
    return templates
