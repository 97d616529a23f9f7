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
from transformers.modeling_outputs import MoeModelOutputWithPast

from mt_ray.models.discovery import ModelSpec, ParamInfo, embed_module, meta_free_buffers_to
from mt_ray.models.nesting import head_extras, shallow_copy, with_submodule
from mt_ray.models.stream_tail import Stream
from mt_ray.models.tail_module import TailModule

Weights = dict[str, torch.Tensor]


class UnitTemplate:
    """Binds a flat weight buffer to a weightless module and calls it."""

    def __init__(self, module: nn.Module, params: list[ParamInfo], device: torch.device):
        self.module = meta_free_buffers_to(module, device)
        self.params = params
        self.sizes = [p.numel for p in params]
        # Frozen entries (saved buffers, mirrors) come last in a unit: its gradient is the trainable part + zeros.
        self.frozen_numel = sum(p.numel for p in params if not p.trainable)

    def bind(self, flat: torch.Tensor, requires_grad: bool = False) -> Weights:
        """Shaped views of `flat` by local name (trainable ones and mirrors leaves of autograd when asked)."""
        views = {}
        for p, chunk in zip(self.params, flat.split(self.sizes), strict=True):
            v = chunk.view(p.shape)
            grad = requires_grad and (p.trainable or p.tied_to is not None)
            views[p.local_name] = v.detach().requires_grad_() if grad else v
        return views

    def leaves(self, weights: Weights) -> list[torch.Tensor]:
        """The bound tensors gradients are taken for, in the unit's order."""
        return [weights[p.local_name] for p in self.params if p.trainable]

    def mirror_leaves(self, weights: Weights) -> list[torch.Tensor]:
        """The bound mirrors (`ParamInfo.tied_to`), in the unit's order: their gradients go to their owners."""
        return [weights[p.local_name] for p in self.params if p.tied_to is not None]

    def __call__(self, weights: Weights, *args: Any, **kwargs: Any) -> Any:
        # Not strict: buffers (rotary tables, embedding scales) come from the module itself.
        return functional_call(self.module, weights, args, kwargs, tie_weights=False)


class _HandedBack(MoeModelOutputWithPast):
    """The body's output as the head sees it: the hidden states, and None for any other field the family's
    forward reads (Qwen2.5-VL passes on `rope_deltas`)."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return None


class _HandBack:
    """Stands in for the decoder body's forward: returns the hidden states it was handed.

    A separate object, so the body copy refers to no HeadModule (no reference cycle keeps the
    templates alive after the engine is gone).
    """

    def __init__(self) -> None:
        self.hidden: torch.Tensor | None = None

    def __call__(self, *args, **kwargs) -> MoeModelOutputWithPast:
        return _HandedBack(last_hidden_state=self.hidden)


class HeadModule(nn.Module):
    """Final norm, then the family's own causal-LM forward on selected tokens.

    Running the family's forward (with the decoder body replaced by one that hands back the
    normed hidden states) gives whatever it does after the body exactly as transformers does:
    the LM head, Gemma's final logit soft-capping, Falcon-H1's `lm_head_multiplier`, Granite's
    logit scaling. `norm`, `lm_head` and the modules in between (`nesting.head_extras`) are the skeleton's own, so
    weights bind by name.
    """

    def __init__(self, spec: ModelSpec, stream: Stream):
        super().__init__()
        self.norm = spec.base.get_submodule(spec.norm_attr) if spec.norm_attr is not None else nn.Identity()
        # The body's code after its layers (`stream_tail`), kept out of `_modules`: its children (the norm too) are
        # registered here, where the head unit's weights bind to them by their names.
        self.__dict__["_tail"] = TailModule(spec, stream) if spec.tail_code is not None else None
        for attr in spec.tail_attrs:
            self.add_module(attr, getattr(spec.base, attr))
        self.lm_head = spec.skeleton.get_output_embeddings()
        extras = head_extras(spec.skeleton, spec.base, spec.between_attrs, spec.unread_attrs)
        for name, module in extras.items():  # BERT's prediction head, run by the family's forward
            self.add_module(name, module)
        causal_lm, body = _logits_forward(spec)
        body_path = next(n for n, m in causal_lm.named_modules() if m is body)
        feeder = shallow_copy(body)  # keeps the body's attributes: the head may read them
        feeder.forward = self.__dict__["_hand_back"] = _HandBack()
        # Kept out of `_modules`, so binding sees only the head unit's modules (which the copy shares).
        self.__dict__["_causal_lm"] = with_submodule(causal_lm, body_path, feeder)
        # A composite body that holds the head embeds the tokens itself unless handed embeddings: it is handed the
        # hidden states, which its decoder body's stand-in ignores.
        self._handed_embeddings = spec.vision is not None and spec.vision.holds_head

    def use_stream(self, stream: Stream) -> None:
        """The layer context's stream (a new one after the attention backend changes), which the tail reads."""
        if self._tail is not None:
            self._tail.stream = stream

    def forward(self, h_ND: torch.Tensor) -> torch.Tensor:
        normed = self.norm(h_ND) if self._tail is None else self._tail(h_ND)  # the tail: [N, ...] stream in
        self._hand_back.hidden = normed.reshape(1, -1, normed.shape[-1])  # as one row of N tokens
        try:
            embeds = {"inputs_embeds": self._hand_back.hidden} if self._handed_embeddings else {}
            logits = self._causal_lm(use_cache=False, **embeds).logits
        finally:
            self._hand_back.hidden = None
        tokens = h_ND.shape[:-1] if self._tail is None else h_ND.shape[:1]  # a widened stream: [N, ...] in
        return logits.view(*tokens, -1)


def _logits_forward(spec: ModelSpec) -> tuple[nn.Module, nn.Module]:
    """The module whose forward computes the logits, and the body it calls there: the causal LM and its decoder body;
    an image-text model and its composite body (which embeds and scatters images itself); or, where the composite
    body's language model is a whole causal LM (Llama 4's) or the composite body holds the head itself (the Omni
    thinkers), that causal LM and the decoder body inside it."""
    vision = spec.vision
    if vision is None:
        return spec.skeleton, spec.base
    if vision.causal_lm_path is None:
        return spec.skeleton, vision.outer
    return vision.outer.get_submodule(vision.causal_lm_path), spec.base


def build_templates(spec: ModelSpec, device: torch.device, stream: Stream | None = None) -> dict[str, UnitTemplate]:
    """One template per unit kind: 'embed', 'head', each distinct decoder-layer kind and vision-block kind
    (the vision stage makes the templates of `vision.embed` and `vision.projector` itself); `stream`: the layer
    context's (`LayerContextBuilder.stream`), whose layout and values the head's tail code reads."""
    head = HeadModule(spec, stream or Stream())
    # A tied head binds only the norm from its own unit; the engine adds the embedding matrix.
    templates = {
        "embed": UnitTemplate(embed_module(spec), spec.unit("embed").params, device),
        "head": UnitTemplate(head, spec.unit("head").params, device),
    }
    kinds = {**spec.layer_kinds, **(spec.vision.block_kinds if spec.vision is not None else {})}
    for kind, module in kinds.items():
        params = next(u.params for u in spec.units if u.kind == kind)
        templates[kind] = UnitTemplate(module, params, device)
    return templates

