"""Where a streamed step's hidden states wait between blocks: on the device, or in pinned host memory.

The streaming schedule runs every micro-batch through one block of K layers at a time, so each
micro-batch's hidden state waits between blocks: the input of every block (the checkpoints the
backward recomputes from), the last block's output until the head, then the gradient that flows
back from block to block. `EngineConfig.checkpoint_placement` decides where they wait:

  device  they stay device tensors: device memory grows with the step's tokens
          (L/K + 1 hidden states per token).
  host    each is copied to a pinned host slab on the d2h stream as soon as it is made and is
          fetched back on the h2d stream a few gets ahead of use, so the device holds a few
          micro-batches' hidden states however many tokens the step has.

Both follow the step's plan (every put and get in order, known before the step starts), as the
weight streamer follows its upload plan: a fetch is issued ahead only once the put it reads has
been, a get right after a put of the same key takes that put's device tensor (no round trip,
which is every forward get when a step is one micro-batch), and a device tensor is dropped at
its last get. On CPU the same code runs with no streams: copies are synchronous.

Use (any schedule whose order of parked tensors is known before the step, not only this one):
`store = build_activation_store(placement, streams, dtype)`; per step `store.start(plan, numels)`
with `plan` a list of ("put" | "get", (slot, micro-batch)) and `numels[j]` micro-batch j's size,
then `store.put(key, x)` / `x = store.get(key)` in exactly that order (a broken order raises);
`store.close()` at the end. `streamed_step_plan` is the streaming engine's plan.
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import Literal

import torch

from mt_ray.engine.host_store import GIB, available_host_bytes
from mt_ray.engine.pinning import host_empty, unregister_pinned
from mt_ray.engine.transfer import Outbox, StreamSet
from mt_ray.errors import InsufficientMemoryError

Key = tuple[int, int]  # (slot, micro-batch)
Op = tuple[Literal["put", "get"], Key]

# Host placement: fetches in flight ahead of use (two micro-batches of a backward block, which
# reads a checkpoint and a gradient each, so the next ones are queued before the block's weight
# uploads), and puts kept alive on the device until their copy to the host has run.
READS_AHEAD = 4
PUTS_KEPT = 2


def host_placement_device_hiddens() -> int:
    """Micro-batch hidden states the host placement holds on the device at most (for the calculator):
    the fetches in flight, the checkpoint and gradient in use, and the puts awaiting their copy."""
    return READS_AHEAD + 2 + PUTS_KEPT


class ActivationStore:
    """Device placement: parked hidden states stay device tensors until their last get."""

    def __init__(self) -> None:
        self._plan: list[Op] = []
        self._pos = 0
        self._held: dict[Key, torch.Tensor] = {}
        self._final_gets: set[int] = set()

    def start(self, plan: list[Op], numels: list[int]) -> None:
        """Begin a step: `plan` is every put and get in order; `numels[j]` is micro-batch j's hidden-state size."""
        if self._pos < len(self._plan):
            raise RuntimeError(f"previous step left {len(self._plan) - self._pos} activation puts/gets undone")
        self._plan, self._pos = plan, 0
        self._final_gets = _final_gets(plan)

    def put(self, key: Key, x: torch.Tensor) -> None:
        self._advance("put", key)
        self._held[key] = x

    def get(self, key: Key) -> torch.Tensor:
        i = self._advance("get", key)
        return self._held.pop(key) if i in self._final_gets else self._held[key]

    def close(self) -> None:
        self._held.clear()

    def _advance(self, op: str, key: Key) -> int:
        i = self._pos
        if i >= len(self._plan) or self._plan[i] != (op, key):
            expected = self._plan[i] if i < len(self._plan) else "nothing"
            raise RuntimeError(f"activation order broken: expected {expected}, got {(op, key)}")
        self._pos += 1
        return i


class HostActivationStore(ActivationStore):
    """Host placement: puts are copied to a pinned slab, gets fetched back ahead of use.

    The slab is allocated and page-locked at the first step and reused; it grows only when a
    step has more tokens than any before. Within a step each (slot, micro-batch) owns a region.
    """

    def __init__(self, streams: StreamSet, dtype: torch.dtype, host_memory_limit_gb: float | None = None):
        super().__init__()
        self.streams = streams
        self.dtype = dtype
        self.limit_gb = host_memory_limit_gb
        self.slab = torch.empty(0, dtype=dtype)
        self._pinned = False
        self._regions: dict[Key, tuple[int, int]] = {}
        self._shapes: dict[Key, torch.Size] = {}
        self._landed: dict[Key, torch.cuda.Event | None] = {}
        self._fetches: deque[tuple[int, torch.Tensor, torch.cuda.Event | None]] = deque()
        self._walk = 0
        self._newest: torch.Tensor | None = None
        self._on_device: set[int] = set()
        self._to_host: set[int] = set()
        self._outbox = Outbox(streams, keep=PUTS_KEPT)

    def start(self, plan: list[Op], numels: list[int]) -> None:
        super().start(plan, numels)
        slots = 1 + max(key[0] for _, key in plan)
        step = sum(numels)
        starts = [0, *itertools.accumulate(numels)]
        self._regions = {(s, j): (s * step + starts[j], n) for s in range(slots) for j, n in enumerate(numels)}
        self._ensure_slab(slots * step)
        self._on_device, self._to_host = _routes(plan)
        self._walk = 0
        self._top_up()

    def put(self, key: Key, x: torch.Tensor) -> None:
        i = self._advance("put", key)
        if x.dtype != self.dtype or x.numel() != self._regions[key][1]:
            raise RuntimeError(f"hidden state {key} is {x.dtype} {tuple(x.shape)}; its slab region holds "
                               f"{self._regions[key][1]} values of {self.dtype}")
        self._shapes[key] = x.shape
        self._newest = x
        if i in self._to_host:
            self._landed[key] = self._copy_out(key, x)
        self._top_up()

    def get(self, key: Key) -> torch.Tensor:
        i = self._advance("get", key)
        if i in self._on_device:
            x = self._newest
        else:
            if not self._fetches or self._fetches[0][0] != i:
                raise RuntimeError(f"activation fetch order broken at {key}")
            _, x, ready = self._fetches.popleft()
            self.streams.wait(self.streams.compute, ready)  # compute waits for this fetch only
        if self._pos == len(self._plan):
            self._newest = None
        self._top_up()
        return x

    def close(self) -> None:
        super().close()
        self._free_slab()

    def _copy_out(self, key: Key, x: torch.Tensor) -> torch.cuda.Event | None:
        made = self.streams.record(self.streams.compute)
        with self.streams.on(self.streams.d2h):
            self.streams.wait(self.streams.d2h, made)  # x is fully computed
            self._region(key).copy_(x.reshape(-1), non_blocking=True)
            landed = self.streams.record(self.streams.d2h)
        self._outbox.add(x, landed)  # keeps x alive until the copy has read it
        return landed

    def _top_up(self) -> None:
        """Fetch ahead up to READS_AHEAD gets; stop at a get whose put has not been issued yet."""
        pending = {key for op, key in self._plan[self._pos : self._walk] if op == "put"}
        while self._walk < len(self._plan) and len(self._fetches) < READS_AHEAD:
            op, key = self._plan[self._walk]
            if op == "put":
                pending.add(key)
            elif self._walk not in self._on_device:
                if key in pending:
                    return
                self._fetches.append((self._walk, *self._fetch(key)))
            self._walk += 1

    def _fetch(self, key: Key) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        # Allocated on the compute stream, so once the engine drops it the block returns to that
        # stream's pool, where reuse is ordered after its last use: no record_stream.
        x = torch.empty(self._shapes[key], dtype=self.dtype, device=self.streams.device)
        with self.streams.on(self.streams.h2d):
            # The block may have been freed by compute work that is still queued.
            self.streams.wait(self.streams.h2d, self.streams.record(self.streams.compute))
            self.streams.wait(self.streams.h2d, self._landed[key])  # the put has reached the slab
            x.copy_(self._region(key).view(x.shape), non_blocking=True)  # pinned source: async DMA
            ready = self.streams.record(self.streams.h2d)
        return x, ready

    def _region(self, key: Key) -> torch.Tensor:
        off, n = self._regions[key]
        return self.slab[off : off + n]

    def _ensure_slab(self, numel: int) -> None:
        if self.slab.numel() >= numel:
            return
        self._free_slab()
        need, have = numel * self.dtype.itemsize, available_host_bytes(self.limit_gb)
        if need > have:
            raise InsufficientMemoryError(
                f"checkpoint_placement: host needs {need / GIB:.1f} GiB of pinned host memory for this step's "
                f"hidden states but {have / GIB:.1f} GiB is available; use fewer tokens per step, a larger "
                "engine.checkpoint_every (fewer checkpoints) or engine.checkpoint_placement: device "
                "(`mt-ray calc` finds a configuration that fits)"
            )
        self.slab = host_empty(numel, self.dtype, self.streams.cuda)  # pinned once, reused every step
        self._pinned = self.streams.cuda

    def _free_slab(self) -> None:
        if self._pinned:
            # Copies of earlier steps may still read or write the slab: rare (a bigger step, or close).
            torch.cuda.synchronize(self.streams.device)
            unregister_pinned(self.slab)
            self._pinned = False
        self.slab = torch.empty(0, dtype=self.dtype)


def build_activation_store(placement: str, streams: StreamSet, dtype: torch.dtype,
                           host_memory_limit_gb: float | None = None) -> ActivationStore:
    if placement == "host":
        return HostActivationStore(streams, dtype, host_memory_limit_gb)
    return ActivationStore()


def streamed_step_plan(n_blocks: int, n_micro: int, train: bool, reference: bool = False) -> list[Op]:
    """Every put and get of a streamed step's parked hidden states, in the order the engine makes them.

    Slot b < n_blocks holds block b's checkpoint (its input), slot n_blocks the carry: the last block's
    output, then the gradient flowing back. Forward: every micro-batch's embedding, then block by block
    each micro-batch's checkpoint read and the next one written. Training then runs the head (carry
    read, gradient written) and each block backward from the last (checkpoint and gradient read, the
    gradient of its input written); the embedding's backward reads the last gradient. An evaluation
    reads the carry once, for the loss.

    With a `reference` (preference training), slot n_blocks + 1 holds the reference model's hidden state:
    its embedding is put after the policy's, each block runs it forward after the policy's block (read,
    then written back), and its head reads it once before the policy's head.
    """
    carry, ref, mbs = n_blocks, n_blocks + 1, range(n_micro)
    ref_pass = [op for j in mbs for op in (("get", (ref, j)), ("put", (ref, j)))] if reference else []
    plan: list[Op] = [("put", (0, j)) for j in mbs] + ([("put", (ref, j)) for j in mbs] if reference else [])
    for b in range(n_blocks):
        plan += [op for j in mbs for op in (("get", (b, j)), ("put", (b + 1, j)))] + ref_pass
    plan += [("get", (ref, j)) for j in mbs] if reference else []
    if not train:
        return plan + [("get", (carry, j)) for j in mbs]
    plan += [op for j in mbs for op in (("get", (carry, j)), ("put", (carry, j)))]
    for b in reversed(range(n_blocks)):
        plan += [op for j in mbs for op in (("get", (b, j)), ("get", (carry, j)), ("put", (carry, j)))]
    return plan + [("get", (carry, j)) for j in mbs]


def _final_gets(plan: list[Op]) -> set[int]:
    """Gets after which their key is not read again before it is put again."""
    final, read_later = set(), set()
    for i in reversed(range(len(plan))):
        op, key = plan[i]
        if op == "put":
            read_later.discard(key)
        elif key not in read_later:
            final.add(i)
            read_later.add(key)
    return final


def _routes(plan: list[Op]) -> tuple[set[int], set[int]]:
    """Which gets take the newest put's device tensor, and which puts some later get reads from the slab."""
    on_device, to_host = set(), set()
    newest: Key | None = None
    last_put: dict[Key, int] = {}
    for i, (op, key) in enumerate(plan):
        if op == "put":
            newest, last_put[key] = key, i
        elif key == newest:
            on_device.add(i)
        else:
            to_host.add(last_put[key])
    return on_device, to_host
