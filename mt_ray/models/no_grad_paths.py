"""Parameters a causal LM's training forward never gives a gradient, read from the module's own code: a forward
under `torch.no_grad`, and children a decoder layer runs only with an encoder's states (cross-attention). These
stay frozen, as transformers leaves them, instead of being handed to autograd and failing the step."""

from __future__ import annotations

import ast
import inspect
import textwrap
from functools import cache

import torch
from torch import nn


def runs_without_grad(module: nn.Module) -> bool:
    """Whether the module's forward is decorated with `torch.no_grad` (or inference mode): no gradient reaches
    its parameters. The decorator keeps the context's factory in its wrapper's closure."""
    cells = getattr(type(module).forward, "__closure__", None) or ()
    return any(isinstance(getattr(_cell(c), "__self__", None), (torch.no_grad, torch.inference_mode)) for c in cells)


@cache
def reached_with_encoder_only(cls: type) -> frozenset[str]:
    """The attributes `cls.forward` names only under `if encoder_hidden_states is not None:` (a decoder layer's
    cross-attention and its norm): a causal LM, which has no encoder, never runs them."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):  # a builtin or generated forward: nothing to read
        return frozenset()
    named: dict[bool, set[str]] = {True: set(), False: set()}

    def visit(node: ast.AST, guarded: bool) -> None:
        if isinstance(node, ast.If) and _needs_encoder(node.test):
            visit(node.test, guarded)
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, guarded)
            return
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            named[guarded].add(node.attr)
        for child in ast.iter_child_nodes(node):
            visit(child, guarded)

    visit(tree, False)
    return frozenset(named[True] - named[False])


def _needs_encoder(test: ast.expr) -> bool:
    """`encoder_hidden_states is not None`, alone or as one term of an `and`."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return any(_needs_encoder(v) for v in test.values)
    return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "encoder_hidden_states"
            and len(test.ops) == 1 and isinstance(test.ops[0], ast.IsNot)
            and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value is None)


def _cell(cell) -> object:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None
