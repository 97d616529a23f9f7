"""A run of decoder layers with autograd, one graph per layer, and its backward, last layer first.

Each layer starts from a detached input, so each can go backward alone, its graph freed as it goes. The
three places that run layers with a graph (a kept block's forward, a block's recompute, the resident
schedule) share this pair through `Segment`. The backward also carries what layers share besides the
hidden state: a MoE router's logits (the router loss's gradient), side channels (`backward_terms`), what
the body adds after a layer (Qwen3-VL's deepstack features) and arguments that carry a gradient to the
embedding (`LayerContext`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from mt_ray.engine.step_grads import StepGrads
from mt_ray.engine.templates import UnitTemplate, Weights
from mt_ray.models.context import LayerContext
from mt_ray.models.discovery import ModelSpec
from mt_ray.models.side_channels import backward_terms, take_grads

# Layer i's output hidden state, and its router logits when a router loss records them.
LayerFn = Callable[[int, Weights, torch.Tensor, LayerContext], tuple[torch.Tensor, torch.Tensor | None]]


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


def run_layers(layers: range, x: torch.Tensor, ctx: LayerContext, weights: dict[int, Weights],
               bind: Callable[[int], Weights], layer: LayerFn) -> list[Segment]:
    """Run `layers` with autograd, each from a detached input so each can go backward alone.

    Weights missing from `weights` are bound (`bind`) as the loop reaches them, so a layer's compute
    waits only for its own upload.
    """
    segments = []
    with torch.enable_grad():
        for i in layers:
            if i not in weights:
                weights[i] = bind(i)
            x = x.detach().requires_grad_()
            injected = ctx.track_injection(i)
            inputs = ctx.track_inputs(i)
            out, logits = layer(i, weights[i], x, ctx)
            segments.append(Segment(i, x, out, logits, injected, inputs))
            x = out
    return segments


class LayerBackward:
    """Runs `run_layers`' segments backward, adding each layer's gradient to the step's sums (`grads`)."""

    def __init__(self, spec: ModelSpec, layer_templates: list[UnitTemplate], grads: StepGrads):
        self.layer_templates = layer_templates
        self.grads = grads
        # Layers holding or owning weights tied between layers, by index.
        self.tie_layers = {int(name.split(".")[1]) for unit, mirrors in spec.mirrors.items()
                           for name in (unit, *(m.owner for m in mirrors))}

    def __call__(self, segments: list[Segment], weights: dict[int, Weights], g: torch.Tensor, final: bool,
                 aux_grads: dict[int, torch.Tensor], ctx: LayerContext) -> torch.Tensor:
        """Backward through the segments, last first, freeing each graph as it goes; returns the gradient of the
        first one's input. A MoE layer's router logits take the router loss's gradient with them, and what the
        body added after a layer keeps its gradient in `ctx` (for the embedding's backward)."""
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
            unused = bool(carried) or i in self.tie_layers
            gs = torch.autograd.grad(outputs, [x, *leaves, *mirrors, *([] if injected is None else [injected]),
                                               *read, *carried], out_grads, allow_unused=unused, materialize_grads=unused)
            take_grads(ctx.channels, i, gs[len(gs) - len(carried) - len(read):len(gs) - len(carried)])
            g = gs[0]
            self.grads.add_mirrors(f"layers.{i}", gs[1 + len(leaves):1 + len(leaves) + len(mirrors)])
            self.grads.add(f"layers.{i}", gs[1:1 + len(leaves)], final, template.frozen_numel)
            if injected is not None:
                ctx.injection.grads[i] = gs[1 + len(leaves) + len(mirrors)]
            ctx.input_grads.update({key: grad for (key, _), grad in zip(inputs, gs[len(gs) - len(carried):], strict=True)})
        return g
