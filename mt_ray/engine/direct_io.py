"""Page-cache-bypassing file I/O for optimizer state kept on NVMe (`engine.state_placement`).

Reads and writes go to positions inside preallocated files, from and into buffers aligned to
ALIGN bytes (what O_DIRECT asks of offsets, lengths and addresses). Two back ends run them on a
small thread pool, so the optimizer thread only submits and waits:

- DeepSpeed's async I/O op (`deepspeed.ops.aio`, libaio underneath) where it is compatible and
  builds: each pool thread owns one aio handle and runs one request at a time on it.
- Otherwise `os.preadv`/`os.pwritev` on descriptors opened with O_DIRECT, each request cut into
  IO_CHUNK pieces spread over the pool, so the disk sees a queue of requests at once.

Where the filesystem refuses O_DIRECT (`probe_direct_io`) the pool can run buffered instead; the
engine refuses that unless `engine.nvme_io: auto` allows it, because the page cache then grows by
the very state that was moved out of RAM.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import torch

log = logging.getLogger(__name__)

ALIGN = 4096  # O_DIRECT: offsets, lengths and buffer addresses in multiples of the logical block (4 KiB covers all)
IO_CHUNK = 16 << 20  # bytes per positional request of the O_DIRECT pool: a queue of them keeps an NVMe drive busy
IO_THREADS = 8
# The mixed probe's reads and writes alternate in pieces of about one state record (16 M parameters of master and
# moments: 192 MiB), as the optimizer's read-ahead and write-back do.
MIXED_PIECE = 192 << 20


def aligned(nbytes: int) -> int:
    """`nbytes` rounded up to ALIGN."""
    return -(-nbytes // ALIGN) * ALIGN


def aligned_empty(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 host buffer of `nbytes` (rounded up to ALIGN) whose address is ALIGN-aligned."""
    size = aligned(nbytes)
    raw = torch.empty(size + ALIGN, dtype=torch.uint8)
    skip = -raw.data_ptr() % ALIGN
    return raw[skip : skip + size]


def probe_direct_io(folder: str | Path) -> str | None:
    """None where files in `folder` take O_DIRECT reads and writes, else why not (the OS error)."""
    path = Path(folder) / f".mt-ray-direct-probe-{uuid.uuid4().hex[:8]}"
    buf = aligned_empty(ALIGN)
    buf.fill_(7)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        try:
            os.pwritev(fd, [_bytes(buf)], 0)
            os.preadv(fd, [_bytes(buf)], 0)
        finally:
            os.close(fd)
    except OSError as e:
        return f"{e.strerror or e} (errno {e.errno})"
    finally:
        path.unlink(missing_ok=True)
    return None


class DiskSpeed(NamedTuple):
    """Direct-I/O GB/s of a disk: reading alone, writing alone, and reads and writes in flight at once (`mixed`:
    the bytes of both a second), which is how the optimizer state moves: the read-ahead beside the write-back."""

    read_gbps: float
    write_gbps: float
    mixed_gbps: float

    def describe(self) -> str:
        return (f"direct read {self.read_gbps:.2f} GB/s, write {self.write_gbps:.2f} GB/s, both at once "
                f"{self.mixed_gbps:.2f} GB/s combined")


def measure_disk(folder: str | Path, nbytes: int = 2 << 30) -> DiskSpeed:
    """Direct read, write and mixed GB/s of `folder`'s disk, through the I/O the optimizer state would use, on a
    temporary file of `nbytes` (unlinked at once, so nothing is left behind): written whole, read whole, then its
    first half read while its second half is rewritten, the requests interleaved as the read-ahead and the
    write-back interleave theirs (a drive may overlap the two, or make them share its bandwidth)."""
    if not Path(folder).is_dir():
        raise OSError(f"{folder} is not an existing folder (create it on the NVMe disk to measure)")
    why = probe_direct_io(folder)
    if why is not None:
        raise OSError(f"{folder} refuses direct I/O ({why}): the optimizer state needs a folder that takes O_DIRECT")
    half = aligned(nbytes // 2)
    nbytes = 2 * half
    path = Path(folder) / f".mt-ray-disk-probe-{uuid.uuid4().hex[:8]}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    io = build_file_io(direct=True)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        name = f"/proc/self/fd/{fd}"
        path.unlink()
        io.open(name, f"the disk probe in {folder}")
        buf = aligned_empty(nbytes)
        buf.fill_(1)  # touch every page before timing
        write = _timed(lambda: [io.write(name, buf, 0)])
        read = _timed(lambda: [io.read(name, buf, 0)])
        mixed = _timed(lambda: [p for at in range(0, half, MIXED_PIECE) for p in (
            io.read(name, buf[at : min(at + MIXED_PIECE, half)], at),
            io.write(name, buf[half + at : half + min(at + MIXED_PIECE, half)], half + at))])
    finally:
        io.close()
        os.close(fd)
        path.unlink(missing_ok=True)
    return DiskSpeed(nbytes / read / 1e9, nbytes / write / 1e9, nbytes / mixed / 1e9)


def _timed(submit: Callable[[], list[Pending]]) -> float:
    """Seconds from submitting the requests to the last one done."""
    t0 = time.perf_counter()
    for pending in submit():
        pending.wait()
    return time.perf_counter() - t0


class StateIOError(OSError):
    """Reading or writing a state file failed (a full or failing disk): training cannot go on."""


class Pending:
    """The requests of one read or write; `wait` returns once all are done, or raises the first failure."""

    def __init__(self, futures: list[Future], what: str):
        self.futures = futures
        self.what = what

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def wait(self) -> None:
        for f in self.futures:
            try:
                f.result()
            except OSError as e:
                raise StateIOError(e.errno, f"{self.what} failed: {e.strerror or e}. The disk is full or failing: "
                                   "free space or move engine.nvme_path, then resume from the last checkpoint "
                                   "(it is kept apart from the state files and stays valid)") from e


class FileIO:
    """Positional reads and writes of aligned buffers at aligned offsets of a set of files, on a thread pool."""

    name = "buffered-pool"

    def __init__(self, direct: bool, threads: int = IO_THREADS):
        self.direct = direct
        self.name = "odirect-pool" if direct else "buffered-pool"
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="mt-ray-state-io")
        self._fds: dict[str, int] = {}
        self._labels: dict[str, str] = {}

    def open(self, path: str, label: str) -> None:
        """Keep `path` (an existing file) open for the requests that name it; errors name it `label`."""
        self._labels[path] = label
        self._fds[path] = os.open(path, os.O_RDWR | (os.O_DIRECT if self.direct else 0))

    def read(self, path: str, buf: torch.Tensor, offset: int) -> Pending:
        return Pending(self._split(os.preadv, path, buf, offset), f"reading {self._labels[path]}")

    def write(self, path: str, buf: torch.Tensor, offset: int) -> Pending:
        return Pending(self._split(os.pwritev, path, buf, offset), f"writing {self._labels[path]}")

    def _split(self, op: Callable, path: str, buf: torch.Tensor, offset: int) -> list[Future]:
        fd, view = self._fds[path], _bytes(buf)
        return [self._pool.submit(_whole, op, fd, view[p : p + IO_CHUNK], offset + p)
                for p in range(0, len(view), IO_CHUNK)]

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class AioIO(FileIO):
    """DeepSpeed's async I/O op: one handle per pool thread, each running one whole request (libaio, O_DIRECT)."""

    name = "deepspeed-aio"

    def __init__(self, threads: int = IO_THREADS):
        from deepspeed.ops.op_builder import AsyncIOBuilder

        self._lib = AsyncIOBuilder().load(verbose=False)
        super().__init__(direct=True, threads=threads)
        self.name = "deepspeed-aio"
        self._local = threading.local()

    def open(self, path: str, label: str) -> None:
        """Nothing to keep open: the op opens the file by name for each request."""
        self._labels[path] = label

    def read(self, path: str, buf: torch.Tensor, offset: int) -> Pending:
        return Pending([self._pool.submit(self._run, "sync_pread", buf, path, offset)], f"reading {self._labels[path]}")

    def write(self, path: str, buf: torch.Tensor, offset: int) -> Pending:
        return Pending([self._pool.submit(self._run, "sync_pwrite", buf, path, offset)], f"writing {self._labels[path]}")

    def _run(self, op: str, buf: torch.Tensor, path: str, offset: int) -> None:
        if not hasattr(self._local, "handle"):  # a handle is not safe to share between threads
            self._local.handle = self._lib.aio_handle(1 << 20, 32, False, True, 1)
        if getattr(self._local.handle, op)(buf, path, offset) < 0:
            raise OSError(errno.EIO, f"deepspeed aio {op} returned an error")


def build_file_io(direct: bool) -> FileIO:
    """DeepSpeed's aio op where it is compatible and loads (direct I/O only), else the positional pool."""
    if direct:
        why = _aio_unavailable()
        if why is None:
            return AioIO()
        log.info("optimizer state I/O: the O_DIRECT thread pool (DeepSpeed's aio op: %s)", why)
    return FileIO(direct)


def _aio_unavailable() -> str | None:
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        if not AsyncIOBuilder().is_compatible(verbose=False):
            return "not compatible here (libaio-dev missing?)"
        AsyncIOBuilder().load(verbose=False)
    except Exception as e:  # deepspeed raises assorted errors when an op cannot build
        return f"unavailable: {type(e).__name__}: {e}"[:200]
    return None


def _whole(op: Callable, fd: int, view: memoryview, offset: int) -> None:
    """Run a positional read or write to the end of `view` (the kernel may move fewer bytes per call)."""
    done = 0
    while done < len(view):
        n = op(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, "unexpected end of file" if n == 0 else "I/O error")
        done += n


def _bytes(buf: torch.Tensor) -> memoryview:
    return memoryview(buf.numpy()).cast("B")
