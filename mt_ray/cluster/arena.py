"""A node's shared-memory arena: the weights its workers stream and the gradients they land.

One arena per node, created and owned by the node's coordinator shard. It is an anonymous
memfd, so it needs no name in /dev/shm, is not capped by a container's small /dev/shm, and
its pages go back to the kernel once the shard and every worker that mapped it are gone: a
killed run leaves nothing behind. Workers on the node map it through /proc/<shard pid>/fd/<fd>
and page-lock the whole mapping once, so every upload from it is an asynchronous DMA.

Nothing model-sized is copied or put per step:
- **weights.** The shard's own units are its fp32 master itself (the HostStore's master is a
  view of the arena): the optimizer updates them in place, workers stream fp32 and cast on the
  GPU, as the single engine does with `stream_master`. Other shards' units (several nodes)
  are copied in, in the compute dtype, as their owners publish them: one unit at a time.
- **versions.** One int64 word per unit says which step's weights it holds. The optimizer
  updates a unit only once every local worker's gradient of it is in, which each worker sends
  after its last upload of the unit in the step has landed, so no upload ever reads a unit
  being written. A worker waits for a word to reach its step before uploading.
- **gradients.** Every trained unit the shard owns has a slot in the gradient dtype, where its step's sum waits
  for the optimizer (with clipping, until every gradient of the step is in). The node's first worker lands its
  device->host copy of an owned unit straight in the slot (a lone worker's is then used as it is); its copy of a
  unit another node owns goes, whole, into the node's **pool** (a ring of a few of the largest such units,
  `pool_numel`): the node's sum of it is made there and leaves once `ray.put` has copied it for the owner, so a
  node holds slots for its own part of the model alone. Each further worker lands in a ring of its own (a fixed
  size, at most RING_CAP_MB), in pieces of a quarter of the ring, and the shard adds each piece, in rank order,
  into the first worker's landing (slot or pool).
- **acknowledgements.** A ring of words per local worker: the shard writes `seq + 1` at `seq % ACK_WORDS` once
  what the worker reported as its `seq`-th landing is summed (a ring piece: its part of the ring may be reused). A
  worker's report is a one-way message (`put_grad` returns at once), so no shard thread is held per gradient and
  no model depth can leave a worker without one; the worker reads its acknowledgements here.
- **reference.** A preference stage's frozen starting weights (`training.stage: dpo | kto` with a loss
  that needs them), every unit in the compute dtype, written by the shard as it loads the weights:
  held once per node however many workers stream from it, never versioned (nothing updates them).

- **bell.** A header word the shard bumps, then wakes (a futex on the shared mapping), whenever it writes
  a version, an acknowledgement, the generation or the state. A reader waiting for any of them (a worker's
  engine thread for a unit's weights, its ack thread for an acknowledgement, a rollout replica) sleeps on the
  bell, never in a poll: `wait_until`, bounded, and woken in slices of WAKE_SLICE_S at most so that a wake
  missed on a weakly ordered CPU costs a slice, never the bound.

Layout (byte offsets, each region 4 KiB-aligned, computed once by the driver, mt_ray.cluster.run_spec):
header words (generation, state, bell, one version per unit), acknowledgements, weights, reference, gradient
slots, pool, rings.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mt_ray.cluster.errors import ClusterError, StaleGenerationError
from mt_ray.cluster.partition import ShardPlan
from mt_ray.engine.host_store import GIB, available_host_bytes
from mt_ray.errors import InsufficientMemoryError
from mt_ray.models.discovery import ModelSpec

ALIGN = 4096
PRESENT = 1 << 62  # the version word of a frozen unit once its weights are in: any step may read it
ABSENT = -1  # a unit whose weights this generation has not yet received
RUNNING, STOPPED, FAILED = 0, 1, 2
SLOT = -1  # where the node's first worker's gradient lands: in the unit's slot (`put_grad` takes a ring offset otherwise)
_GENERATION, _STATE, _BELL, _HEADER = 0, 1, 2, 3  # header word indices; versions follow
WAKE_SLICE_S = 0.05  # the longest a wait on the bell sleeps before it looks again (a missed wake costs this)
# A further worker's gradient ring holds two of the largest layers' gradients (a K-layer block's burst lands while
# the shard sums), at most this many MiB: 0.9 GiB at the 7B shape in bf16.
RING_CAP_MB = 1024
RING_PIECES = 4  # a ring holds this many pieces: the shard sums one while the worker lands the next
ACK_WORDS = 1024  # acknowledgement words per local worker: at most this many reports outstanding
FORWARD_INFLIGHT = 2  # partial sums a node has sent one owner that are not yet summed there
# Units another node owns whose node sum a node holds at once in its pool: those sent and waiting for room at their
# owner (FORWARD_INFLIGHT), one being summed here and one landing.
POOL_UNITS = FORWARD_INFLIGHT + 2


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


# futex(2) on the bell's low 32 bits (little-endian hosts): shared, so the shard's wake reaches other processes.
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98, "ppc64le": 221, "riscv64": 98}.get(platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _check_futex() -> None:
    if _SYS_FUTEX is None or sys.byteorder != "little":
        raise ClusterError(f"the node's arena waits on a futex, which this host ({platform.machine()}, "
                           f"{sys.byteorder}-endian) is not known to offer; run the cluster on x86_64 or aarch64")


def _futex_wait(addr: int, seen: int, timeout_s: float) -> None:
    """Sleep while the 32-bit word at `addr` still holds `seen`, at most `timeout_s` (the GIL is released)."""
    ts = _Timespec(int(timeout_s), int((timeout_s % 1) * 1e9))
    _libc.syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(addr), ctypes.c_long(_FUTEX_WAIT),
                  ctypes.c_long(seen), ctypes.byref(ts), None, ctypes.c_long(0))


def _futex_wake(addr: int) -> None:
    """Wake every process's waits on the 32-bit word at `addr`."""
    _libc.syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(addr), ctypes.c_long(_FUTEX_WAKE),
                  ctypes.c_long(2**31 - 1), None, None, ctypes.c_long(0))


def ring_numel(spec: ModelSpec, grad_dtype: torch.dtype, cap_mb: float | None = None) -> int:
    """Elements of one further worker's gradient ring: two of the largest layers (the largest trained unit where
    there are no layers), capped at `cap_mb` MiB (default RING_CAP_MB). Gradients land in it in pieces of a
    quarter of it (`ArenaLayout.pieces`), so a unit larger than the ring still lands, and the ring's size is a
    fixed per-worker cost rather than a model-sized one."""
    layers = [u.numel for u in spec.trainable_units if u.name.startswith("layers.")]
    wanted = 2 * max(layers) if layers else max(u.numel for u in spec.trainable_units)
    cap = int((RING_CAP_MB if cap_mb is None else cap_mb) * 2**20) // grad_dtype.itemsize
    return max(RING_PIECES, min(wanted, cap))


def pool_numel(spec: ModelSpec, plan: ShardPlan, shard: int) -> int:
    """Elements of shard `shard`'s pool, where its node sums the trained units another node owns: POOL_UNITS of the
    largest such layers, and at least the largest such unit (an embedding or a head lands whole); never more than
    all of them. 0 on one node."""
    owned = {u.name for u in plan.units_of(shard)}
    remote = [u.numel for u in spec.trainable_units if u.name not in owned]
    if not remote:
        return 0
    layers = [u.numel for u in spec.trainable_units if u.name not in owned and u.name.startswith("layers.")]
    return min(sum(remote), max(max(remote), POOL_UNITS * max(layers or remote)))


@dataclass(frozen=True)
class ArenaLayout:
    """Where everything lives in one node's arena, in bytes."""

    units: tuple[str, ...]
    num_local: int  # workers landing gradients on the node (one acknowledgement ring each)
    weight_offsets: dict[str, int]
    weight_dtypes: dict[str, torch.dtype]
    numels: dict[str, int]
    master_offset: int  # the shard's own units, contiguous, fp32: its HostStore master
    master_numel: int
    ref_offsets: dict[str, int]  # a preference stage's reference, each unit in the compute dtype (empty: none)
    ref_dtype: torch.dtype
    grad_offsets: dict[str, int]  # the owned trained units' slots
    grad_dtype: torch.dtype
    pool_offset: int
    pool_numel: int
    ring_offset: int
    ring_numel: int
    num_rings: int
    nbytes: int

    @classmethod
    def build(cls, spec: ModelSpec, plan: ShardPlan, shard: int, dtype: torch.dtype, grad_dtype: torch.dtype,
              num_local: int, ring: int | None = None, reference: bool = False) -> ArenaLayout:
        """The layout of shard `shard`'s node: `num_local` workers, the compute `dtype` for other shards' units
        (and the `reference`, when the stage streams one), rings of `ring` elements (default `ring_numel`'s)."""
        owned = {u.name for u in plan.units_of(shard)}
        off = _align(8 * (_HEADER + len(spec.units) + num_local * ACK_WORDS))
        weight_offsets, weight_dtypes, master_offset = {}, {}, None
        for u in spec.units:  # owned units are contiguous in model order: one fp32 run, the master
            weight_dtypes[u.name] = torch.float32 if u.name in owned else dtype
            if u.name in owned and master_offset is None:
                master_offset = off
            weight_offsets[u.name] = off
            off += u.numel * weight_dtypes[u.name].itemsize
            if u.name not in owned:
                off = _align(off)
        off = _align(off)
        ref_offsets = {}
        for u in spec.units if reference else ():
            ref_offsets[u.name] = off
            off = _align(off + u.numel * dtype.itemsize)
        grad_offsets = {}
        for u in spec.trainable_units:
            if u.name in owned:
                grad_offsets[u.name] = off
                off = _align(off + u.numel * grad_dtype.itemsize)
        pool_offset, pool = off, pool_numel(spec, plan, shard)
        off = _align(off + pool * grad_dtype.itemsize)
        rings = num_local - 1  # the node's first worker lands in the slots and the pool
        ring = ring or ring_numel(spec, grad_dtype)
        return cls(tuple(u.name for u in spec.units), num_local, weight_offsets, weight_dtypes,
                   {u.name: u.numel for u in spec.units}, master_offset or 0, sum(u.numel for u in spec.units
                                                                                  if u.name in owned),
                   ref_offsets, dtype, grad_offsets, grad_dtype, pool_offset, pool, off, ring, rings,
                   off + rings * _align(ring * grad_dtype.itemsize))

    @property
    def reference_bytes(self) -> int:
        """Bytes of the reference region (0 where the stage streams none)."""
        if not self.ref_offsets:
            return 0
        last = self.units[-1]
        return _align(self.ref_offsets[last] + self.numels[last] * self.ref_dtype.itemsize) - self.ref_offsets[self.units[0]]

    @property
    def slot_bytes(self) -> int:
        """Bytes of the owned units' gradient slots."""
        return self.pool_offset - min(self.grad_offsets.values(), default=self.pool_offset)

    @property
    def pool_bytes(self) -> int:
        return _align(self.pool_numel * self.grad_dtype.itemsize)

    @property
    def ring_bytes(self) -> int:
        return _align(self.ring_numel * self.grad_dtype.itemsize)

    def pieces(self, numel: int) -> list[tuple[int, int]]:
        """The [lo, hi) element ranges a gradient of `numel` elements lands in through a ring: a quarter of the ring
        each, so pieces land while the shard sums the ones before."""
        size = max(1, self.ring_numel // RING_PIECES)
        return [(lo, min(lo + size, numel)) for lo in range(0, numel, size)]


@dataclass(frozen=True)
class ArenaHandle:
    """What an actor on the node needs to map its arena: the shard's process, the arena's descriptor and its
    layout (the driver's, which the shard created the arena with)."""

    pid: int
    fd: int
    layout: ArenaLayout

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes


class NodeArena:
    """Typed views of one node's arena; `create` in the shard, `attach` in each worker."""

    def __init__(self, layout: ArenaLayout, fd: int):
        _check_futex()
        self.layout = layout
        self._fd = fd
        self._map = mmap.mmap(fd, layout.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        units = len(layout.units)
        self.words = self.bytes[: 8 * (_HEADER + units + layout.num_local * ACK_WORDS)].view(torch.int64)
        self.versions = self.words[_HEADER : _HEADER + units]
        self.acks = self.words[_HEADER + units :].view(layout.num_local, ACK_WORDS)
        self._index = {u: i for i, u in enumerate(layout.units)}
        self._bell_addr = self.words[_BELL:].data_ptr()
        self._ring = threading.Lock()  # the shard's threads bump the bell one at a time

    @classmethod
    def create(cls, layout: ArenaLayout, host_memory_limit_gb: float | None = None) -> NodeArena:
        """A new zeroed arena, refused up front when the node cannot hold it."""
        free = available_host_bytes(host_memory_limit_gb)
        if layout.nbytes > free:
            raise InsufficientMemoryError(
                f"the node's shared-memory arena needs {layout.nbytes / GIB:.1f} GiB (fp32 state's master, the "
                f"gradients, a pool of {layout.pool_bytes / GIB:.1f} GiB, {layout.num_rings} worker rings, a reference of {layout.reference_bytes / GIB:.1f} GiB) "
                f"but only {free / GIB:.1f} GiB is free; spread the "
                "state over more nodes (cluster.num_nodes), run fewer workers per node, or use a larger host")
        fd = os.memfd_create("mt-ray-arena", os.MFD_CLOEXEC)
        os.ftruncate(fd, layout.nbytes)
        arena = cls(layout, fd)
        arena.versions.fill_(ABSENT)
        return arena

    @classmethod
    def attach(cls, handle: ArenaHandle) -> NodeArena:
        """Map the arena the shard of this node created, with the layout it was created with."""
        try:
            fd = os.open(f"/proc/{handle.pid}/fd/{handle.fd}", os.O_RDWR)
        except OSError as e:
            raise ClusterError(f"cannot map the node's arena from the shard's process {handle.pid} ({e}): a worker "
                               "must run on its coordinator shard's node, as the same user") from e
        return cls(handle.layout, fd)

    def handle(self) -> ArenaHandle:
        return ArenaHandle(os.getpid(), self._fd, self.layout)

    # ------------------------------------------------------------------ views

    def _view(self, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.bytes[offset : offset + numel * dtype.itemsize].view(dtype)

    def weights(self, unit: str) -> torch.Tensor:
        """The unit's streamed weights: fp32 master for the shard's own units, compute dtype for the others'."""
        lay = self.layout
        return self._view(lay.weight_offsets[unit], lay.numels[unit], lay.weight_dtypes[unit])

    def master(self) -> torch.Tensor:
        """The shard's own units' fp32 weights, contiguous: its HostStore's master buffer."""
        return self._view(self.layout.master_offset, self.layout.master_numel, torch.float32)

    def reference(self, unit: str) -> torch.Tensor:
        """The unit's reference weights (a preference stage's frozen starting weights), in the compute dtype."""
        lay = self.layout
        return self._view(lay.ref_offsets[unit], lay.numels[unit], lay.ref_dtype)

    def grad(self, unit: str) -> torch.Tensor:
        """An owned unit's gradient slot (where the node's first worker lands it, and where its sum goes)."""
        return self._view(self.layout.grad_offsets[unit], self.layout.numels[unit], self.layout.grad_dtype)

    def weights_region(self) -> torch.Tensor:
        """The bytes that hold the streamed weights, whole pages: all a reader of the weights needs page-locked (not
        the gradients and rings the workers land)."""
        lay = self.layout
        lo = min(lay.weight_offsets.values())
        hi = max(off + lay.numels[u] * lay.weight_dtypes[u].itemsize for u, off in lay.weight_offsets.items())
        return self.bytes[lo : min(_align(hi), lay.nbytes)]

    def pool(self) -> torch.Tensor:
        """Where the node's first worker lands the units other nodes own, whole, and the shard sums them."""
        return self._view(self.layout.pool_offset, self.layout.pool_numel, self.layout.grad_dtype)

    def ring(self, rank: int) -> torch.Tensor:
        """Local worker `rank`'s gradient ring (rank 0 has none: it lands in the slots and the pool)."""
        lay = self.layout
        if not 0 < rank <= lay.num_rings:
            raise IndexError(f"local worker {rank} has no ring; the node has rings for workers 1 to {lay.num_rings}")
        return self._view(lay.ring_offset + (rank - 1) * lay.ring_bytes, lay.ring_numel, lay.grad_dtype)

    # ------------------------------------------------------------------ header

    def begin(self, generation: int) -> None:
        self.acks.zero_()  # the new generation's workers count their reports from 0
        self.words[_GENERATION] = generation
        self.words[_STATE] = RUNNING
        self._ring_bell()

    def state(self) -> tuple[int, int]:
        """(generation, state) as the header says now."""
        return int(self.words[_GENERATION]), int(self.words[_STATE])

    def ack(self, local_rank: int, seq: int) -> None:
        """The shard has summed local worker `local_rank`'s `seq`-th report of this generation."""
        self.acks[local_rank, seq % ACK_WORDS] = seq + 1
        self._ring_bell()

    def acked(self, local_rank: int, seq: int) -> bool:
        return int(self.acks[local_rank, seq % ACK_WORDS]) == seq + 1

    def set_state(self, state: int) -> None:
        self.words[_STATE] = state
        self._ring_bell()

    def set_version(self, unit: str, version: int) -> None:
        self.versions[self._index[unit]] = version
        self._ring_bell()

    def version(self, unit: str) -> int:
        return int(self.versions[self._index[unit]])

    def wait_version(self, unit: str, version: int, generation: int, timeout_s: float) -> None:
        """Block until `unit` holds the weights after `version` steps; a stopped generation, a failed shard or
        `timeout_s` end the wait with an error naming the unit."""
        i = self._index[unit]
        if not self.wait_until(lambda: int(self.versions[i]) >= version, timeout_s, self.running_check(generation)):
            raise ClusterError(f"unit {unit} did not reach step {version} within cluster.step_timeout_s="
                               f"{timeout_s:g} s (it holds step {int(self.versions[i])}): a worker or shard is "
                               "hung; raise cluster.step_timeout_s if steps are this slow")

    def running_check(self, generation: int) -> Callable[[], None]:
        """A wait's check that `generation` still runs: StaleGenerationError once it is stopped or replaced,
        ClusterError once the shard has failed."""
        def check() -> None:
            if int(self.words[_GENERATION]) != generation or int(self.words[_STATE]) == STOPPED:
                raise StaleGenerationError(f"generation {generation} was stopped")
            if int(self.words[_STATE]) == FAILED:
                raise ClusterError("the node's coordinator shard failed (its sum or optimizer); see its log")
        return check

    def wait_until(self, ready: Callable[[], bool], timeout_s: float, check: Callable[[], None]) -> bool:
        """Sleep on the bell until `ready()` (True) or `timeout_s` has passed (False); `check()` runs at each wake
        and raises to end the wait (a stopped generation, a failed shard). No poll: the shard wakes the bell as it
        writes a word."""
        deadline = time.monotonic() + timeout_s
        while True:
            seen = int(self.words[_BELL]) & 0xFFFFFFFF  # read first: any write after it changes the bell
            if ready():
                return True
            check()
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            _futex_wait(self._bell_addr, seen, min(left, WAKE_SLICE_S))

    def _ring_bell(self) -> None:
        """After a header write: bump the bell and wake every wait on it (on this node, any process)."""
        with self._ring:
            self.words[_BELL] += 1
        _futex_wake(self._bell_addr)
