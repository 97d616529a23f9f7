"""A widened residual stream between the layers, and the chain of modules that collapses it after them.

Hyper-connection bodies (DeepSeek-V4, Qwen4-Exp) widen the hidden state before their first layer into several
copies of the residual stream (`[B, T, n, D]` or `[B, T, n*D]`), which travels from layer to layer, and collapse it
after the last (`self.norm(self.hc_head(hidden_states))`). The widening runs in the body before its layers (the
layer context's recording hands it to layer 0 as it is); the stream travels between units as the hidden state,
token-major; the collapse is a chain of the body's own modules, which join the head unit and run on each selected
token's stream before the final norm. A tail that is more than such a chain (Gemma 3n's AltUp unembedding, with
magnitudes of its own) is refused by the caller.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable

import torch
from torch import nn

from mt_ray.errors import ModelNotSupportedError


def tail_chain(body: nn.Module, layers_attr: str) -> list[str] | None:
    """The children the body's forward applies to the hidden state after its layer loop, first applied first, where
    everything after that loop is `h = self.a(self.b(h))` assignments and the return; None where it does more."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(type(body).forward)))
    statements = tree.body[0].body
    loops = [i for i, s in enumerate(statements) if isinstance(s, ast.For) and _names_self(s.iter, layers_attr)]
    if len(loops) != 1:
        return None
    hidden = _loop_hidden(statements[loops[0]])
    chain: list[str] = []
    for statement in statements[loops[0] + 1:]:
        if isinstance(statement, ast.Return):
            return chain
        applied = _applied(statement, hidden)
        if applied is None:
            return None
        chain += applied
    return None


def split_tail(body: nn.Module, layers_attr: str, after: list[str], is_norm: Callable[[nn.Module], bool],
               model_type: str) -> tuple[str | None, tuple[str, ...]]:
    """The final norm (None where the chain ends otherwise) and the modules before it that the body applies after its
    layers, whose parameterised children are `after`; refused where its tail does more than a chain of them."""
    chain = tail_chain(body, layers_attr) or []
    if not chain or not set(after) <= set(chain):
        raise ModelNotSupportedError(
            f"'{model_type}' has parameterised modules beside its embedding, decoder layers and one final norm "
            f"({type(body).__name__}: {sorted(after)}) that its body runs after the layers with code of its own, not "
            "as a chain of modules applied to the last layer's output (`h = self.norm(self.head(h))`), which mt-ray "
            "does not stream; this family cannot be trained yet"
        )
    norm = chain[-1] if is_norm(getattr(body, chain[-1])) else None
    return norm, tuple(chain[:-1] if norm else chain)


def token_numel(h0: torch.Tensor, tokens: tuple[int, int], model_type: str) -> int:
    """The per-token size of the stream the body hands its first layer (`h0` of a [1, 2]-token probe row): D, or
    n*D for a widened one; refused where the stream is not laid out token-major."""
    if tuple(h0.shape[:2]) != tokens:
        raise ModelNotSupportedError(
            f"'{model_type}': the hidden state its body hands the first decoder layer is {tuple(h0.shape)} for a row of "
            f"{tokens[1]} tokens: its first dimensions are not the batch and the tokens (a widened residual stream laid "
            "out copy-major), which mt-ray does not stream; this family cannot be trained yet")
    return h0[0, 0].numel()


def _names_self(node: ast.AST, attr: str) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == attr and isinstance(n.value, ast.Name) and n.value.id == "self"
               for n in ast.walk(node))


def _loop_hidden(loop: ast.For) -> str | None:
    """The name the loop assigns each layer's output to (the first of a tuple it unpacks)."""
    for statement in loop.body:
        if isinstance(statement, ast.Assign) and isinstance(statement.value, ast.Call):
            target = statement.targets[0]
            target = target.elts[0] if isinstance(target, ast.Tuple) else target
            if isinstance(target, ast.Name):
                return target.id
    return None


def _applied(statement: ast.stmt, hidden: str | None) -> list[str] | None:
    """The children `hidden = self.a(self.b(hidden))` applies, `b` first; None for any other statement."""
    if not (isinstance(statement, ast.Assign) and len(statement.targets) == 1
            and isinstance(statement.targets[0], ast.Name) and statement.targets[0].id == hidden):
        return None
    chain, node = [], statement.value
    while isinstance(node, ast.Call) and len(node.args) == 1 and not node.keywords:
        func = node.func
        if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self"):
            return None
        chain.append(func.attr)
        node = node.args[0]
    return chain[::-1] if chain and isinstance(node, ast.Name) and node.id == hidden else None
