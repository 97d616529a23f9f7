"""Probe: does the second document of a packed row reach every decoder layer as it would alone?

The engine trains packed rows as one sequence and relies on the body's own layer arguments (masks built
from the position ids, rotary tables of the position ids) to keep the documents apart. A body that
derives anything else from where a token sits in the row (Llama 4's chunked attention, aligned to the
row rather than to each document) would let one document change another without a word. So, once per
engine, the body is recorded on the row [A, B] and on B alone, and every layer's arguments for B are
compared: B's rows of the attention mask (B's block equal, every key of A blocked) and B's slice of
every per-token tensor, and so is the hidden state entering the first layer (GPT-2's learned positions, or a
body that numbers the row rather than reading the position ids, as BART's decoder does). Any difference, and the
documents of a packed row run through the layers one at a time, which is exactly what they compute unpacked.

The probe row is [A, B, C], longer than every position threshold the config names (`position_thresholds`: chunk
sizes, sliding windows, Llama 4's attention-temperature floor, a rope scaling's original context). B starts inside
the row's first chunk (A is 2 tokens) and runs past every threshold, so a chunk cut by the row's index, or a scale
switched by it, shows in B's arguments; C follows the long B, so what a long document changes for the whole row (a
rotary table of the row's longest positions) shows in C's. What a layer computes from the row's index itself
(Llama 4's attention temperature, from an arange of the row) is in no argument: `reads_row_index` finds it in the
layers' code, and their documents run alone too, as they do where a threshold is past the longest probe row
(`beyond_probe`).
Shape key: T tokens of the probe row; n tokens of the document compared.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from mt_ray.models.handoff import Handoff

Recorder = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, list[dict[str, Any]]]]

_A = 2  # tokens of document A: B starts inside the row's first chunk (2 is no multiple of a threshold above 2)
_C = 3  # tokens of document C, after the long B: what B's length changes for the row (a rotary table) shows in C's
_MAX_ROW = 32768  # longest probe row: its mask stays about a GB (the released Llama 4's thresholds are 8192)
# Config keys that name a position threshold: past it a chunk, window or attention scale changes (bar the counts of
# layers or chunks, and chunking that changes no result: feed-forward chunks, inference chunks).
_THRESHOLD_KEY = re.compile(r"chunk|window|floor_scale")
_NOT_THRESHOLD = re.compile(r"pattern|layers|feed_forward|lm_head|num_chunks|inference")
# Rope types whose tables follow the longest position of the row (transformers' `dynamic_rope_update`): past their
# original context a row's long document changes every document's table.
_ROW_ROPE = re.compile(r"dynamic|longrope")
# Arguments that say where the row sits in a KV cache, which the engine never uses (a layer that computes with
# the row's index is found in its code: `reads_row_index`).
_CACHE_ONLY = frozenset({"cache_position", "use_cache"})


def position_thresholds(config: PretrainedConfig) -> dict[str, int]:
    """Every position threshold the (text) config names, by its dotted key: chunk sizes, windows, Llama 4's
    `floor_scale` (nested dicts and per-layer lists included), and the context past which a row-length rope
    (`dynamic`, `longrope`) changes its table (`_row_rope_context`)."""
    text = config.get_text_config().to_dict()
    found: dict[str, int] = {}

    def walk(key: str, value: Any, named: bool) -> None:
        if isinstance(value, bool) or _NOT_THRESHOLD.search(key):
            return
        if isinstance(value, int) and named:
            found[key] = value
        elif isinstance(value, Mapping):
            rope_type = str(value.get("rope_type", value.get("type", "")))
            if _ROW_ROPE.search(rope_type):
                name, original = _row_rope_context(rope_type, value, text)
                if isinstance(original, int):
                    found[f"{key}.{name}"] = original
            for k, v in value.items():
                walk(f"{key}.{k}" if key else str(k), v, named or bool(_THRESHOLD_KEY.search(str(k))))
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{key}[{i}]", v, named)

    walk("", text, False)
    return found


def _row_rope_context(rope_type: str, rope: Mapping[str, Any], text: Mapping[str, Any]) -> tuple[str, Any]:
    """The key and length past which a row-length rope changes its table, as transformers reads it: `dynamic`
    scaling from `max_position_embeddings` alone (an `original_max_position_embeddings` beside it is not read),
    `longrope` from its original context (the rope's, else the config's, else `max_position_embeddings`)."""
    if "dynamic" in rope_type:
        return "max_position_embeddings", text.get("max_position_embeddings")
    return "original_max_position_embeddings", (rope.get("original_max_position_embeddings")
                                                or text.get("original_max_position_embeddings")
                                                or text.get("max_position_embeddings"))


def probe_lengths(config: PretrainedConfig, learned_positions: bool = False) -> tuple[int, int, int]:
    """Lengths of the probe row's documents A, B and C: B runs past every position threshold in the config (so the
    row does too), unless the row would leave a learned position table (`learned_positions`) or pass `_MAX_ROW`."""
    text = config.get_text_config()
    longest = _MAX_ROW
    if learned_positions and getattr(text, "max_position_embeddings", None):
        longest = min(longest, text.max_position_embeddings)
    b = max([_C, *(t + 1 for t in position_thresholds(config).values())])
    return _A, max(_C, min(b, longest - _A - _C)), _C


def beyond_probe(config: PretrainedConfig) -> str | None:
    """A position threshold past the longest probe row (`_MAX_ROW`), which the probe cannot show: its documents run
    alone (None where the probe covers every threshold)."""
    far = {k: v for k, v in position_thresholds(config).items() if v + 1 > _MAX_ROW - _A - _C}
    return next((f"its `{k}` ({v}) is longer than the packing probe's rows" for k, v in far.items()), None)


def packed_differs(record: Recorder, config: PretrainedConfig, hidden: int, device: torch.device,
                   rope_axes: int, masks: bool, learned_positions: bool = False) -> str | None:
    """Where layer arguments of B or C in the packed row [A, B, C] differ from theirs alone (None where none do).

    `record(embeds, input_ids, position_ids)` returns the hidden state entering layer 0 and each layer's
    recorded arguments; `rope_axes` > 0 gives positions of that many rotary axes ([axes, 1, T]); `masks` is False
    where the backend keeps documents apart from their bounds (no mask is built); `learned_positions` keeps the probe
    row within a learned position table."""
    lengths = probe_lengths(config, learned_positions)
    h0_packed, packed = _record_row(record, list(lengths), hidden, device, rope_axes)
    T = sum(lengths)
    for doc, (start, n) in (("B", (lengths[0], lengths[1])), ("C", (T - lengths[2], lengths[2]))):
        h0_alone, alone = _record_row(record, [n], hidden, device, rope_axes)
        at = (start, n, T)
        if not _same(h0_packed, h0_alone, at):
            return f"the hidden state entering layer 0 (document {doc})"
        for i, (kp, ka) in enumerate(zip(packed, alone, strict=True)):
            for name in kp.keys() - _CACHE_ONLY:
                if name == "attention_mask":
                    same = not masks or _mask_same(kp[name], ka.get(name), at)
                else:
                    same = _same(kp[name], ka.get(name), at)
                if not same:
                    return f"layer {i}'s `{name}` (document {doc})"
    return None


# A sequence length in a layer's code: a tensor's `.shape[i]` / `.size(i)` past its batch dimension, or a name that
# says so.
_LENGTH_NAME = re.compile(r"^(seq_?len(gth)?|q_?len|kv_?len|query_length|key_length|tgt_len|src_len)$")


def reads_row_index(layers: Iterable[nn.Module], given: Collection[str] = ()) -> str | None:
    """Where a decoder layer computes from the row's own index, which no recorded argument shows: an `arange` over
    the sequence length in the forward of a module in a layer (Llama 4's attention temperature), or
    `cache_position` read beyond handing it to a KV cache. None where no layer does. A packed row would give a
    document the row's index there, not its own: its documents must run alone. An arange under `if x is None:`
    where the body hands the layers `x` (`given`: MiniMax-M3's indexer positions) is a fallback that never runs."""
    seen: set[type] = set()
    for layer in layers:
        for module in layer.modules():
            cls = type(module)
            if cls in seen or cls.forward is nn.Module.forward:
                continue
            seen.add(cls)
            found = _row_index_in(cls, given)
            if found is not None:
                return found
    return None


def _row_index_in(cls: type[nn.Module], given: Collection[str] = ()) -> str | None:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):  # no source (a compiled module): nothing to read
        return None
    dead = {id(n) for branch in ast.walk(tree) if isinstance(branch, ast.If) and _unset(branch.test) in given
            for stmt in branch.body for n in ast.walk(stmt)}
    handed = {id(kw.value) for kw in ast.walk(tree) if isinstance(kw, ast.keyword) and kw.arg == "cache_position"}
    handed |= {id(v) for d in ast.walk(tree) if isinstance(d, ast.Dict)
               for k, v in zip(d.keys, d.values, strict=True)
               if isinstance(k, ast.Constant) and k.value == "cache_position"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _called(node) == "arange" and id(node) not in dead \
                and any(_length(a) for a in node.args):
            return f"{cls.__name__}.forward computes `{ast.unparse(node)}`"
        if isinstance(node, ast.Name) and node.id == "cache_position" and isinstance(node.ctx, ast.Load) \
                and id(node) not in handed:
            return f"{cls.__name__}.forward reads `cache_position`"
    return None


def _unset(test: ast.expr) -> str | None:
    """The name `test` checks for None (`x is None`)."""
    if isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and len(test.ops) == 1 \
            and isinstance(test.ops[0], ast.Is) and isinstance(test.comparators[0], ast.Constant) \
            and test.comparators[0].value is None:
        return test.left.id
    return None


def _called(call: ast.Call) -> str | None:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def _length(expr: ast.expr) -> bool:
    """Whether `expr` reads a sequence length (see `_LENGTH_NAME`)."""
    for node in ast.walk(expr):
        if isinstance(node, ast.Name) and _LENGTH_NAME.match(node.id):
            return True
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "shape" \
                and _past_batch(node.slice):
            return True
        if isinstance(node, ast.Call) and _called(node) == "size" and node.args and _past_batch(node.args[0]):
            return True
    return False


def _past_batch(index: ast.expr) -> bool:
    """An index other than 0 (the batch) and -1 (the features)."""
    try:
        value = ast.literal_eval(index)
    except ValueError:
        return False
    return isinstance(value, int) and value not in (0, -1)


def same_arguments(p: list[dict[str, Any]], q: list[dict[str, Any]], T: int) -> bool:
    """Two recordings of one T-token row give every layer the same arguments: masks that let the same queries see
    the same keys (whatever their form), other tensors equal, other values alike."""
    def same(name: str, x: Any, y: Any) -> bool:
        if name == "attention_mask":
            return torch.equal(_allowed(x, T, range(T)), _allowed(y, T, range(T)))
        return _same(x, y)
    return all(kp.keys() == kq.keys() and all(same(k, kp[k], kq[k]) for k in kp) for kp, kq in zip(p, q, strict=True))


def _record_row(record: Recorder, lengths: list[int], hidden: int, device: torch.device,
                rope_axes: int) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    T = sum(lengths)
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])[None]
    if rope_axes:
        positions = positions.expand(rope_axes, 1, T)  # text-only rows: every rotary axis follows the text position
    embeds = torch.zeros(1, T, hidden, device=device)
    ids = torch.zeros(1, T, dtype=torch.long, device=device)
    return record(embeds, ids, positions)


def _same(p: Any, q: Any, at: tuple[int, int, int] | None = None) -> bool:
    """A document's part of `p` (packed) equals `q` (alone): per-token tensors compare the n tokens from `start` of
    the T-token row (`at`: start, n, T; None: the whole of each)."""
    if isinstance(p, (tuple, list)):
        return isinstance(q, (tuple, list)) and len(p) == len(q) and all(
            _same(x, y, at) for x, y in zip(p, q, strict=True))
    if isinstance(p, Mapping):  # a UserDict too (Gemma 4's `shared_kv_states`, which its layers fill)
        return isinstance(q, Mapping) and p.keys() == q.keys() and all(_same(p[k], q[k], at) for k in p)
    if not isinstance(p, torch.Tensor) or not isinstance(q, torch.Tensor):
        return p is q or type(p) is type(q) and _plain(p) and p == q
    if p.shape != q.shape and at is not None:
        start, n, T = at
        dims = [d for d in range(p.dim()) if p.shape[d] == T and q.shape[d] == n]
        if len(dims) != 1 or p.dim() != q.dim():
            return False
        p = p.narrow(dims[0], start, n)
    return p.shape == q.shape and bool(torch.equal(p, q))


def _plain(v: Any) -> bool:
    return isinstance(v, (bool, int, float, str, type(None), Handoff))  # a marker of what an earlier layer returns


def _mask_same(p: Any, q: Any, at: tuple[int, int, int]) -> bool:
    """The document's queries in the packed mask see no key of another document and its own keys as its mask alone
    lets them.

    A mask of another convention (MPT's, True where blocked) shows as a token not seeing itself: it
    cannot be read, so it counts as differing."""
    start, n, T = at
    packed = _allowed(p, T, range(start, start + n))
    alone = _allowed(q, n, range(n))
    readable = bool(alone.diagonal().all())
    others = torch.cat([packed[:, :start], packed[:, start + n:]], dim=1)
    return readable and not others.any() and torch.equal(packed[:, start:start + n], alone)


def _allowed(mask: Any, T: int, queries: range) -> torch.Tensor:
    """[queries, T] booleans: may query q see key k (None: causal, as the backend then runs it)."""
    if mask is None:
        return torch.ones(T, T, dtype=torch.bool).tril()[queries.start:queries.stop]
    if hasattr(mask, "mask_mod"):  # flex attention's BlockMask: ask its mask function
        dev = mask.kv_indices.device
        zero = torch.tensor(0, device=dev)
        return torch.tensor([[bool(mask.mask_mod(zero, zero, torch.tensor(q, device=dev), torch.tensor(k, device=dev)))
                              for k in range(T)] for q in queries])
    m = mask[0, 0, queries.start - T:queries.stop - T or None, -T:].cpu()
    return m if m.dtype == torch.bool else m > torch.finfo(m.dtype).min / 2
