"""Run the family's own `get_image_features` around the vision tower's blocks, as context.py does for the
decoder layers.

Whatever a tower computes before its blocks (patch embedding, window reordering, rotary tables,
attention lengths) and after them (merger, feature-layer selection, projector) is the family's code,
so it runs as transformers defines it: `get_image_features` of a shallow copy of the composite body
whose block list is replaced by stand-ins. They either *record* (block 0's input and each block's
arguments, then stop the call at the last block: nothing after the blocks is needed) or *replay*
(each hands back the output the engine computed for that block, so what follows the blocks runs on
the real outputs, with gradients reaching them).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import torch
from torch import nn
from transformers.utils import ModelOutput

from mt_ray.models.context import LayerKwargs, returns_tuple
from mt_ray.models.discovery import ModelSpec, meta_free_buffers_to
from mt_ray.models.nesting import reads_device, shallow_copy, with_submodule


class _Recorded(Exception):
    """Raised by the last block's stand-in while recording: the call has what it needs."""


@dataclass
class VisionTape:
    """One micro-batch's tower: block 0's input, each block's arguments and (once computed) outputs; in the
    backward, the gradients reaching each block's output and block 0's input."""

    h0: torch.Tensor | None = None
    args: list[tuple] = field(default_factory=list)  # positional arguments after the hidden state (SigLIP's mask)
    kwargs: list[LayerKwargs] = field(default_factory=list)
    outputs: list[torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    h0_grad: torch.Tensor | None = None

    def block_input(self, i: int) -> torch.Tensor:
        return self.h0 if i == 0 else self.outputs[i - 1]


class _BlockStandIn(nn.Module):
    """Stands in for vision block `index`: records its call, or hands back its computed output.

    Made an instance of the block's own class (`stand_in`): transformers collects a tower's hidden
    states with hooks on the modules of that class (LLaVA's feature layer reads them).
    """

    def __init__(self, index: int, runner: VisionRunner, template: nn.Module):
        nn.Module.__init__(self)  # not the block's constructor: the stand-in has no weights
        self.index = index
        self.runner = runner
        self.returns_tuple = returns_tuple(template) or _returns_tuple_literal(type(template))
        self.hidden_name = list(inspect.signature(type(template).forward).parameters)[1]  # after self

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # The hidden state comes first, or by name (Llama 4's tower hands its blocks `hidden_state=`).
        hidden_states, args = (args[0], args[1:]) if args else (kwargs.pop(self.hidden_name), ())
        if isinstance(hidden_states, tuple) and self.index and self.returns_tuple:
            # The tower hands the block before's output on as it is: its blocks return a tensor, whatever their
            # annotation says (GOT-OCR2's SAM blocks are annotated a tuple)
            hidden_states = hidden_states[0]
            for stand_in in self.runner.stand_ins:
                stand_in.returns_tuple = False
        tape = self.runner.tape
        if self.runner.replaying:
            out = tape.outputs[self.index]
        else:
            if self.index == 0:
                tape.h0 = hidden_states
            tape.args.append(args)
            tape.kwargs.append(kwargs)
            if self.index == self.runner.num_blocks - 1:
                raise _Recorded
            out = hidden_states
        return (out,) if self.returns_tuple else out


@cache
def _returns_tuple_literal(block_class: type[nn.Module]) -> bool:
    """A block whose forward names no return type yet returns a tuple it builds (Llama 4's `outputs = (hidden_state,)`,
    whose tower reads `layer_outputs[0]`)."""
    if inspect.signature(block_class.forward).return_annotation is not inspect.Signature.empty:
        return False
    tree = ast.parse(textwrap.dedent(inspect.getsource(block_class.forward)))
    tuples = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Tuple)
              for t in n.targets if isinstance(t, ast.Name)}
    returns = [n.value for n in ast.walk(tree) if isinstance(n, ast.Return) and n.value is not None]
    return bool(returns) and all(isinstance(r, ast.Tuple) or isinstance(r, ast.Name) and r.id in tuples
                                 for r in returns)


def _stand_in(block_class: type[nn.Module]) -> type[_BlockStandIn]:
    return type(f"StandIn{block_class.__name__}", (_BlockStandIn, block_class), {})


class VisionRunner:
    """The family's `get_image_features` with stand-ins for the tower's blocks.

    `module` is what the engine binds the `vision.embed` and `vision.projector` weights to (their
    names are relative to the composite body); calling it runs `get_image_features`.
    """

    def __init__(self, spec: ModelSpec, device: torch.device):
        vision = spec.vision
        self.num_blocks = len(vision.blocks)
        self.stand_ins = [_stand_in(type(b))(i, self, b) for i, b in enumerate(vision.blocks)]
        copy = shallow_copy(vision.outer) if vision.blocks_path is None else \
            with_submodule(vision.outer, vision.blocks_path, nn.ModuleList(self.stand_ins))
        self.module = reads_device(copy, device)
        self.module.forward = image_features_of(self.module)  # the copy's own, so it sees the stand-ins
        meta_free_buffers_to(self.module, device)
        self.tape = VisionTape()
        self.replaying = False

    def record(self, run: Callable[[], Any]) -> VisionTape:
        """Run `run` (a call of `module`) up to the last block; returns block 0's input and every block's arguments.
        Without blocks (no tower) nothing comes before them: `replay` runs the whole call."""
        if not self.num_blocks:
            return VisionTape()
        self.tape, self.replaying = VisionTape(), False
        try:
            run()
        except _Recorded:
            return self.tape
        finally:
            tape, self.tape = self.tape, VisionTape()
        raise RuntimeError(f"get_image_features called {len(tape.kwargs)} of {self.num_blocks} vision blocks")

    def replay(self, run: Callable[[], Any], outputs: list[torch.Tensor]) -> Any:
        """Run `run` with each block handing back `outputs[i]`; returns what `get_image_features` returns."""
        self.tape, self.replaying = VisionTape(outputs=outputs), True
        try:
            return _fielded(run())
        finally:
            self.tape, self.replaying = VisionTape(), False


def image_features_of(body: nn.Module) -> Callable[..., Any]:
    """`body.get_image_features`, with each argument it requires and the images do not give passed as None: as the
    body's forward passes its own (Llama 4's `vision_feature_select_strategy`, None unless its caller gives one)."""
    function = body.get_image_features
    unset = [n for n, p in inspect.signature(function).parameters.items()
             if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return lambda **images: function(**{**dict.fromkeys(unset), **images})


def _fielded(out: Any) -> Any:
    """`out`, where it is an output holding attributes beyond its fields (Idefics2 sets `pooler_output` on the tower's
    BaseModelOutput), as an output of a subclass with those fields: the engine takes its tensors apart and puts them
    back together (pytree), which keeps fields only."""
    if not isinstance(out, ModelOutput):
        return out
    fields = [f.name for f in dataclasses.fields(out)]
    extra = tuple(k for k in vars(out) if k not in fields and not k.startswith("_"))
    if not extra:
        return out
    return _with_fields(type(out), extra)(**{k: getattr(out, k) for k in (*fields, *extra)})


@cache
def _with_fields(base: type[ModelOutput], extra: tuple[str, ...]) -> type[ModelOutput]:
    return dataclasses.make_dataclass(base.__name__, [(name, Any, None) for name in extra], bases=(base,))
