"""Tensors in and out of the Ray object store without copies on the reading side.

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


SUM_THREADS = 4  # per gradient being summed; several units' sums may run at once


def sum_fp32(arrays: list[np.ndarray], dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """Sum gradients read from the object store in fp32, in the order given (callers pass rank
    order, so the sum does not depend on arrival order); into `out` when given.

    Ray runs actor threads with OMP_NUM_THREADS=1, and one core cannot sum a 7B layer as fast as
    a GPU computes it; the setting is per thread, so it leaves an optimizer thread's alone.
    """
    torch.set_num_threads(SUM_THREADS)
    first = from_numpy(arrays[0], dtype)
    out = first.to(torch.float32, copy=True) if out is None else out.copy_(first)
    for a in arrays[1:]:
        out.add_(from_numpy(a, dtype))
    return out
