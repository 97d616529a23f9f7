"""Run the model's own body code around the layers, so every family gets its masks and rotary
tables exactly as transformers computes them.

Instead of re-implementing each family's forward (Gemma's embedding scale, sliding-window
masks, per-layer-type rotary tables, packed-sequence masks, ...), we call the body's
`forward` with its decoder layers replaced by stubs that record what each layer is called
with and pass the hidden state through. The recorded arguments are the layer context: the
engine replays them into the weightless layer templates.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mt_ray.models.discovery import ModelSpec, meta_free_buffers_to

LayerKwargs = dict[str, Any]


class _RecordingLayer(nn.Module):
    """Stands in for decoder layer `index`: records its call, returns the input unchanged."""

    def __init__(self, index: int, log: dict[int, tuple[torch.Tensor, LayerKwargs]], template: nn.Module):
        super().__init__()
        self.index = index
        self.log = log
        # Bodies read attributes such as `attention_type` off their layers; mirror them.
        for attr in ("attention_type", "layer_type", "is_sliding"):
            if hasattr(template, attr):
                setattr(self, attr, getattr(template, attr))

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args:
            raise TypeError("decoder layers are expected to take their context as keyword arguments")
        self.log[self.index] = (hidden_states, kwargs)
        return hidden_states


class LayerContextBuilder:
    """Turns input embeddings + position ids into (h0, per-layer keyword arguments)."""

    def __init__(self, spec: ModelSpec, device: torch.device):
        self.log: dict[int, tuple[torch.Tensor, LayerKwargs]] = {}
        body = spec.base
        layers = getattr(body, spec.layers_attr)
        stubs = nn.ModuleList(_RecordingLayer(i, self.log, layer) for i, layer in enumerate(layers))
        # A shallow copy of the body with stubs in place of layers and an identity final norm:
        # the skeleton itself stays intact for export and templates.
        self.body = _shallow_copy(body)
        self.body._modules[spec.layers_attr] = stubs
        self.body._modules[spec.norm_attr] = nn.Identity()
        meta_free_buffers_to(self.body, device)
        self.num_layers = len(layers)

    def __call__(
        self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, list[LayerKwargs]]:
        """Return the hidden state that enters layer 0 and the kwargs of every layer."""
        self.log.clear()
        self.body(inputs_embeds=inputs_embeds, position_ids=position_ids, use_cache=False)
        if len(self.log) != self.num_layers:
            raise RuntimeError(f"body called {len(self.log)} of {self.num_layers} layers")
        h0 = self.log[0][0]
        per_layer = [dict(self.log[i][1]) for i in range(self.num_layers)]
        for kw in per_layer:
            kw.pop("past_key_values", None)
            kw["use_cache"] = False
        self.log.clear()
        return h0, per_layer


def _shallow_copy(module: nn.Module) -> nn.Module:
    clone = module.__class__.__new__(module.__class__)
    clone.__dict__ = dict(module.__dict__)
    clone._modules = dict(module._modules)
    clone._parameters = dict(module._parameters)
    clone._buffers = dict(module._buffers)
    return clone
