"""Children a module calls only to build its attention mask: no gradient reaches their parameters.

Qwen4-Exp's sparse attention asks its indexer which keys each query may see and folds the answer into the mask
(`attention_mask = attention_mask + selected_token_mask`): a hard selection, through which transformers computes no
gradient, so torch's optimizer leaves the indexer's weights untouched. Such parameters are frozen entries of their
unit (`discovery._params`), read from the forward's source: a child whose result is used only in assignments to
`attention_mask`.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable
from functools import cache

from torch import nn

_MASK = "attention_mask"


@cache
def mask_only_children(cls: type) -> frozenset[str]:
    """The attributes `cls.forward` calls (`m = self.x(...)`) only to fold the result `m` into the attention mask."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):  # a builtin or generated forward: nothing to read
        return frozenset()
    calls = {}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Call) and _self_attr(node.value.func) is not None):
            calls[node.targets[0].id] = _self_attr(node.value.func)
    return frozenset(attr for name, attr in calls.items() if name != _MASK and _only_into_mask(tree, name))


def selects_keys(layers: nn.Module, runs_without_grad: Callable[[nn.Module], bool]) -> bool:
    """Whether a layer holds a parameterised child that no gradient reaches (a forward under `torch.no_grad`, as
    DeepSeek-V3.2's indexer, or an output that only builds the mask): a sparse-attention indexer choosing each
    query's keys by top-k over the row, which in a packed row would let one document's keys crowd out another's.
    Its documents run alone (measured: DeepSeek-V3.2 and GLM-MoE-DSA differ packed once the top-k is shorter than
    a document)."""
    for module in layers.modules():
        children = [getattr(module, a, None) for a in mask_only_children(type(module))]
        if runs_without_grad(module) and any(True for _ in module.parameters()):
            return True
        if any(isinstance(c, nn.Module) and any(True for _ in c.parameters()) for c in children):
            return True
    return False


def _only_into_mask(tree: ast.AST, name: str) -> bool:
    """Whether every read of `name` lies in an assignment to the attention mask (and there is one)."""
    reads = {id(n) for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)}
    into_mask = {id(n) for a in ast.walk(tree)
                 if isinstance(a, ast.Assign) and [_name(t) for t in a.targets] == [_MASK]
                 for n in ast.walk(a.value) if isinstance(n, ast.Name) and n.id == name}
    return bool(reads) and reads <= into_mask


def _self_attr(node: ast.AST) -> str | None:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


def _name(node: ast.AST) -> str | None:
    return node.id if isinstance(node, ast.Name) else None
