"""Bodies whose embedding and decoder layers sit in containers of their own, and heads with modules before the LM head.

An encoder family used as a decoder (BERT, RoBERTa, ELECTRA, ModernBERT's decoder, ...) keeps its input embedding
inside an embedding container (`bert.embeddings.word_embeddings`, beside position and token-type embeddings and a
norm) and its layers inside an encoder (`bert.encoder.layer`); its causal-LM class runs a prediction head (BERT's
`cls.predictions.transform`: dense, activation, norm) between the body's output and the LM head, whose bias is tied to
the head's own (`cls.predictions.decoder.bias` is `cls.predictions.bias`). Nothing here knows a family: the body is
the smallest module holding both the embedding and the layer list, and each module on the way down to the layers is
read (its forward's source, as `discovery._split_body` reads a flat body) for what it runs before the layers (they
join the embed unit, the embedding's container among them), after them (one final norm, the head unit's first
module; a pooler whose output the LM head never reads, frozen), and the causal-LM class's forward for the modules it
runs on the body's output (they join the head unit, under `between.`).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import textwrap
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cache
from typing import Any, TypeVar

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.utils import ModelOutput

from mt_ray.errors import ModelNotSupportedError
from mt_ray.models.packing_probe import same_arguments

T = TypeVar("T")

BETWEEN = "between"
"""The head unit's modules between the body's output and the LM head, under their paths in the causal LM."""
UNREAD = "unread"
"""The head unit's frozen modules the body runs after its layers and the LM head never reads (a pooler)."""


@dataclass(frozen=True)
class NestedBody:
    """Where a nested body keeps its parts, each path relative to `base`."""

    base: nn.Module
    layers_path: str
    pre: tuple[str, ...]
    """Parameterised modules run before the first layer (the embedding's container among them), in source order."""
    norm: str | None
    unread: tuple[str, ...]


def find_nested(skeleton: nn.Module, embed: nn.Module, config: PretrainedConfig) -> NestedBody | None:
    """The layout of a body whose embedding or layer list is nested in a container of it; None where the module that
    owns the embedding also holds the layer list (the flat layout `discovery` reads) or no single list is found."""
    n = getattr(config.get_text_config(), "num_hidden_layers", None)
    lists = [name for name, m in skeleton.named_modules() if isinstance(m, nn.ModuleList) and len(m) == n]
    embed_at = next(name for name, m in skeleton.named_modules() if m is embed)
    owner = embed_at.rpartition(".")[0]
    if len(lists) != 1 or lists[0].rpartition(".")[0] == owner:
        return None
    if getattr(config, "attention_type", None) == "block_sparse":
        raise ModelNotSupportedError(
            f"'{config.model_type}' uses block-sparse attention (attention_type='block_sparse': random blocks, the row "
            "padded to the block size, both ways), which mt-ray does not replay on packed rows; set "
            "attention_type='original_full' to train it causal; this family cannot be trained yet")
    base_path = _common_parent(lists[0], embed_at)
    base = skeleton.get_submodule(base_path)
    layers_path = _relative(lists[0], base_path)
    pre, after = _around_layers(base, layers_path, _relative(embed_at, base_path))
    norms = [p for p in after if _is_norm(base.get_submodule(p))]
    if len(norms) > 1:
        raise ModelNotSupportedError(
            f"'{config.model_type}' runs several norms after its decoder layers ({norms}), where mt-ray streams one "
            "final norm with the LM head; this family cannot be trained yet")
    return NestedBody(base, layers_path, tuple(pre), norms[0] if norms else None,
                      tuple(p for p in after if p not in norms))


def _common_parent(a: str, b: str) -> str:
    """The deepest module path holding both `a` and `b` (neither of them)."""
    common = []
    for x, y in zip(a.split(".")[:-1], b.split(".")[:-1], strict=False):
        if x != y:
            break
        common.append(x)
    return ".".join(common)


def _relative(path: str, base_path: str) -> str:
    return path[len(base_path) + 1:] if base_path else path


def _around_layers(base: nn.Module, layers_path: str, embed_path: str) -> tuple[list[str], list[str]]:
    """The parameterised modules of each container on the way down to the layer list, split by where its forward
    first calls them against the next step down: before (pre-layer) or after. The embedding's container runs before;
    the embedding itself is none of them (it is the embed unit's own)."""
    before, after = [], []
    module, prefix = base, ""
    for step in layers_path.split("."):
        source = inspect.getsource(type(module).forward)
        step_at = _used_at(source, step)
        for name, child in module.named_children():
            path = prefix + name
            if name == step or path == embed_path or not any(True for _ in child.parameters()):
                continue
            at = _used_at(source, name)
            early = embed_path.startswith(f"{path}.") or step_at is not None and at is not None and at < step_at
            (before if early else after).append(path)
        module, prefix = module.get_submodule(step), f"{prefix}{step}."
    return before, after


def _used_at(source: str, attr: str) -> int | None:
    """Where `source` first calls `self.<attr>` (XMOD's body reads `self.encoder.layer[0]` before it runs its
    embeddings), else first names it (a layer list is iterated, not called); None where it never does."""
    found = re.search(rf"self\.{re.escape(attr)}\(", source) or re.search(rf"self\.{re.escape(attr)}\b", source)
    return found.start() if found else None


def _is_norm(module: nn.Module) -> bool:
    """A norm by its class, as `discovery._is_norm` reads one (kept apart: discovery builds on this module)."""
    return "norm" in type(module).__name__.lower() and not isinstance(module, nn.Embedding)


def between_modules(skeleton: nn.Module, body: nn.Module, head: nn.Module) -> tuple[str, ...]:
    """The causal LM's children that run on the body's output into the LM head, holding parameters beyond the LM
    head's: the one holding the LM head (BERT's `cls`, RoBERTa's `lm_head` container) or one called in the statement
    that calls it (ModernBERT's `self.decoder(self.lm_head(...))`). One whose output the logits never read (Gemma 4's
    assistant's `post_projection`) is none of them."""
    own = {id(p) for p in head.parameters()}
    holder = next((n for n, c in skeleton.named_children() if any(m is head for m in c.modules())), None)
    if holder is None or all(c is not body for c in skeleton.children()):
        return ()
    beside = _called_with(type(skeleton).forward, holder)
    return tuple(name for name, child in skeleton.named_children()
                 if child is not body and (name == holder or name in beside)
                 and any(id(p) not in own for p in child.parameters()))


def _called_with(forward: Callable[..., Any], attr: str) -> set[str]:
    """The `self.<name>`s that `forward` names in a statement that names `self.<attr>`."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    found: set[str] = set()
    for stmt in ast.walk(tree):
        if not isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Expr, ast.Return)):
            continue
        named = {n.attr for n in ast.walk(stmt) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                 and n.value.id == "self"}
        if attr in named:
            found |= named
    return found


def attach(root: nn.Module, path: str, module: nn.Module) -> None:
    """Put `module` at dotted `path` under `root`, with plain containers on the way (so names bind through it)."""
    *parents, leaf = path.split(".")
    for part in parents:
        if part not in root._modules:
            root._modules[part] = nn.Module()
        root = root._modules[part]
    root._modules[leaf] = module


def tree(root: nn.Module, paths: Iterable[str]) -> nn.Module:
    """A container holding `root`'s modules at `paths`, at those paths."""
    out = nn.Module()
    for path in paths:
        attach(out, path, root.get_submodule(path))
    return out


def shared_ties(skeleton: nn.Module, modules: Iterable[str]) -> set[str]:
    """The tie targets whose target and source both lie under `modules` (one unit's paths): BERT's
    `cls.predictions.decoder.bias`, which is `cls.predictions.bias`. The unit holds the tensor once."""
    tied = getattr(skeleton, "all_tied_weights_keys", None) or {}
    prefixes = tuple(f"{m}." for m in modules)
    return {t for t, s in tied.items() if t.startswith(prefixes) and s.startswith(prefixes)}


def canonical(skeleton: nn.Module, name: str) -> str:
    """The name `save_pretrained` stores a tensor under: the source of the tie that `name` is the target of."""
    return (getattr(skeleton, "all_tied_weights_keys", None) or {}).get(name, name)


def one_entry_each(skeleton: nn.Module, params: list[T], elsewhere: set[str]) -> list[T]:
    """A unit's entries (`discovery.ParamInfo`), each tensor once: under the name `save_pretrained` stores it (a tie's
    source), with the local name met first (the embedding's own, not its container's; the LM head's, which its forward
    reads, not the prediction head's); none that another unit holds (`elsewhere`: the tied embedding matrix, which
    BERT's `cls` also reaches)."""
    out, seen = [], set(elsewhere)
    for p in params:
        name = canonical(skeleton, p.hf_name)
        if name not in seen:
            seen.add(name)
            out.append(dataclasses.replace(p, hf_name=name))
    return out


def is_nested(skeleton: nn.Module, base: nn.Module, layers_attr: str) -> bool:
    """Whether the body `base` keeps its embedding or its layer list (at `layers_attr`) in a container (`find_nested`
    read it)."""
    embed = skeleton.get_input_embeddings()
    return "." in layers_attr or all(c is not embed for c in base.children())


def numbers_own_positions(record: Callable[..., tuple[torch.Tensor, list[dict]]], hidden: int,
                          device: torch.device) -> bool:
    """Whether the body, given no position ids, numbers a document's tokens otherwise than 0, 1, ... (RoBERTa counts
    from its padding token): the first layer's input or any layer's arguments differ from those with position ids
    (bar the position ids themselves, handed on as they came). transformers' model, called on a document, numbers it
    so: the engine then records each document alone, without position ids."""
    embeds = torch.zeros(1, 4, hidden, device=device)
    ids = torch.full((1, 4), 3, dtype=torch.long, device=device)
    positions = torch.arange(4, device=device)[None]
    h_given, given = record(embeds, ids, positions)
    h_own, own = record(embeds, ids, None)
    handed_on = [{k for k, v in kw.items() if v is positions} for kw in given]
    given, own = ([{k: v for k, v in kw.items() if k not in keys} for kw, keys in zip(side, handed_on, strict=True)]
                  for side in (given, own))
    return not (torch.equal(h_given, h_own) and same_arguments(given, own, 4))


def check_hands_back(model_type: str, out: Any, last: torch.Tensor) -> None:
    """Refuse a body whose output is not its last layer's (through its final norm): it changes the hidden state after
    its layers (CPM-Ant drops its prompt's tokens), which the head unit does not replay."""
    first = out[0] if isinstance(out, (tuple, list, ModelOutput)) else out
    while isinstance(first, (tuple, list)):  # the stand-ins' tuples, passed on as they are (as a layer's would be)
        first = first[0]
    if first is not last:
        raise ModelNotSupportedError(
            f"'{model_type}': its body changes the hidden state after its last decoder layer (beyond one final norm), "
            "which mt-ray does not replay before the LM head; this family cannot be trained yet")


def head_extras(skeleton: nn.Module, base: nn.Module, between: tuple[str, ...],
                unread: tuple[str, ...]) -> dict[str, nn.Module]:
    """The head unit's modules beyond its final norm and LM head, by their names' first part (`between.`: paths in
    the causal LM `skeleton`; `unread.`: paths in the body `base`), each a container holding them at their paths, so
    the unit's names bind through it."""
    out = {}
    if between:
        out[BETWEEN] = tree(skeleton, between)
    if unread:
        out[UNREAD] = tree(base, unread)
    return out


def shallow_copy(module: nn.Module) -> nn.Module:
    """A new module object sharing `module`'s attributes and children, whose children can be swapped."""
    clone = module.__class__.__new__(module.__class__)
    clone.__dict__ = dict(module.__dict__)
    clone._modules = dict(module._modules)
    clone._parameters = dict(module._parameters)
    clone._buffers = dict(module._buffers)
    return clone


def with_submodule(root: nn.Module, path: str, module: nn.Module) -> nn.Module:
    """A shallow copy of `root` whose submodule at dotted `path` is `module` (root is untouched)."""
    head, _, rest = path.partition(".")
    clone = shallow_copy(root)
    clone._modules[head] = with_submodule(root._modules[head], rest, module) if rest else module
    return clone


def with_submodules(root: nn.Module, modules: dict[str, nn.Module]) -> nn.Module:
    """A shallow copy of `root` with each module of `modules` at its dotted path (root is untouched)."""
    for path, module in modules.items():
        root = with_submodule(root, path, module)
    return root


def reads_device(module: nn.Module, device: torch.device) -> nn.Module:
    """`module` (a shallow copy of a model with weightless parameters), its `device` the engine's: a body that moves
    its embeddings to `self.device` (Idefics3's) would otherwise move them to the meta device."""
    cls = type(module)
    if isinstance(getattr(cls, "device", None), property):
        module.__class__ = _on_device(cls)
        module.__dict__["_engine_device"] = device
    return module


@cache
def _on_device(cls: type[nn.Module]) -> type[nn.Module]:
    return type(cls.__name__, (cls,), {"device": property(lambda self: self.__dict__["_engine_device"])})
