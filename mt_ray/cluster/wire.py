"""Tensors in and out of the Ray object store without copies on the reading side, and the gradient sum.

numpy has no bfloat16, so 16-bit tensors travel as their raw 16-bit words and are viewed
back as the right dtype on arrival. A numpy array read from the object store is a read-only
view of shared memory: the tensor made from it must only be read.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

_WORDS = {torch.bfloat16: torch.int16, torch.float16: torch.int16}


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a contiguous CPU tensor (no copy): what `ray.put` serialises."""
    words = _WORDS.get(t.dtype)
    t = t.detach()
    return (t.view(words) if words is not None else t).numpy()


def from_numpy(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of `dtype` viewing `a` (no copy). The caller never writes to it."""
    with warnings.catch_warnings():
        # Object-store arrays are read-only; torch warns that writing would be undefined.
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(a)
    return t.view(dtype) if t.dtype != dtype else t


# Elements summed at a time: every input's slice is added into one fp32 chunk that stays in
# cache, so a sum reads each input once and writes its result once (no full-size fp32 temporary).
SUM_CHUNK = 1 << 20


def sum_in_order(parts: list[torch.Tensor], out: torch.Tensor | None) -> torch.Tensor:
    """Sum gradients (flat, any dtype) into `out` (any dtype, and may be `parts[0]` itself); returns the fp32
    norm² of the sum (with `out` None, the norm² alone: of a lone gradient, read where it lies).

    The sum runs in fp32 over the parts in the order given (callers pass a fixed order, so the
    result does not depend on arrival order) and is rounded to `out`'s dtype once. The norm is
    that of the fp32 sum, as the single engine takes it before rounding.
    Intra-op threads are whatever the process set once at start (torch.set_num_threads is
    process-wide: setting it here would change the optimizer's too).
    """
    numel = parts[0].numel()
    norm_sq = torch.zeros((), dtype=torch.float64)
    acc = torch.empty(min(SUM_CHUNK, numel), dtype=torch.float32)
    # torch's add of a 16-bit tensor into an fp32 one takes its slow mixed-dtype path: each further part is cast
    # up into `upcast` first (the same fp32 values), then added fp32 to fp32
    upcast = torch.empty_like(acc) if any(v.dtype != torch.float32 for v in parts[1:]) else None
    for lo in range(0, numel, SUM_CHUNK):
        hi = min(lo + SUM_CHUNK, numel)
        chunk = acc[: hi - lo].copy_(parts[0][lo:hi])
        for v in parts[1:]:
            chunk.add_(v[lo:hi] if v.dtype == torch.float32 else upcast[: hi - lo].copy_(v[lo:hi]))
        norm_sq += torch.linalg.vector_norm(chunk).square()
        if out is not None:
            out[lo:hi].copy_(chunk)
    return norm_sq.to(torch.float32)
