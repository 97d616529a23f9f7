"""Optimizer state on NVMe (`engine.state_placement: nvme | nvme_moments`): the file-backed state tier.

Each unit's state is cut into the optimizer's chunks (`chunk_bounds`, at most FILE_CHUNK_NUMEL
elements). A chunk's record holds its fp32 master (under `nvme`), exp_avg and exp_avg_sq, each
section padded to ALIGN bytes, so one direct read or write moves a whole record. Every unit has one
file, preallocated at start (a full disk is found before the first step, not in the middle of one),
then unlinked while open: the kernel frees it when the process ends, even on SIGKILL. Checkpoints,
not these files, are what a run resumes from.

Host memory holds `window` slots of one record each. The optimizer thread `acquire`s a chunk (its
read was started ahead, in the order the updates come), updates it, and `release`s it: the write-back
starts and the slot returns once it is on disk. Reads and writes run on `FileIO`'s threads, so disk
traffic overlaps the backward pass as the updates do. All bookkeeping happens on the calling thread:
the optimizer thread while training, the engine's thread between steps (after `synchronize`).
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from mt_ray.engine.direct_io import ALIGN, FileIO, Pending, aligned, aligned_empty, probe_direct_io
from mt_ray.engine.pinning import register_pinned, unregister_pinned
from mt_ray.errors import ConfigError, InsufficientMemoryError
from mt_ray.models.discovery import UnitSpec

log = logging.getLogger(__name__)

GIB = 1024**3
# Elements per chunk of state on disk (and per optimizer step call): 16 M x 12 B = 192 MB a record,
# small beside a 7B model's state but large enough for the disk to stream at full speed.
FILE_CHUNK_NUMEL = 1 << 24
PARTS = ("master", "exp_avg", "exp_avg_sq")


class ChunkState(NamedTuple):
    """fp32 views of one chunk's master and moments (moments None for a frozen unit)."""

    master: torch.Tensor
    exp_avg: torch.Tensor | None
    exp_avg_sq: torch.Tensor | None


def chunk_bounds(unit: UnitSpec, chunk_numel: int) -> list[tuple[int, int, bool]]:
    """[lo, hi) of each chunk of a unit's flat state, and whether it decays: decayed parameters come first
    (`UnitSpec.params` order), and no chunk mixes them with the rest, which take no weight decay."""
    n_decay = sum(p.numel for p in unit.params if p.decays)
    return [(c, min(hi, c + chunk_numel), decays) for lo, hi, decays in ((0, n_decay, True), (n_decay, unit.numel, False))
            for c in range(lo, hi, chunk_numel)]


@dataclass(frozen=True)
class Record:
    """Where one chunk's state lives: its unit's file, the record's offset there and each section's offset in it."""

    unit: str
    lo: int
    hi: int
    offset: int
    sections: dict[str, int]
    nbytes: int


@dataclass(frozen=True)
class FilePlan:
    """Every chunk's record, and the bytes the files take on disk."""

    records: dict[tuple[str, int], Record]
    file_bytes: dict[str, int]

    @property
    def disk_bytes(self) -> int:
        return sum(self.file_bytes.values())

    @property
    def slot_bytes(self) -> int:
        return max(r.nbytes for r in self.records.values())

    def chunks(self, unit: str) -> list[Record]:
        return [r for r in self.records.values() if r.unit == unit]


def plan_files(units: list[UnitSpec], with_master: bool, chunk_numel: int = FILE_CHUNK_NUMEL) -> FilePlan:
    """The records of `units` (the master's section only under `with_master`; moments for trained units)."""
    records, file_bytes = {}, {}
    for unit in units:
        parts = [p for p in PARTS if (p == "master" and with_master) or (p != "master" and not unit.frozen)]
        offset = 0
        for lo, hi, _ in chunk_bounds(unit, chunk_numel) if parts else ():
            section = aligned((hi - lo) * 4)
            sections = {p: i * section for i, p in enumerate(parts)}
            records[(unit.name, lo)] = Record(unit.name, lo, hi, offset, sections, section * len(parts))
            offset += section * len(parts)
        if offset:
            file_bytes[unit.name] = offset
    return FilePlan(records, file_bytes)


def window_bytes(plan: FilePlan, window: int) -> int:
    """Host bytes of the slots (and their alignment slack)."""
    return window * (plan.slot_bytes + ALIGN) if plan.records else 0


def free_bytes(folder: Path) -> int:
    return shutil.disk_usage(folder).free


def check_state_path(path: str | None, need_bytes: int, require_direct: bool,
                     probe: Callable[[Path], str | None] = probe_direct_io,
                     free: Callable[[Path], int] = free_bytes) -> bool:
    """Refuse, before any state is built, a state folder that is missing, not writable, too small for
    `need_bytes`, or (with `require_direct`) refuses direct I/O, each in one line naming the path, the need and
    the fix. Returns whether direct I/O works there."""
    folder = Path(path or "")
    if not path or not folder.is_dir():
        raise ConfigError(f"engine.nvme_path {path!r} is not an existing folder; the optimizer state needs "
                          f"{need_bytes / GIB:.1f} GiB there: create it (mkdir -p) on an NVMe disk, or set "
                          "engine.state_placement: host")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"engine.nvme_path {path} is not writable by this user; the optimizer state needs "
                          f"{need_bytes / GIB:.1f} GiB there: fix its permissions or choose another folder")
    room = free(folder)
    if room < need_bytes:
        raise InsufficientMemoryError(
            f"engine.nvme_path {path} has {room / GIB:.1f} GiB free, but the optimizer state needs "
            f"{need_bytes / GIB:.1f} GiB: free space there, point engine.nvme_path at a larger disk, or use "
            "state_placement: nvme_moments (keeps the master in RAM)")
    why = probe(folder)
    if why is not None and require_direct:
        raise ConfigError(f"engine.nvme_path {path} refuses direct I/O (O_DIRECT: {why}), which the optimizer state "
                          "needs to bypass the page cache: use a folder on an ext4/xfs disk, or engine.nvme_io: auto "
                          "to fall back to buffered I/O (the page cache then holds what was moved out of RAM)")
    if why is not None:
        log.warning("engine.nvme_path %s refuses direct I/O (%s): optimizer state goes through the page cache "
                    "(engine.nvme_io: auto)", path, why)
    return why is None


class FileTier:
    """Chunks of optimizer state in per-unit files, read ahead into a window of page-locked slots."""

    def __init__(self, plan: FilePlan, folder: str, io: FileIO, window: int, pin: bool,
                 host_master: dict[str, torch.Tensor] | None = None):
        """`host_master`: each unit's fp32 master in host memory (`nvme_moments`); None: the master is on disk."""
        self.plan, self.io, self.host_master = plan, io, host_master
        self.paths: dict[str, str] = {}
        self._fds: list[int] = []  # creation descriptors: buffered access for checkpoints by range
        for unit, nbytes in plan.file_bytes.items():
            self._create(Path(folder), unit, nbytes)
        self.slots = [aligned_empty(plan.slot_bytes) for _ in range(window)] if plan.records else []
        # Page-locked so the aio op (and the kernel's direct I/O) never faults a page in mid-transfer.
        self._pinned = [register_pinned(s) for s in self.slots] if pin else []
        self._free = list(range(len(self.slots)))
        self._reads: dict[tuple[str, int], tuple[int, Pending]] = {}
        self._writes: dict[tuple[str, int], tuple[int, Pending]] = {}
        self._busy: dict[tuple[str, int], int] = {}
        self._order: list[tuple[str, int]] = []
        self._rank: dict[tuple[str, int], int] = {}
        log.info("optimizer state: %.1f GiB in %d files under %s, %d slots of %.0f MiB, I/O through %s",
                 plan.disk_bytes / GIB, len(self.paths), folder, window, plan.slot_bytes / 2**20, io.name)

    def _create(self, folder: Path, unit: str, nbytes: int) -> None:
        path = folder / f".mt-ray-state-{uuid.uuid4().hex[:12]}-{unit}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)  # reserved now: a full disk stops the run here, not mid-step
        except OSError:
            os.close(fd)
            path.unlink()
            raise
        self._fds.append(fd)
        self.paths[unit] = f"/proc/self/fd/{fd}"  # the file stays reachable by name once unlinked
        path.unlink()
        self.io.open(self.paths[unit], f"the optimizer state of {unit} in {folder} (unlinked {path.name})")

    def expect(self, units: list[str]) -> None:
        """The order units are updated in: each acquire reads the next chunks in it ahead."""
        self._order = [(r.unit, r.lo) for u in units for r in self.plan.chunks(u)]
        self._rank = {k: i for i, k in enumerate(self._order)}

    def acquire(self, unit: str, lo: int, hi: int) -> ChunkState:
        """The chunk's state in a slot (waiting for its read); it is the caller's until `release`."""
        key = (unit, lo)
        if key in self._reads:
            slot, pending = self._reads.pop(key)
        else:
            slot = self._take_slot()
            pending = self._read(key, slot)
        self._busy[key] = slot
        pending.wait()
        self._prefetch(key)
        return self._views(key, slot)

    def release(self, unit: str, lo: int) -> None:
        """Start writing the chunk back; its slot is free again once the write is on disk."""
        key = (unit, lo)
        slot = self._busy.pop(key)
        record = self.plan.records[key]
        self._writes[key] = (slot, self.io.write(self.paths[unit], self.slots[slot][: record.nbytes], record.offset))
        self._prefetch(key)

    def flush(self, raise_errors: bool = True) -> None:
        """Wait for every write and drop the reads started ahead (before the files are read or written by range)."""
        pending = [*self._writes.values(), *self._reads.values()]
        self._writes.clear()
        self._reads.clear()
        for slot, p in pending:
            self._free.append(slot)
            try:
                p.wait()
            except OSError:
                if raise_errors:
                    raise

    def access_flat(self, part: str, unit: str, lo: int, buf: torch.Tensor, write: bool) -> None:
        """Elements [lo, lo + len) of a unit's `part` from (or, with `write`, to) its chunks, through the page
        cache, dropped from it after: checkpoints move the state by range this way, never all of it at once."""
        hi = lo + buf.numel()
        for record in self.plan.chunks(unit):
            a, b = max(lo, record.lo), min(hi, record.hi)
            if a >= b:
                continue
            fd = int(self.paths[unit].rsplit("/", 1)[1])
            pos = record.offset + record.sections[part] + (a - record.lo) * 4
            view = memoryview(buf[a - lo : b - lo].numpy()).cast("B")
            done = 0
            while done < len(view):
                n = os.pwrite(fd, view[done:], pos + done) if write else os.preadv(fd, [view[done:]], pos + done)
                if n <= 0:
                    raise OSError(f"short {'write' if write else 'read'} of {self.paths[unit]}")
                done += n
            if write:
                os.fdatasync(fd)  # on disk before the next direct read, and clean so the page cache can drop it
            os.posix_fadvise(fd, pos, len(view), os.POSIX_FADV_DONTNEED)  # the page cache keeps none of it

    def close(self) -> None:
        self.flush(raise_errors=False)  # a failed request has been raised where it was waited for
        for slot in self._pinned:
            unregister_pinned(slot)
        self._pinned.clear()
        self.io.close()
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()

    # ------------------------------------------------------------------ slots

    def _views(self, key: tuple[str, int], slot: int) -> ChunkState:
        record = self.plan.records[key]
        n, buf = record.hi - record.lo, self.slots[slot]
        part = {p: buf[o : o + n * 4].view(torch.float32) for p, o in record.sections.items()}
        master = part["master"] if self.host_master is None else self.host_master[record.unit][record.lo : record.hi]
        return ChunkState(master, part.get("exp_avg"), part.get("exp_avg_sq"))

    def _read(self, key: tuple[str, int], slot: int) -> Pending:
        if key in self._writes:  # the chunk's last write must land before it is read again
            done_slot, pending = self._writes.pop(key)
            pending.wait()
            self._free.append(done_slot)
        record = self.plan.records[key]
        return self.io.read(self.paths[key[0]], self.slots[slot][: record.nbytes], record.offset)

    def _take_slot(self) -> int:
        """A free slot: the oldest finished write's, else wait for the oldest write (or a read started ahead)."""
        self._reap()
        if self._free:
            return self._free.pop(0)
        pool = self._writes if self._writes else self._reads
        key = next(iter(pool))
        slot, pending = pool.pop(key)
        pending.wait()
        return slot

    def _reap(self) -> None:
        for key in [k for k, (_, p) in self._writes.items() if p.done()]:
            slot, pending = self._writes.pop(key)
            pending.wait()  # raises a failed write's error
            self._free.append(slot)

    def _prefetch(self, after: tuple[str, int]) -> None:
        """Start reads of the chunks that follow `after` in update order, into slots free now (one is kept
        for the chunk being updated)."""
        if after not in self._rank:
            return
        self._reap()
        i = self._rank[after]
        for step in range(1, len(self._order)):
            if not self._free or len(self._reads) >= len(self.slots) - 1:
                return
            key = self._order[(i + step) % len(self._order)]
            if key in self._busy or key in self._reads:
                continue
            if key in self._writes:  # comes round again before its write lands: the acquire will wait
                return
            slot = self._free.pop(0)
            self._reads[key] = (slot, self._read(key, slot))
