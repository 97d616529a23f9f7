"""A widened residual stream between the layers, and the body's own code that collapses it after them.

Hyper-connection bodies (DeepSeek-V4, Qwen4-Exp) widen the hidden state before their first layer into several copies
of the residual stream (`[B, T, n, D]`, `[B, T, n*D]`), and Gemma 3n into AltUp's predictions (`[n, B, T, D]`); the
stream travels from layer to layer and is collapsed after the last (`self.norm(self.hc_head(hidden_states))`, or
AltUp's unembedding). The widening runs in the body before its layers (the layer context's recording hands it to
layer 0 as it is). Between the units the stream travels token-major (`Stream.token_dim` says where the layers
have their batch and token dimensions). The body's statements after its layer loop are lifted out of its
forward's source into a function of the last layer's output (`TailCode`), which the head unit runs on each
selected token's stream with the body's own modules, bound to the head unit's weights. The names it reads from
earlier in the forward (`epsilon_tensor`, `hidden_states_0`) are taken from the forward's frame while the layer
context is recorded (`capture`); only values that do not depend on the tokens may be taken so: plain values,
0-dim tensors, and tensors the tail reads only for their dtype or device.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import math
import sys
import textwrap
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
from torch import nn

from mt_ray.errors import ModelNotSupportedError

_META_ONLY = frozenset({"dtype", "device"})
_NAME = "_mt_ray_tail"


@dataclass
class Stream:
    """The stream between the layers: where the layers have their batch and token dimensions (`token_dim`, `token_dim
    + 1`), its size per token, and the values the tail's code reads from the body's forward (`capture`)."""

    token_dim: int = 0
    token_shape: tuple[int, ...] = ()
    """Each token's part of the stream ([D], [n, D], [n*D])."""
    tail_values: dict[str, Any] = field(default_factory=dict)

    @property
    def numel(self) -> int:
        return math.prod(self.token_shape)

    def to_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """The layers' layout to token-major ([B, T, ...])."""
        return x.movedim((self.token_dim, self.token_dim + 1), (0, 1)) if self.token_dim else x

    def to_layers(self, x: torch.Tensor) -> torch.Tensor:
        return x.movedim((0, 1), (self.token_dim, self.token_dim + 1)).contiguous() if self.token_dim else x


class TailReached(Exception):  # noqa: N818 - a signal, not an error
    """Raised by the last layer's stand-in of a body with tail code: what follows is the head unit's."""


def measure(stream: Stream, h0: torch.Tensor, tokens: tuple[int, int], model_type: str) -> None:
    """Fill `stream`'s layout from `h0`, what the body hands its first layer for a `tokens` ([1, 2]) probe row."""
    at = [k for k in range(h0.dim() - 1) if tuple(h0.shape[k:k + 2]) == tokens]
    if not at:
        raise ModelNotSupportedError(
            f"'{model_type}': the hidden state its body hands the first decoder layer is {tuple(h0.shape)} for a row of "
            f"{tokens[1]} tokens, without adjacent batch and token dimensions, which mt-ray does not stream; this "
            "family cannot be trained yet")
    stream.token_dim = at[0]
    stream.token_shape = tuple(stream.to_tokens(h0).shape[2:])


def split_tail(body: nn.Module, layers_attr: str, after: list[str], model_type: str) -> TailCode:
    """The body's code after its layers, which must use every parameterised child found there (`after`)."""
    code = tail_code(body, layers_attr)
    unused = sorted(set(after) - (code.children if code is not None else set()))
    if code is None or unused:
        raise ModelNotSupportedError(
            f"'{model_type}' has parameterised modules beside its embedding, decoder layers and final norm "
            f"({type(body).__name__}: {unused or sorted(after)}) that mt-ray cannot place: its body does not apply "
            "them to the last layer's output after its one layer loop; this family cannot be trained yet"
        )
    return code


@dataclass(frozen=True)
class TailCode:
    """The statements after the layer loop as a function's source; `free`: the earlier names they read."""

    source: str
    free: tuple[str, ...]
    meta_only: frozenset[str]
    """Free names the tail reads only as `.dtype` / `.device`."""
    children: frozenset[str]
    """The body's attributes the tail names (`self.norm`, ...)."""

    def function(self, namespace: dict[str, Any]) -> Any:
        scope = dict(namespace)
        exec(compile(self.source, f"<tail of {namespace.get('__name__')}>", "exec"), scope)  # noqa: S102 - its own code
        return scope[_NAME]


def tail_code(body: nn.Module, layers_attr: str) -> TailCode | None:
    """The forward's statements after its one layer loop, returning what its output names `last_hidden_state`."""
    forward = inspect.unwrap(type(body).forward)
    tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    statements = tree.body[0].body
    loops = [i for i, s in enumerate(statements) if isinstance(s, ast.For) and _names_self(s.iter, layers_attr)]
    if len(loops) != 1 or not isinstance(statements[-1], ast.Return):
        return None
    hidden = _loop_target(statements[loops[0]])
    result = _last_hidden(statements[-1].value)
    tail = statements[loops[0] + 1:-1]
    if hidden is None or result is None:
        return None
    stored = {n.id for s in tail for n in ast.walk(s) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    known = set(vars(inspect.getmodule(forward))) | set(vars(builtins)) | {"self", hidden}
    read = [n.id for s in [*tail, ast.Return(result)] for n in ast.walk(s)
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)]
    free = tuple(dict.fromkeys(n for n in read if n not in stored | known))
    function = ast.FunctionDef(name=_NAME, args=_arguments(["self", hidden, *free]),
                               body=[*tail, ast.Return(result)], decorator_list=[], returns=None, type_params=[])
    source = ast.unparse(ast.fix_missing_locations(ast.Module(body=[function], type_ignores=[])))
    children = frozenset(a.attr for s in tail for a in ast.walk(s)
                         if isinstance(a, ast.Attribute) and isinstance(a.value, ast.Name) and a.value.id == "self")
    return TailCode(source, free, frozenset(n for n in free if _read_for_meta_only(tail, n)), children)


def capture(code: TailCode, forward: Any, values: dict[str, Any], model_type: str) -> None:
    """Put the free names' values in the body forward's running frame into `values` (called from inside its last
    layer's stand-in), then stop the body there (`TailReached`)."""
    frame = _frame_of(inspect.unwrap(forward).__code__)
    missing = [n for n in code.free if frame is None or n not in frame.f_locals]
    if missing:
        raise ModelNotSupportedError(
            f"'{model_type}': the code its body runs after its layers reads {missing}, which mt-ray did not find in its "
            "forward when its last layer ran; this family cannot be trained yet")
    for name in code.free:
        value = frame.f_locals[name]
        if isinstance(value, torch.Tensor) and name in code.meta_only:
            value = torch.empty(0, dtype=value.dtype, device=value.device)
        elif isinstance(value, torch.Tensor) and value.dim() > 0:
            raise ModelNotSupportedError(
                f"'{model_type}': the code its body runs after its layers reads `{name}`, a tensor computed before "
                "them, which mt-ray's head does not have; this family cannot be trained yet")
        values[name] = value
    raise TailReached


def _frame_of(code: Any) -> FrameType | None:
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not code:
        frame = frame.f_back
    return frame


def _read_for_meta_only(tail: list[ast.stmt], name: str) -> bool:
    """Whether every read of `name` in `tail` is `name.dtype` or `name.device`."""
    reads = [n for s in tail for n in ast.walk(s) if isinstance(n, ast.Name) and n.id == name]
    meta = {id(a.value) for s in tail for a in ast.walk(s)
            if isinstance(a, ast.Attribute) and a.attr in _META_ONLY and isinstance(a.value, ast.Name)}
    return all(id(n) in meta for n in reads)


def _names_self(node: ast.AST, attr: str) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == attr and isinstance(n.value, ast.Name) and n.value.id == "self"
               for n in ast.walk(node))


def _loop_target(loop: ast.For) -> str | None:
    for statement in loop.body:
        if isinstance(statement, ast.Assign) and isinstance(statement.value, ast.Call):
            target = statement.targets[0]
            target = target.elts[0] if isinstance(target, ast.Tuple) else target
            if isinstance(target, ast.Name):
                return target.id
    return None


def _last_hidden(value: ast.expr | None) -> ast.expr | None:
    """What the return names `last_hidden_state` (an output class's keyword)."""
    if isinstance(value, ast.Call):
        return next((k.value for k in value.keywords if k.arg == "last_hidden_state"), None)
    return None


def _arguments(names: list[str]) -> ast.arguments:
    return ast.arguments(posonlyargs=[], args=[ast.arg(arg=n) for n in names], vararg=None, kwonlyargs=[],
                         kw_defaults=[], kwarg=None, defaults=[])
