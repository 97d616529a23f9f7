"""Where a mixture of experts' layer time goes: the routed experts (token permutation included: transformers runs it
inside the experts module), the router, and attention, forward (with the recompute) and backward, for one step.

Hooks on the engine's layer templates mark each module's start and end: CUDA events on a GPU (read once the step
has synchronised), the clock on the CPU (a smoke run of the bench). The backward's marks are gradient hooks on the
module's output (its backward starts when that gradient is ready) and on its first input that needs one (it ends when
that input's gradient is complete): positional or keyword inputs alike. An input another module also reads (a MoE
block's tokens go to the router too) ends the span after both.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch
from torch import nn

from mt_ray.models.experts import expert_banks


def categorised_modules(engine) -> dict[str, list[nn.Module]]:
    """The layer templates' routed banks ('experts'), routers ('router': a module with `top_k` and no bank inside)
    and attention blocks ('attention': a layer child whose class name ends in 'Attention')."""
    spec, out = engine.spec, defaultdict(list)
    for kind in spec.layer_kinds:
        layer = engine.templates[kind].module
        banks = [b.path for b in expert_banks(layer, spec.text_config)]
        for path in banks:
            out["experts"].append(layer.get_submodule(path))
        for path, module in layer.named_modules():
            holds_bank = any(b == path or b.startswith(f"{path}.") or not path for b in banks)
            if isinstance(getattr(module, "top_k", None), int) and not holds_bank:
                out["router"].append(module)
        out["attention"] += [m for _, m in layer.named_children() if type(m).__name__.endswith("Attention")]
    return dict(out)


def _first_grad_tensor(values) -> torch.Tensor | None:
    return next((v for v in values if isinstance(v, torch.Tensor) and v.requires_grad), None)


class ModuleTimes:
    """Seconds each category of module spends per step, forward and backward, while `active`."""

    def __init__(self, engine):
        self.cuda = engine.device.type == "cuda"
        self.active = False
        self.spans: dict[str, list[tuple[object, object]]] = defaultdict(list)
        self._open: dict[tuple[int, str], object] = {}
        self._handles = []
        for category, modules in categorised_modules(engine).items():
            for m in modules:
                self._hook(m, category)

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()  # on the stream the layer computes on: read after the step synchronises
        return event

    def _hook(self, module: nn.Module, category: str) -> None:
        def before(_module, args, kwargs):
            if self.active:
                self._open[(id(module), "forward")] = self._mark()
                self._open[(id(module), "input")] = _first_grad_tensor((*args, *kwargs.values()))

        def after(_module, args, kwargs, output):
            begun = self._open.pop((id(module), "forward"), None)
            inp = self._open.pop((id(module), "input"), None)
            if not self.active or begun is None:
                return
            self.spans[f"{category}_forward_s"].append((begun, self._mark()))
            out = _first_grad_tensor(output if isinstance(output, tuple) else (output,))
            if out is not None and inp is not None:  # under autograd: time the module's backward too
                marks = []
                out.register_hook(lambda g: marks.append(self._mark()))
                inp.register_hook(lambda g: self.spans[f"{category}_backward_s"].append((marks.pop(), self._mark()))
                                  if marks else None)

        self._handles += [module.register_forward_pre_hook(before, with_kwargs=True),
                          module.register_forward_hook(after, with_kwargs=True)]

    def seconds(self, steps: int) -> dict[str, float]:
        """Each category's seconds a step over the `steps` timed (call after synchronising)."""
        def elapsed(a, b) -> float:
            return a.elapsed_time(b) / 1e3 if self.cuda else b - a

        return {k: sum(elapsed(a, b) for a, b in v) / steps for k, v in sorted(self.spans.items())}

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
