"""State a decoder layer leaves for later layers outside the hidden state, and its gradient.

Gemma 3n and Gemma 4 share keys and values across layers: the body hands every layer one mapping
(`shared_kv_states`); the last layer of each attention type before the KV-shared ones stores its keys and
values there, and the shared layers attend with them. The engine runs each layer's backward alone, so the
gradient a reader sends into the writer's keys would be lost. So each recording's mapping becomes a
`SideChannel`: while a layer runs with autograd, what it reads comes as detached leaves; the reader's
backward finds their gradients, summed per key; the writer's backward takes them as the gradients of what it
stored. Readers come after their writer, so their backward (last layer first) always comes before its.
"""

from __future__ import annotations

from collections import UserDict
from collections.abc import Hashable, MutableMapping
from typing import Any

import torch

Tensors = tuple[torch.Tensor, ...]


class SideChannel(UserDict):
    """A mapping layers write to and read from (see the module docstring); `layer` is the one now running."""

    def __init__(self) -> None:
        self.layer = -1
        self.writes: dict[int, dict[Hashable, Tensors]] = {}
        """What each layer stored while running with autograd (its recompute), by key."""
        self.reads: dict[int, list[tuple[Hashable, Tensors]]] = {}
        """The leaves each layer read while running with autograd, by key."""
        self.pending: dict[Hashable, list[torch.Tensor]] = {}
        """The gradient the readers' backward found for each key's tensors, summed, waiting for the writer's."""
        super().__init__()

    def __setitem__(self, key: Hashable, value: Any) -> None:
        super().__setitem__(key, value)
        if torch.is_grad_enabled():
            self.writes.setdefault(self.layer, {})[key] = _tensors(value)

    def __getitem__(self, key: Hashable) -> Any:
        value = super().__getitem__(key)
        if not torch.is_grad_enabled():
            return value
        leaves = tuple(t.detach().requires_grad_() for t in _tensors(value))
        self.reads.setdefault(self.layer, []).append((key, leaves))
        return leaves if isinstance(value, (tuple, list)) else leaves[0]


def backward_terms(channels: list[SideChannel], i: int) -> tuple[list[torch.Tensor], list[torch.Tensor],
                                                                  list[torch.Tensor]]:
    """Layer i's part in its backward: the leaves it read (inputs that take a gradient), and what it stored that a
    later layer read, with that gradient (outputs and their gradients)."""
    read, stored, grads = [], [], []
    for channel in channels:
        read += [leaf for _, leaves in channel.reads.get(i, ()) for leaf in leaves]
        for key, tensors in channel.writes.pop(i, {}).items():
            if key in channel.pending:
                stored += tensors
                grads += channel.pending.pop(key)
    return read, stored, grads


def take_grads(channels: list[SideChannel], i: int, grads: list[torch.Tensor]) -> None:
    """The gradients layer i's backward found for the leaves it read (`backward_terms`' order), summed per key."""
    at = 0
    for channel in channels:
        for key, leaves in channel.reads.pop(i, ()):
            found = list(grads[at:at + len(leaves)])
            at += len(leaves)
            summed = channel.pending.get(key)
            channel.pending[key] = found if summed is None else [s + g for s, g in zip(summed, found, strict=True)]


def open_side_channels(per_layer: list[dict[str, Any]]) -> None:
    """Replace (in place) every empty mapping the body hands more than one layer, which only the layers can fill,
    by one `SideChannel`."""
    seen: set[int] = set()
    shared: dict[int, SideChannel] = {}
    for kw in per_layer:
        for value in kw.values():
            if isinstance(value, MutableMapping) and not value and not isinstance(value, SideChannel):
                if id(value) in seen:
                    shared.setdefault(id(value), SideChannel())
                seen.add(id(value))
    for kw in per_layer:
        kw.update({k: shared[id(v)] for k, v in kw.items() if id(v) in shared})


def side_channels(per_layer: list[dict[str, Any]]) -> list[SideChannel]:
    """The side channels among the layers' arguments, each once."""
    return list({id(v): v for kw in per_layer for v in kw.values() if isinstance(v, SideChannel)}.values())


def _tensors(value: Any) -> Tensors:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)
