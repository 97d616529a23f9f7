"""The optimizer state of the first units kept on the GPU between steps (`engine.device_optimizer_units`).

With clipping no unit can be updated before the step's gradient norm is known, at the end of its backward, and the
next forward needs the embedding and layer 0 first. The host updates 2-4 G parameters a second, so a short step
(a mixture of experts at a small batch, a GRPO update) waits seconds for it. The units kept here, the first in
forward order, are updated on the GPU in milliseconds: the next forward runs through them while the host updates
the rest in the same order, each unit as soon as it is done (`WeightStreamer`).

A kept unit's fp32 master and moments live here and nowhere else between steps: its gradient stays on the device
(`StepGrads`), the forward casts its weights from this master (no upload), and the update is `device_adamw`'s
kernel, bit-identical to the host's. The host store's buffers of these units go stale, and are brought up to date
(`bring_home`) before anything reads them (a checkpoint, an export: `WeightsIO.synchronize`); what is written into
them (a load, a restored checkpoint) is sent back up (`send_out`). On the CPU (tests) the same code holds a second
copy in host memory, updated by the host kernel: the bookkeeping is exercised, the arithmetic is the same.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from mt_ray.engine.state_files import ChunkState

STATE_BYTES_PER_PARAM = 12  # the fp32 master and two moments


def kept_bytes_per_param(grad_dtype: torch.dtype) -> int:
    """GPU bytes a kept parameter takes: its state, and its gradient held there until the step's norm is known."""
    return STATE_BYTES_PER_PARAM + grad_dtype.itemsize

HostViews = Callable[[str], ChunkState]
"""A unit's whole host master and moments (the store's views)."""


class DeviceState:
    """The fp32 master and Adam moments of `units` on `device`, and the stream their updates run on."""

    def __init__(self, units: list[str], host: HostViews, device: torch.device):
        self.units = list(units)
        self.device = device
        self._host = host
        # High priority: the next forward waits for these short, memory-bound kernels, which would otherwise queue
        # behind its GEMMs' blocks.
        self.stream = torch.cuda.Stream(device, priority=-1) if device.type == "cuda" else None
        self._state = {u: ChunkState(*(t.to(device, copy=True) for t in host(u))) for u in self.units}
        self.stale_on_host = True

    def __contains__(self, unit: str) -> bool:
        return unit in self._state

    @property
    def numel(self) -> int:
        return sum(s.master.numel() for s in self._state.values())

    def acquire(self, unit: str, lo: int, hi: int) -> ChunkState:
        """Elements [lo, hi) of a kept unit's master and moments, on the device."""
        s = self._state[unit]
        return ChunkState(s.master[lo:hi], s.exp_avg[lo:hi], s.exp_avg_sq[lo:hi])

    def weights(self, unit: str) -> torch.Tensor:
        """A kept unit's fp32 master on the device: what the forward casts its weights from."""
        return self._state[unit].master

    @contextlib.contextmanager
    def on_stream(self) -> Iterator[None]:
        """Queue an update's kernels on this state's own stream, never behind the step's compute (`done` says
        when they have run)."""
        if self.stream is None:
            yield
            return
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            yield

    def done(self) -> torch.cuda.Event | None:
        """An event that completes once every update queued so far has run (None on the CPU: they have)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event(blocking=True)  # waited for asleep, not spinning a core the host AdamW needs
        event.record(self.stream)
        return event

    def wait_for(self, event: torch.cuda.Event | None) -> None:
        """Order the next update after `event` (its gradient computed on the compute stream)."""
        if self.stream is not None and event is not None:
            self.stream.wait_event(event)

    def bring_home(self) -> None:
        """Copy the kept master and moments into the host buffers (before anything reads those)."""
        if not self.stale_on_host:
            return
        for unit, s in self._state.items():
            for dst, src in zip(self._host(unit), s, strict=True):
                dst.copy_(src)
        self.stale_on_host = False

    def send_out(self) -> None:
        """Copy the host buffers of the kept units up (after something wrote them)."""
        for unit, s in self._state.items():
            for dst, src in zip(s, self._host(unit), strict=True):
                dst.copy_(src)
        self.stale_on_host = False

    def updated(self) -> None:
        """An update ran here: the host buffers no longer hold these units' state."""
        self.stale_on_host = True

    def close(self) -> None:
        self._state.clear()


def kept_prefix(units: list[str], numels: dict[str, int], eligible: set[str], budget_bytes: float,
                bytes_per_param: int) -> list[str]:
    """The `eligible` units of `units` (forward order) from the first, up to the first whose state no longer fits
    `budget_bytes`: the forward reaches them first, so the host's share is the end of the order."""
    kept, used = [], 0
    for unit in (u for u in units if u in eligible):
        cost = numels[unit] * bytes_per_param
        if used + cost > budget_bytes:
            break
        kept.append(unit)
        used += cost
    return kept
