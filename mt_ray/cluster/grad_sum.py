"""The node's gradient sum at memory bandwidth: workers' parts added in rank order, rounded once, with the norm².

A node with several workers (or a shard owning units other nodes send partial sums of) adds gradient parts element by
element: in fp32, in the order given (rank order, then node order, so a sum never depends on arrival order), rounded
to the output's dtype once, and the norm² of the fp32 sum taken on the way. Torch needs about eight ops a cache-sized
chunk for that (two upcasts, an add, a norm, a downcast) and ran at about 1 Gelem/s whatever the thread count: per-op
overhead, not memory. Here it is one pass, compiled by numba: each element of every part is read once and the sum
written once, on a thread team of the calling thread's own (`numba.set_num_threads` holds per thread, where ATen's
count is process-wide), with per-block norm partials added in block order, so the result is the same on any number
of threads.

bf16 travels as its 16-bit words (`engine.bf16_words`).
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import njit, prange

from mt_ray.engine.bf16_words import narrow, widen, words_of

BLOCK = 1 << 16  # elements per parallel task
SUB = 1 << 10  # elements summed into an L1-resident fp32 buffer, then squared and narrowed from it


@njit(nogil=True, cache=True, boundscheck=False, fastmath={"reassoc", "nsz"})
def _square_sum(x, m):
    """Sum of squares of `x[:m]` (a cache-resident block of fp32 sums), vectorised in fp32 lanes (reassociated: the
    same order on every call, not the element order); the fast-math flags stay on these instructions where numba
    inlines them. A block's partial is exact to fp32 rounding; the blocks add up in fp64."""
    sq = np.float32(0.0)
    for j in range(m):
        sq += x[j] * x[j]
    return np.float64(sq)


@njit(parallel=True, nogil=True, cache=True, boundscheck=False)
def _sum_kernel(parts, out, write):
    """Sum the same-dtype `parts` (a tuple of flat arrays) element by element in fp32, in tuple order, into `out`
    (where `write`); returns the fp64 norm² of the fp32 sums, added block by block in block order."""
    n = parts[0].size
    blocks = (n + BLOCK - 1) // BLOCK
    partial = np.zeros(blocks, np.float64)
    for b in prange(blocks):
        acc = np.empty(SUB, np.float32)
        sq = 0.0
        for lo in range(b * BLOCK, min((b + 1) * BLOCK, n), SUB):
            hi = min(lo + SUB, n)
            # Slices, not offsets from `lo`: LLVM vectorises loops over a view's own elements (3x here).
            first = parts[0][lo:hi]
            for j in range(hi - lo):
                acc[j] = widen(first[j])
            for k in range(1, len(parts)):  # each part in turn over the buffer: every element's adds in part order
                part = parts[k][lo:hi]
                for j in range(hi - lo):
                    acc[j] += widen(part[j])
            sq += _square_sum(acc, hi - lo)
            if write:
                target = out[lo:hi]
                for j in range(hi - lo):
                    target[j] = narrow(acc[j], target[j])
        partial[b] = sq
    total = 0.0
    for b in range(blocks):  # block order: the same norm on any thread count
        total += partial[b]
    return total


def _words(t: torch.Tensor, writeable: bool) -> np.ndarray:
    """The kernel's view of a flat gradient (`words_of`). Parts are viewed read-only whatever they are (an
    object-store array is), so a tuple of them has one type and compiles once."""
    a = words_of(t).view()
    a.flags.writeable = writeable
    return a


SUMMABLE = (torch.bfloat16, torch.float32)


def sum_in_order(parts: list[torch.Tensor], out: torch.Tensor | None) -> torch.Tensor:
    """Sum flat gradients of one dtype (bf16 or fp32) into `out` (that dtype; may be `parts[0]` itself) in fp32, in
    the order given, rounded once; returns the fp64 norm² of the fp32 sum (with `out` None, the norm² alone).

    Runs on the calling thread's numba team (`numba.set_num_threads` on that thread sets its size).
    """
    dtype = parts[0].dtype
    if dtype not in SUMMABLE or any(p.dtype != dtype for p in parts) or (out is not None and out.dtype != dtype):
        raise TypeError(f"gradient sums take bf16 or fp32 parts and output of one dtype; got "
                        f"{[p.dtype for p in parts]} into {None if out is None else out.dtype}")
    words = tuple(_words(p, False) for p in parts)
    target = _words(out, True) if out is not None else np.empty(0, words[0].dtype)
    return torch.tensor(_sum_kernel(words, target, out is not None), dtype=torch.float64)


def use_sum_threads(threads: int) -> None:
    """Size the calling thread's numba team (at most numba's pool; a shard's reduce thread calls it once)."""
    numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))
