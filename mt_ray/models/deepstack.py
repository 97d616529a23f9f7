"""What an image-text body adds at the image tokens between its decoder layers (deepstack), taken out of the
layer context's recording and handed to the engine, which adds it with the layers (forward and recompute alike).

transformers has two conventions. Qwen3-VL's language model takes `visual_pos_masks` [B, T] and
`deepstack_visual_embeds`, one tensor per layer, which its `_deepstack_process` adds right after layer i.
Granite 4 Vision's takes `vision_mask` [B, T, 1] and `deepstack_features` {layer: tensor}, which it adds right
before that layer (inline: the image rows plus the features, scattered back). Either becomes an `Injection` keyed
by the layer after which it is added. What Granite adds before layer 0 stays in the body's call: it is part of
layer 0's input, which the recording hands the engine with its gradient path to the features.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

Add = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Injection:
    """What the body adds to the hidden state at the image tokens after some of its layers.

    `add(hidden, mask_BT, embeds)` is the body's own function (or its inline code: `add_before_layer`); `embeds[i]`
    (the image tokens' rows, in token order) follows layer i; `grads[i]` is its gradient, set by layer i's backward.
    """

    add: Add
    mask_BT: torch.Tensor
    embeds: dict[int, torch.Tensor]
    grads: dict[int, torch.Tensor] = field(default_factory=dict)


def add_before_layer(hidden: torch.Tensor, mask_BT: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
    """Granite 4 Vision's addition before a layer, as its language model writes it inline."""
    embeds = embeds.to(hidden.device, hidden.dtype)
    return hidden.masked_scatter(mask_BT[..., None], (hidden[mask_BT] + embeds).view(-1))


class DeepstackTap:
    """Wraps the language model's forward (`__call__(forward, ...)`): its deepstack features are recorded, for
    `take`, rather than added between its layers."""

    def __init__(self, add: Add, num_layers: int, before: bool):
        self.add = add
        self.num_layers = num_layers
        self.before = before
        """Granite's convention (features keyed by the layer they enter), else Qwen3-VL's (a list, after each)."""
        self.taken: Injection | None = None

    def __call__(self, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.before:
            mask, features = kwargs.pop("vision_mask", None), kwargs.pop("deepstack_features", None)
            if features:  # what enters layer 0 stays in the call; the rest follows the layer before
                kwargs.update(vision_mask=mask, deepstack_features={0: features[0]} if 0 in features else None)
                after = {layer - 1: f for layer, f in features.items() if 0 < layer < self.num_layers}
                self.taken = Injection(self.add, mask[..., 0], after)
        else:
            mask, features = kwargs.pop("visual_pos_masks", None), kwargs.pop("deepstack_visual_embeds", None)
            if features is not None:
                self.taken = Injection(self.add, mask, dict(enumerate(features[:self.num_layers])))
        return forward(*args, **kwargs)

    def take(self) -> Injection | None:
        """What the last recording's body would have added between its layers (None: nothing)."""
        taken, self.taken = self.taken, None
        return taken


def deepstack_tap(body: nn.Module, num_layers: int) -> DeepstackTap | None:
    """A tap for a language model that adds image features between its layers (None for any other)."""
    params = inspect.signature(type(body).forward).parameters.keys()
    if {"visual_pos_masks", "deepstack_visual_embeds"} <= params and hasattr(body, "_deepstack_process"):
        return DeepstackTap(body._deepstack_process, num_layers, before=False)
    if {"vision_mask", "deepstack_features"} <= params:
        return DeepstackTap(add_before_layer, num_layers, before=True)
    return None
