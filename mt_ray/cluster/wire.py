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
