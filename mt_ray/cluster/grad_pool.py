"""Where a coordinator shard puts summed gradients: a few reused buffers, and the object store.

A sum is written into one of a few unit-sized buffers (which also serve to cast weights for
publication: with clipping the two never run at once, since updates wait for every sum). A partial sum for another node's shard,
or (with clipping) a sum that must wait for the global norm, is then put into the node's object
store and the buffer reused at once: held gradients share the object store's memory with the
weights that the backward pass has finished with, instead of adding a whole model's gradients
to the shard's own memory. Without clipping the optimizer reads the buffer itself and frees it.
"""

from __future__ import annotations

import queue
import threading

import numpy as np
import ray
import torch

from mt_ray.cluster.wire import from_numpy, to_numpy


class GradPool:
    """The `buffers` surface an `OptimizerWorker` releases gradients through (`numels`, `release`)."""

    def __init__(self, numels: dict[str, int], dtype: torch.dtype, buffers: int = 2, cast_dtype: torch.dtype | None = None):
        self.numels = numels
        self.dtype = dtype
        size = max(numels.values()) * max(dtype.itemsize, (cast_dtype or dtype).itemsize)
        self._buffers = [torch.empty(size, dtype=torch.uint8) for _ in range(buffers)]
        self._free: queue.Queue[int] = queue.Queue()
        for i in range(buffers):
            self._free.put(i)
        self._lock = threading.Lock()
        self._lent: dict[str, int] = {}  # unit -> buffer the optimizer reads
        self._held: dict[str, ray.ObjectRef] = {}  # unit -> object holding its summed gradient

    def acquire(self, unit: str, dtype: torch.dtype | None = None) -> tuple[int, torch.Tensor]:
        """A buffer for `unit`'s sum (or its cast to `dtype`); blocks while every buffer is in use."""
        i = self._free.get()
        return i, self._view(i, unit, dtype or self.dtype)

    def give_back(self, i: int) -> None:
        self._free.put(i)

    def _view(self, i: int, unit: str, dtype: torch.dtype) -> torch.Tensor:
        n = self.numels[unit]
        return self._buffers[i][: n * dtype.itemsize].view(dtype)

    def lend(self, unit: str, i: int) -> torch.Tensor:
        """The optimizer reads buffer `i` as `unit`'s gradient and frees it with `release`."""
        with self._lock:
            self._lent[unit] = i
        return self._view(i, unit, self.dtype)

    def hold(self, unit: str, i: int) -> torch.Tensor:
        """Move buffer `i` into the object store as `unit`'s gradient; returns a read-only view of it."""
        ref = ray.put(to_numpy(self._view(i, unit, self.dtype)))
        self.give_back(i)
        with self._lock:
            self._held[unit] = ref
        return from_numpy(ray.get(ref), self.dtype)

    def keep(self, unit: str, ref: ray.ObjectRef, array: np.ndarray) -> torch.Tensor:
        """Hold an object already in the store (a lone worker's gradient, `array` its mapped view) as `unit`'s;
        returns a read-only tensor view of it."""
        with self._lock:
            self._held[unit] = ref
        return from_numpy(array, self.dtype)

    def release(self, unit: str) -> None:
        """The optimizer has applied `unit`'s gradient."""
        with self._lock:
            i = self._lent.pop(unit, None)
            self._held.pop(unit, None)  # the last reference: the store frees the object
        if i is not None:
            self.give_back(i)

    def clear(self) -> None:
        """Drop every held gradient (a generation ended without applying them)."""
        with self._lock:
            self._held.clear()
            lent, self._lent = list(self._lent.values()), {}
        for i in lent:
            self.give_back(i)
