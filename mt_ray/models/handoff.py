"""What a decoder layer returns beside its hidden state for a later layer (GLM-MoE-DSA's and HY-V4's top-k indices).

A body may hand what one layer returns beside the hidden state to a later one (`prev_topk_indices=topk_indices`:
layers that reuse the sparse-attention indexer's choice of keys). The recording's stand-ins return a `Handoff`
marker in its place, which shows in the later layer's arguments. The engine runs the layers in order, so at run
time each layer's returned value replaces the marker in the arguments of the layer it is handed to (`hand_on`),
where a recompute in backward finds it again. Only values that carry no gradient can travel so (indices, masks):
a floating-point value is refused, as its gradient would not reach the layer that computed it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mt_ray.errors import ModelNotSupportedError

Plan = dict[int, list[tuple[int, str, int]]]
"""Each giving layer's handoffs: (receiving layer, argument, position in the giving layer's output)."""


@dataclass(frozen=True)
class Handoff:
    """Stands for what layer `layer` returns at `position` of its output tuple."""

    layer: int
    position: int


def plan_handoffs(per_layer: list[dict[str, Any]]) -> Plan:
    """Where the layers' arguments hold markers, by the layer whose output fills them."""
    plan: Plan = {}
    for receiver, kw in enumerate(per_layer):
        for name, value in kw.items():
            if isinstance(value, Handoff):
                plan.setdefault(value.layer, []).append((receiver, name, value.position))
    return plan


def nested_handoff(value: Any) -> bool:
    """A marker inside a structure (a tuple of them): the engine would not find it to fill."""
    return isinstance(value, (tuple, list)) and any(isinstance(v, Handoff) or nested_handoff(v) for v in value)


def hand_on(plan: Plan, i: int, out: Any, per_layer: list[dict[str, Any]], model_type: str) -> Any:
    """Put what layer i returned (`out`) into the arguments of the layers it is handed to; returns `out`."""
    for receiver, name, position in plan.get(i, ()):
        value = out[position]
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            raise ModelNotSupportedError(
                f"'{model_type}': its body hands a floating-point value decoder layer {i} returns (`{name}`) to layer "
                f"{receiver}, whose gradient mt-ray would not send back; this family cannot be trained yet")
        per_layer[receiver][name] = value
    return out
