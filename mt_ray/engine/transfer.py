"""Moving weights host->device ahead of use and gradients device->host as they finish.

On CUDA three streams run at once: `compute` (the default stream), `h2d` (weight uploads, and
hidden states fetched back) and `d2h` (gradients, and hidden states parked in host memory). Every
hand-over between them is an event; nothing here synchronises the whole device. On CPU the
same code runs with no streams: copies are synchronous and events are None.
"""

from __future__ import annotations

import contextlib
import queue
import time
from collections import deque
from dataclasses import dataclass

import torch

from mt_ray.engine.pinning import host_empty, unregister_pinned
from mt_ray.engine.seams import UnitVersions, WeightSource


class StreamSet:
    """The compute, upload and download streams of one device (all None on CPU)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.compute = torch.cuda.current_stream(device) if self.cuda else None
        self.h2d = torch.cuda.Stream(device) if self.cuda else None
        self.d2h = torch.cuda.Stream(device) if self.cuda else None

    def on(self, stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def record(self, stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
        if stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    @staticmethod
    def wait(stream: torch.cuda.Stream | None, event: torch.cuda.Event | None) -> None:
        if stream is not None and event is not None:
            stream.wait_event(event)


@dataclass
class _Upload:
    unit: str
    flat: torch.Tensor
    ready: torch.cuda.Event | None


class WeightStreamer:
    """Uploads units in a known order, keeping up to `depth` uploads in flight ahead of the consumer.

    Device memory stays bounded although the CPU runs ahead of the GPU: a unit handed out
    is held until `hold` more units have been handed out (the consumer never uses more than
    `hold` units at once), then the upload stream waits for the compute work queued so far
    and the buffer is dropped. Buffers are allocated and freed on the upload stream, so the
    caching allocator reuses them in that stream's order, after the wait: no `record_stream`,
    whose deferred frees let a CPU far ahead of the GPU pile up every layer of the step.

    `versions` says how far the optimizer of the previous step has got. A unit is uploaded only
    once it holds the version this step must read; only the unit being handed out waits for that
    (`versions.wait_updated`, bounded), the units ahead of it are uploaded when already updated and
    otherwise left for their own turn. So while the previous step's optimizer still runs (with
    clipping it starts only at the end of that step's backward, in forward order) the compute of
    each unit is queued as soon as that unit is updated, not once the `depth` units after it are:
    the next step's forward chases the optimizer unit by unit. This is the only place a step waits
    for the optimizer of the one before.
    """

    def __init__(self, store: WeightSource, streams: StreamSet, dtype: torch.dtype, depth: int, hold: int,
                 versions: UnitVersions):
        self.store = store
        self.streams = streams
        self.dtype = dtype
        self.depth = depth
        self.hold = hold
        self.versions = versions
        self._plan: deque[tuple[int, str]] = deque()
        self._last_use: dict[str, int] = {}
        self._inflight: deque[_Upload] = deque()
        self._lent: deque[torch.Tensor] = deque()
        self._version = 0
        self.optimizer_wait_s = 0.0  # the engine's thread blocked on the optimizer (the benchmarks' time split)

    def start(self, plan: list[str], version: int) -> None:
        """Begin a step: `plan` is every unit the step will read, in order of use."""
        if self._inflight or self._plan:
            raise RuntimeError(f"previous step left {len(self._inflight) + len(self._plan)} units unused")
        self._release(keep=0)
        self._plan = deque(enumerate(plan))
        self._last_use = {unit: i for i, unit in enumerate(plan)}
        self._version = version
        self._top_up()

    def next(self, unit: str) -> torch.Tensor:
        """The next unit's flat weights in the compute dtype, usable on the compute stream."""
        self._release(keep=self.hold - 1)
        if not self._inflight:
            self._upload_next()  # this unit was still being updated when it was last looked at: wait for it now
        up = self._inflight.popleft()
        if up.unit != unit:
            raise RuntimeError(f"upload order broken: expected {unit}, streamed {up.unit}")
        # The compute stream waits for this upload only, not for the whole copy queue.
        self.streams.wait(self.streams.compute, up.ready)
        self._lent.append(up.flat)
        self._top_up()
        return up.flat

    def _release(self, keep: int) -> None:
        """Give back all but the `keep` most recently lent buffers, once compute is done with them."""
        if len(self._lent) <= keep:
            return
        self.streams.wait(self.streams.h2d, self.streams.record(self.streams.compute))
        while len(self._lent) > keep:
            self._lent.popleft()

    def _top_up(self) -> None:
        """Upload ahead, in plan order, the units already updated; stop (never wait) at one still being updated."""
        while len(self._inflight) < self.depth and self._plan and \
                self.versions.is_updated(self._plan[0][1], self._version):
            self._upload_next()

    def _upload_next(self) -> None:
        """Upload the plan's next unit once it holds this step's version."""
        i, unit = self._plan.popleft()
        t0 = time.perf_counter()
        # Bounded (the optimizer's stall limit): the only wait for the previous step's optimizer, for this unit only.
        self.versions.wait_updated(unit, self._version)
        self.optimizer_wait_s += time.perf_counter() - t0
        up = self._upload(unit)
        if i == self._last_use[unit]:
            self.store.release(unit, up.ready)  # the source may drop its host copy once this upload lands
        self._inflight.append(up)

    def _upload(self, unit: str) -> _Upload:
        src = self.store.streamed_of(unit)
        device = self.streams.device
        with self.streams.on(self.streams.h2d):
            if src.is_cuda:
                # A unit whose state is kept on the device: its master cast there (a copy even in its own dtype,
                # so the optimizer may update the master while the step still reads these weights).
                flat = src.to(self.dtype, copy=True)
                return _Upload(unit, flat, self.streams.record(self.streams.h2d))
            # Pinned source + non_blocking: a true async DMA on the copy engine.
            flat = torch.empty(src.numel(), dtype=src.dtype, device=device)
            flat.copy_(src, non_blocking=True)
            if flat.dtype != self.dtype:
                flat = flat.to(self.dtype)  # stream_master: cast fp32 -> compute dtype on the device
            ready = self.streams.record(self.streams.h2d)
        return _Upload(unit, flat, ready)


class Outbox:
    """Device tensors on their way to the host (gradients, parked hidden states), freed only
    once their copy has run.

    Like the weight streamer, it bounds device memory without `record_stream`: after `keep`
    newer tensors are queued, the compute stream waits for the oldest one's copy (long
    finished by then) before its buffer is dropped back to the compute stream's pool.
    """

    def __init__(self, streams: StreamSet, keep: int = 2):
        self.streams = streams
        self.keep = keep
        self._queue: deque[tuple[torch.Tensor, torch.cuda.Event | None]] = deque()

    def add(self, grad: torch.Tensor, copied: torch.cuda.Event | None) -> None:
        self._queue.append((grad, copied))
        while len(self._queue) > self.keep:
            _, event = self._queue.popleft()
            self.streams.wait(self.streams.compute, event)


class GradBuffers:
    """Host buffers gradients land in: a bounded pool of reusable slabs, or one per unit.

    With clipping, every gradient must wait for the global norm, so each unit keeps its own
    buffer until the step ends; without it, a few slabs recycle as the optimizer drains them.
    """

    def __init__(self, numels: dict[str, int], dtype: torch.dtype, pin: bool, per_unit: bool, slabs: int):
        self.numels = numels
        self.per_unit = per_unit
        self.pin = pin
        if per_unit:
            total = sum(numels.values())
            self._buf = host_empty(total, dtype, pin)
            self._views, off = {}, 0
            for unit, n in numels.items():
                self._views[unit] = self._buf[off : off + n]
                off += n
        else:
            size = max(numels.values())
            self._slabs = [host_empty(size, dtype, pin) for _ in range(slabs)]
            self._free: queue.Queue[int] = queue.Queue()
            for i in range(slabs):
                self._free.put(i)
            self._held: dict[str, int] = {}

    def close(self) -> None:
        if self.pin:
            for buf in [self._buf] if self.per_unit else self._slabs:
                unregister_pinned(buf)
            self.pin = False

    def pieces(self, unit: str) -> list[tuple[int, int]]:
        """The element ranges `unit`'s gradient lands in, one `acquire` each: here the whole of it at once
        (a trainer's buffers may take a large gradient in pieces)."""
        return [(0, self.numels[unit])]

    def acquire(self, unit: str, lo: int, hi: int) -> torch.Tensor:
        """The host buffer elements [lo, hi) of `unit`'s gradient land in (one of `pieces(unit)`)."""
        if self.per_unit:
            return self._views[unit]
        i = self._free.get()  # back-pressure: blocks the CPU while the optimizer drains slabs
        self._held[unit] = i
        return self._slabs[i][: self.numels[unit]]

    def release(self, unit: str) -> None:
        if not self.per_unit:
            self._free.put(self._held.pop(unit))


class WithOwners:
    """A unit's optimizer versions, counting the units that own its mirrors (weights tied between layers): their
    updates write the mirror's values, so the unit is updated only once they are too."""

    def __init__(self, versions: UnitVersions, owners: dict[str, set[str]]):
        self.versions = versions
        self.owners = {unit: sorted(units) for unit, units in owners.items()}

    def wait_updated(self, unit: str, version: int) -> None:
        for owner in self.owners.get(unit, ()):
            self.versions.wait_updated(owner, version)
        self.versions.wait_updated(unit, version)

    def is_updated(self, unit: str, version: int) -> bool:
        return all(self.versions.is_updated(u, version) for u in [*self.owners.get(unit, ()), unit])
