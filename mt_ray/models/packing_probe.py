"""Probe: does the second document of a packed row reach every decoder layer as it would alone?

The engine trains packed rows as one sequence and relies on the body's own layer arguments (masks built
from the position ids, rotary tables of the position ids) to keep the documents apart. A body that
derives anything else from where a token sits in the row (Llama 4's chunked attention, aligned to the
row rather than to each document) would let one document change another without a word. So, once per
engine, the body is recorded on the row [A, B] and on B alone, and every layer's arguments for B are
compared: B's rows of the attention mask (B's block equal, every key of A blocked) and B's slice of
every per-token tensor, and so is the hidden state entering the first layer (GPT-2's learned positions, or a
body that numbers the row rather than reading the position ids, as BART's decoder does). Any difference, and the documents of a packed row run through the layers one
at a time, which is exactly what they compute unpacked.

Document A is longer than any chunk or window the config names, so position thresholds show.
Shape key: T tokens of the probe row (A then B), b tokens of B.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from transformers import PretrainedConfig

from mt_ray.models.handoff import Handoff

Recorder = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, list[dict[str, Any]]]]

_B = 3  # tokens of document B
_MAX_A = 16384  # longest document A: a mask of the probe row stays a few hundred MB
# Arguments that say where the row sits in a KV cache, which the engine never uses.
_CACHE_ONLY = frozenset({"cache_position", "use_cache"})


def probe_length(config: PretrainedConfig, learned_positions: bool = False) -> int:
    """Length of document A: past every chunk and window size in the (text) config, and, where the body looks
    positions up in a learned table (`learned_positions`), within the table with B after it."""
    text = config.get_text_config()
    sizes = [v for k, v in vars(text).items()
             if isinstance(v, int) and not isinstance(v, bool) and ("chunk" in k or "window" in k)]
    longest = _MAX_A
    if learned_positions and getattr(text, "max_position_embeddings", None):
        longest = text.max_position_embeddings - _B
    return max(2, min(max([2, *(s + 2 for s in sizes)]), longest))


def packed_differs(record: Recorder, config: PretrainedConfig, hidden: int, device: torch.device,
                   rope_axes: int, masks: bool, learned_positions: bool = False) -> str | None:
    """Where layer arguments of B packed after A differ from B's alone (None where none do).

    `record(embeds, input_ids, position_ids)` returns the hidden state entering layer 0 and each layer's
    recorded arguments; `rope_axes` > 0
    gives positions of that many rotary axes ([axes, 1, T]); `masks` is False where the backend keeps
    documents apart from their bounds (no mask is built); `learned_positions` keeps the probe row within a learned
    position table."""
    a = probe_length(config, learned_positions)
    h0_packed, packed = _record_row(record, [a, _B], hidden, device, rope_axes)
    h0_alone, alone = _record_row(record, [_B], hidden, device, rope_axes)
    if not _same(h0_packed, h0_alone, a):
        return "the hidden state entering layer 0"
    for i, (kp, ka) in enumerate(zip(packed, alone, strict=True)):
        for name in kp.keys() - _CACHE_ONLY:
            if name == "attention_mask":
                same = not masks or _mask_same(kp[name], ka.get(name), a)
            else:
                same = _same(kp[name], ka.get(name), a)
            if not same:
                return f"layer {i}'s `{name}`"
    return None


def same_arguments(p: list[dict[str, Any]], q: list[dict[str, Any]], T: int) -> bool:
    """Two recordings of one T-token row give every layer the same arguments: masks that let the same queries see
    the same keys (whatever their form), other tensors equal, other values alike."""
    def same(name: str, x: Any, y: Any) -> bool:
        if name == "attention_mask":
            return torch.equal(_allowed(x, T, range(T)), _allowed(y, T, range(T)))
        return _same(x, y, 0)
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


def _same(p: Any, q: Any, a: int) -> bool:
    """B's part of `p` (packed) equals `q` (alone): per-token tensors compare their last b tokens."""
    if isinstance(p, (tuple, list)):
        return isinstance(q, (tuple, list)) and len(p) == len(q) and all(_same(x, y, a) for x, y in zip(p, q, strict=True))
    if isinstance(p, Mapping):  # a UserDict too (Gemma 4's `shared_kv_states`, which its layers fill)
        return isinstance(q, Mapping) and p.keys() == q.keys() and all(_same(p[k], q[k], a) for k in p)
    if not isinstance(p, torch.Tensor) or not isinstance(q, torch.Tensor):
        return p is q or type(p) is type(q) and _plain(p) and p == q
    if p.shape != q.shape:
        dims = [d for d in range(p.dim()) if p.shape[d] == a + _B and q.shape[d] == _B]
        if len(dims) != 1 or p.dim() != q.dim():
            return False
        p = p.narrow(dims[0], a, _B)
    return p.shape == q.shape and bool(torch.equal(p, q))


def _plain(v: Any) -> bool:
    return isinstance(v, (bool, int, float, str, type(None), Handoff))  # a marker of what an earlier layer returns


def _mask_same(p: Any, q: Any, a: int) -> bool:
    """B's queries in the packed mask see no key of A and B's keys as B's mask alone lets them.

    A mask of another convention (MPT's, True where blocked) shows as a token not seeing itself: it
    cannot be read, so it counts as differing."""
    packed = _allowed(p, a + _B, range(a, a + _B))
    alone = _allowed(q, _B, range(_B))
    readable = bool(alone.diagonal().all())
    return readable and not packed[:, :a].any() and torch.equal(packed[:, a:], alone)


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
