"""The MoE router's auxiliary (load-balancing) loss, as the family's causal-LM forward adds it.

With `output_router_logits` in the config, transformers' MoE causal LMs add
`router_aux_loss_coef * load_balancing_loss_func(router_logits of every MoE layer, ...)` to the
loss. The engine never holds every layer at once, so the loss is taken apart: the router logits
each MoE layer produces are recorded (forward hooks on the router class that the family's own
`_can_record_outputs` names), the family's own `load_balancing_loss_func` runs on detached copies
once the forward pass is over, and its gradient with respect to each layer's logits is fed into
that layer's backward. That is the exact gradient of the family's loss, whatever its formula.

Held per micro-batch until its backward: one fp32 [tokens, experts] gradient per MoE layer.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

import torch
from torch import nn

from mt_ray.errors import ModelNotSupportedError
from mt_ray.models.discovery import ModelSpec


class RouterLoss:
    """Records router logits from the layer templates and turns them into the auxiliary loss."""

    def __init__(self, spec: ModelSpec, layer_modules: Iterable[nn.Module]):
        lm = spec.skeleton
        recorder = getattr(type(lm), "_can_record_outputs", {}).get("router_logits")
        loss_fn = getattr(sys.modules[type(lm).__module__], "load_balancing_loss_func", None)
        missing = [a for a in ("num_experts", "num_experts_per_tok", "router_aux_loss_coef") if not hasattr(lm, a)]
        if recorder is None or loss_fn is None or missing:
            raise ModelNotSupportedError(
                f"'{spec.config.model_type}' sets output_router_logits, but its transformers model has no router "
                "auxiliary loss the engine can reproduce; set output_router_logits: false in the model config"
            )
        self.loss_fn = loss_fn
        self.num_experts, self.top_k = lm.num_experts, lm.num_experts_per_tok
        self.coef = float(lm.router_aux_loss_coef)
        self._index = getattr(recorder, "index", 0)
        self._captured: list[torch.Tensor] = []
        target = getattr(recorder, "target_class", recorder)
        self._hooks = [m.register_forward_hook(self._capture)
                       for layer in layer_modules for m in layer.modules() if isinstance(m, target)]

    @staticmethod
    def wanted(spec: ModelSpec) -> bool:
        """Whether the config asks for the auxiliary loss (as transformers' forward decides it)."""
        return bool(getattr(spec.config, "output_router_logits", False))

    def close(self) -> None:
        """Take the hooks off the templates (the skeleton's own layer modules)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def _capture(self, module: nn.Module, args, output) -> None:
        self._captured.append(output[self._index] if isinstance(output, (tuple, list)) else output)

    def take(self) -> torch.Tensor | None:
        """Router logits [tokens, experts] recorded since the last call (one layer's, all documents)."""
        if not self._captured:
            return None
        logits = self._captured[0] if len(self._captured) == 1 else torch.cat(self._captured)
        self._captured.clear()
        return logits

    def gradients(self, logits: dict[int, torch.Tensor], weight: float) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The loss of one micro-batch from its MoE layers' logits, and the gradient of
        `coef * weight * loss` with respect to each layer's logits (the weight normalises over the step)."""
        leaves = [t.detach().float().requires_grad_() for t in logits.values()]
        with torch.enable_grad():
            loss = self.loss_fn(tuple(leaves), self.num_experts, self.top_k, None)
            grads = torch.autograd.grad(loss * (self.coef * weight), leaves)
        return loss.detach(), {i: g.to(t.dtype) for (i, t), g in zip(logits.items(), grads, strict=True)}
