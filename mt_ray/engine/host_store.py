"""Host-memory home of the training state, and the seam to the state kept on NVMe.

Every unit (embedding, each decoder layer, final norm + head) owns one contiguous slice of
four big host buffers: the fp32 master weights, the fp32 Adam moments m and v, and the copy
that is streamed to the device (in the compute dtype, or no copy at all when the fp32 master
is streamed and cast on the device). A frozen unit (a frozen vision tower) has no slice of
the moments: it is never updated. One allocation per buffer keeps pinning cheap: a single
`cudaHostRegister` call covers the whole streamed buffer.

Under `engine.state_placement: nvme` the master and moments live in files instead (state_files.py)
and host memory keeps the streamed copy and a window of chunk slots; `nvme_moments` keeps the
master here and only the moments on disk. The optimizer reaches a chunk's master and moments only
through the store's state tier (`chunk`, then `chunk_updated`): views here (`HostTier`), or a slot
read from disk and written back (`FileTier`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import psutil
import torch

from mt_ray.engine.bf16_words import WORD_DTYPES
from mt_ray.engine.config import EngineConfig
from mt_ray.engine.device_state import DeviceState
from mt_ray.engine.direct_io import build_file_io, probe_direct_io
from mt_ray.engine.pinning import register_pinned, unregister_pinned
from mt_ray.engine.state_files import (
    FILE_CHUNK_NUMEL,
    ChunkState,
    FilePlan,
    FileTier,
    check_state_path,
    free_bytes,
    plan_files,
    window_bytes,
)
from mt_ray.errors import CheckpointError, InsufficientMemoryError
from mt_ray.models.discovery import Mirror, ModelSpec, UnitSpec

GIB = 1024**3


@dataclass(frozen=True)
class StoreLayout:
    """Where each unit lives inside the flat buffers, and how many bytes each parameter costs."""

    offsets: dict[str, int]
    numels: dict[str, int]
    total: int
    copy_dtype: torch.dtype | None
    moment_offsets: dict[str, int] = field(default_factory=dict)
    """Each trained unit's slice of the Adam moments (frozen units have none)."""
    moment_total: int = 0

    @property
    def bytes_per_param(self) -> float:
        """Host bytes per parameter, averaged over trained and frozen units."""
        return self.nbytes / max(1, self.total)

    @property
    def nbytes(self) -> int:
        copy = torch.empty((), dtype=self.copy_dtype).element_size() if self.copy_dtype else 0
        return (4 + copy) * self.total + 8 * self.moment_total

    def describe(self) -> dict[str, list[int]]:
        """Each unit's [offset, numel] ([offset, numel, 0] when frozen): stored with a checkpoint, which loads
        only into the same layout."""
        return {u: [off, self.numels[u]] + ([] if u in self.moment_offsets else [0]) for u, off in self.offsets.items()}

    def check_matches(self, saved: dict[str, list[int]]) -> None:
        if saved != self.describe():
            raise CheckpointError("checkpoint layout does not match this model (different architecture or config)")


def plan_layout(spec: ModelSpec, copy_dtype: torch.dtype | None, units: list[UnitSpec] | None = None) -> StoreLayout:
    """Each unit's slice of the flat buffers, in model order (`units`: a part of the model, e.g. one
    coordinator shard's, laid out from offset 0)."""
    offsets, numels, total, moment_offsets, moment_total = {}, {}, 0, {}, 0
    for unit in spec.units if units is None else units:
        offsets[unit.name] = total
        numels[unit.name] = unit.numel
        total += unit.numel
        if not unit.frozen:
            moment_offsets[unit.name] = moment_total
            moment_total += unit.numel
    return StoreLayout(offsets, numels, total, copy_dtype, moment_offsets, moment_total)


# Elements per optimizer chunk when the state is in host memory: a compute-dtype gradient is upcast
# through a scratch buffer of this size (64 MiB) rather than a copy of the whole unit. Fused AdamW
# over 16M elements takes ~15 ms on the host, so the per-chunk call is noise.
CHUNK_NUMEL = 1 << 24


@dataclass(frozen=True)
class StatePlacement:
    """Where the fp32 master and the Adam moments live (`engine.state_placement` and its settings)."""

    where: str = "host"  # host | nvme | nvme_moments
    path: str | None = None
    require_direct: bool = True
    window: int = 4
    file_chunk_numel: ClassVar[int] = FILE_CHUNK_NUMEL  # a class attribute, so tests can cut tiny units into chunks

    @property
    def on_disk(self) -> bool:
        return self.where != "host"

    @property
    def master_on_disk(self) -> bool:
        return self.where == "nvme"

    @property
    def chunk_numel(self) -> int:
        return self.file_chunk_numel if self.on_disk else CHUNK_NUMEL


HOST = StatePlacement()


def state_placement(cfg: EngineConfig) -> StatePlacement:
    """The placement `cfg` asks for."""
    return StatePlacement(cfg.state_placement, cfg.nvme_path, cfg.nvme_io == "direct", cfg.nvme_window)


def state_host_bytes(layout: StoreLayout, placement: StatePlacement, plan: FilePlan | None) -> int:
    """Host bytes of the store: everything under host placement; else the streamed copy, the master where it
    stays in RAM (`nvme_moments`) and the window of slots."""
    if not placement.on_disk:
        return layout.nbytes
    copy = torch.empty((), dtype=layout.copy_dtype).element_size() if layout.copy_dtype else 0
    master = 0 if placement.master_on_disk else 4
    return (copy + master) * layout.total + window_bytes(plan, placement.window)


def available_host_bytes(limit_gb: float | None = None) -> int:
    """Host memory this process may still use: the configured limit, else cgroup, else MemAvailable.

    On some hosts MemTotal starts small and grows as memory is touched, so the configured
    limit or the cgroup limit is preferred over what /proc/meminfo says.
    """
    if limit_gb is not None:
        return int(limit_gb * GIB) - psutil.Process().memory_info().rss
    cgroup = _cgroup_headroom()
    return cgroup if cgroup is not None else psutil.virtual_memory().available


def _cgroup_headroom() -> int | None:
    root = Path("/sys/fs/cgroup")
    try:
        limit = (root / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int((root / "memory.current").read_text().strip())
    except (OSError, ValueError):
        return None


class HostStore:
    """The streamed copy of every unit (or of `units` only) in host memory, and the fp32 master and Adam moments
    behind the state tier (`placement`: host memory, or files on NVMe)."""

    # Seams for tests: how a state folder is probed for direct I/O and for free space, and the file I/O built for it.
    probe_direct = staticmethod(probe_direct_io)
    disk_free = staticmethod(free_bytes)
    build_io = staticmethod(build_file_io)

    def __init__(self, spec: ModelSpec, copy_dtype: torch.dtype | None, pin: bool, extra_bytes: int = 0,
                 host_memory_limit_gb: float | None = None, units: list[UnitSpec] | None = None,
                 master: torch.Tensor | None = None, placement: StatePlacement = HOST):
        """`master`: an fp32 buffer of the units' size to hold the master weights in (a data-parallel node's
        shared memory, which its workers stream from) instead of one of this store's own."""
        self.spec = spec
        self.units = spec.units if units is None else units
        self.placement = placement
        self.chunk_numel = placement.chunk_numel
        if placement.master_on_disk and copy_dtype is None:
            raise ValueError("with the master on disk the store needs a streamed copy (copy_dtype)")
        self.layout = plan_layout(spec, copy_dtype, self.units)
        names = {u.name for u in self.units}
        # Each owner's mirrors in this store (`ParamInfo.tied_to`): its updates are copied into them.
        self._mirrors_of: dict[str, list[tuple[str, Mirror]]] = {}
        for unit, mirrors in spec.mirrors.items():
            for m in mirrors:
                if unit in names and m.owner in names:
                    self._mirrors_of.setdefault(m.owner, []).append((unit, m))
        plan = plan_files(self.units, placement.master_on_disk, self.chunk_numel) if placement.on_disk else None
        self._check_host_memory(state_host_bytes(self.layout, placement, plan) + extra_bytes
                                - (0 if master is None else master.nbytes), extra_bytes, host_memory_limit_gb)
        # The folder is checked (exists, writable, room, direct I/O) before any state is allocated.
        direct = check_state_path(placement.path, plan.disk_bytes, placement.require_direct, self.probe_direct,
                                  self.disk_free) if plan else False
        n = self.layout.total
        self.master = None if placement.master_on_disk else torch.empty(n, dtype=torch.float32) if master is None else master
        if self.master is not None and (self.master.shape != (n,) or self.master.dtype != torch.float32):
            raise ValueError(f"the master buffer must be {n} fp32 elements, not {tuple(self.master.shape)} {self.master.dtype}")
        moments = 0 if placement.on_disk else self.layout.moment_total
        self.exp_avg = torch.zeros(moments, dtype=torch.float32)
        self.exp_avg_sq = torch.zeros(moments, dtype=torch.float32)
        self.copy = torch.empty(n, dtype=copy_dtype) if copy_dtype is not None else None
        self._registered: list[torch.Tensor] = []
        if pin:
            self._register(self.streamed_buffer)
        self.on_device: DeviceState | None = None  # `keep_on_device`
        if plan is None:
            self.state: HostTier | FileTier = HostTier(self.layout, self.master, self.exp_avg, self.exp_avg_sq)
        else:
            host_master = None if self.master is None else {u.name: self.master_of(u.name) for u in self.units}
            self.state = FileTier(plan, placement.path, self.build_io(direct), placement.window, pin, host_master)

    def _check_host_memory(self, need: int, extra_bytes: int, limit_gb: float | None) -> None:
        have = available_host_bytes(limit_gb)
        if need > have:
            raise InsufficientMemoryError(
                f"training state needs {need / GIB:.1f} GiB of host RAM ({(need - extra_bytes) / max(1, self.layout.total):.1f}"
                f" B/param x {self.layout.total / 1e9:.2f} B params + {extra_bytes / GIB:.1f} GiB buffers) but only "
                f"{have / GIB:.1f} GiB is available. Use engine.stream_master=true (drops the compute-dtype copy), "
                "engine.state_placement: nvme (master and moments on an NVMe disk; nvme_moments: the moments only), "
                "a smaller model, or a host with more memory (engine.host_memory_limit_gb overrides detection)."
            )

    @property
    def streamed_buffer(self) -> torch.Tensor:
        """The buffer whose unit slices travel host->device each pass."""
        return self.copy if self.copy is not None else self.master

    def _slice(self, buf: torch.Tensor, unit: str) -> torch.Tensor:
        off = self.layout.offsets[unit]
        return buf[off : off + self.layout.numels[unit]]

    def master_of(self, unit: str) -> torch.Tensor:
        return self._slice(self.master, unit)

    def moments_of(self, unit: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A unit's Adam moments in host memory (host placement only)."""
        off = self.layout.moment_offsets[unit]  # KeyError for a frozen unit: it has no moments
        n = self.layout.numels[unit]
        return self.exp_avg[off : off + n], self.exp_avg_sq[off : off + n]

    def chunk(self, unit: str, lo: int, hi: int) -> ChunkState:
        """Elements [lo, hi) of a unit's master and moments (one of `state_files.chunk_bounds`), the caller's to
        update until `chunk_updated`; on the device for a unit kept there."""
        if self.on_device is not None and unit in self.on_device:
            return self.on_device.acquire(unit, lo, hi)
        return self.state.acquire(unit, lo, hi)

    def keep_on_device(self, units: list[str], device: torch.device) -> None:
        """Move the master and moments of `units` (trained, untied, host placement) to `device` for good: their
        updates run there (`DeviceState`), and these buffers are brought up to date only when read (`bring_home`)."""
        if not units:
            return
        if self.placement.on_disk or self.on_device is not None:
            raise ValueError("units are kept on the device once, with the state in host memory")
        self.on_device = DeviceState(units, lambda u: self.state.acquire(u, 0, self.layout.numels[u]), device)

    def bring_home(self) -> None:
        """Make these buffers (master, moments, streamed copy) hold the state of the units kept on the device."""
        if self.on_device is not None and self.on_device.stale_on_host:
            self.on_device.bring_home()
            for unit in self.on_device.units:
                self.refresh_copy(unit)

    def drop_device_state(self) -> None:
        """Bring the units kept on the device home for good: every update runs on the host again."""
        if self.on_device is not None:
            self.bring_home()
            self.on_device.close()
            self.on_device = None

    def send_out(self) -> None:
        """After these buffers were written (a load, a restore): the units kept on the device take their values."""
        if self.on_device is not None:
            self.on_device.send_out()

    def copy_of(self, unit: str, lo: int, hi: int) -> torch.Tensor | None:
        """Elements [lo, hi) of a unit's streamed copy, for an optimizer that writes it with the update (bf16 or
        fp32; None where there is none or it is another dtype, or the unit is kept on the device)."""
        if self.copy is None or self.copy.dtype not in WORD_DTYPES or self.kept_on_device(unit):
            return None
        return self._slice(self.copy, unit)[lo:hi]

    def chunk_updated(self, unit: str, lo: int, hi: int, state: ChunkState, copy_written: bool = False) -> None:
        """Re-derive the chunk's streamed copy from its updated master (unless the optimizer wrote it: `copy_of`) and
        hand the chunk back to the tier. A unit kept on the device has neither copy nor mirrors here."""
        if self.kept_on_device(unit):
            self.on_device.updated()
            return
        if self.copy is not None and not copy_written:
            self._slice(self.copy, unit)[lo:hi].copy_(state.master)
        self._copy_to_mirrors(unit, lo, hi)
        self.state.release(unit, lo)

    def _copy_to_mirrors(self, owner: str, lo: int, hi: int) -> None:
        """Copy elements [lo, hi) of `owner`'s master (and streamed copy) into the mirrors of its weights, so every
        layer using a tied tensor computes with its one value."""
        for unit, m in self._mirrors_of.get(owner, ()):
            a, b = max(lo, m.owner_offset), min(hi, m.owner_offset + m.numel)
            if a >= b:
                continue
            src, dst = self.layout.offsets[owner] + a, self.layout.offsets[unit] + m.offset + a - m.owner_offset
            for buf in (self.master, self.copy):
                if buf is not None:
                    buf[dst : dst + b - a].copy_(buf[src : src + b - a])

    def expect_updates(self, units: list[str]) -> None:
        """The order the optimizer updates units in (a file-backed tier reads ahead in it)."""
        self.state.expect(units)

    def streamed_of(self, unit: str) -> torch.Tensor:
        """What the layer loop reads a unit's weights from: its streamed host slice, or its fp32 master on the
        device where the unit is kept there."""
        if self.kept_on_device(unit):
            return self.on_device.weights(unit)
        return self._slice(self.streamed_buffer, unit)

    def kept_on_device(self, unit: str) -> bool:
        """Whether the unit's master and moments live on the device (`keep_on_device`)."""
        return self.on_device is not None and unit in self.on_device

    def release(self, unit: str, copied: torch.cuda.Event | None) -> None:
        """Nothing to do: the streamed buffer lives as long as the store (WeightSource surface)."""

    def refresh_copy(self, unit: str) -> None:
        """Re-derive the compute-dtype copy of a unit from its master (in host memory)."""
        if self.copy is not None:
            self._slice(self.copy, unit).copy_(self.master_of(unit))

    def named_views(self, unit: UnitSpec, flat: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Hugging Face parameter name -> shaped view of the unit's flat weights `flat` (its master by default)."""
        return unit_views(unit, self.master_of(unit.name) if flat is None else flat)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """All fp32 master weights by Hugging Face name (views, no copies; read from disk when the master is there)."""
        out: dict[str, torch.Tensor] = {}
        for unit in self.units:
            out.update(self.named_views(unit, self._master_from_disk(unit) if self.master is None else None))
        return out

    def flat_state(self) -> dict[str, torch.Tensor]:
        """The fp32 buffers a checkpoint holds: master and both moments (the live buffers, no copies)."""
        if self.placement.on_disk:
            raise CheckpointError("the optimizer state is on disk (engine.state_placement): a checkpoint is written "
                                  "from its files by range (StreamingEngine.save_checkpoint), never gathered here")
        return {"master": self.master, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

    def load_flat_state(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy in buffers shaped like `flat_state()` and re-derive the streamed copy from the master."""
        for name, buf in self.flat_state().items():
            buf.copy_(tensors[name])
        if self.copy is not None:
            self.copy.copy_(self.master)

    def flat_parts(self) -> dict[str, tuple[int, list[tuple[str, int, int]]]]:
        """Each flat checkpoint tensor (`flat_state`'s names): its length, and the units' [start, end) in it."""
        lay = self.layout
        master = [(u, lay.offsets[u], lay.offsets[u] + lay.numels[u]) for u in lay.offsets]
        moments = [(u, off, off + lay.numels[u]) for u, off in lay.moment_offsets.items()]
        return {"master": (lay.total, master), "exp_avg": (lay.moment_total, moments),
                "exp_avg_sq": (lay.moment_total, moments)}

    def access_flat(self, name: str, lo: int, buf: torch.Tensor, write: bool) -> None:
        """Elements [lo, lo + len) of the flat checkpoint tensor `name`, read into `buf` or (with `write`) written
        from it, wherever each unit's part lives; a write of the master refreshes the streamed copy. Safe from
        several threads at once, between steps and after `settle`."""
        hi = lo + buf.numel()
        for unit, start, end in self.flat_parts()[name][1]:
            a, b = max(lo, start), min(hi, end)
            if a >= b:
                continue
            part = buf[a - lo : b - lo]
            if not self.placement.on_disk or (name == "master" and self.master is not None):
                target = {"master": self.master, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}[name][a:b]
                target.copy_(part) if write else part.copy_(target)
            else:
                self.state.access_flat(name, unit, a - start, part, write)
            if write and name == "master" and self.copy is not None:
                self.copy[a:b].copy_(part)

    @torch.no_grad()
    def load_named(self, unit: UnitSpec, tensors: dict[str, torch.Tensor]) -> None:
        """Copy one unit's weights (by Hugging Face name) into the master and the streamed copy.

        Without autograd: copying a parameter into a view would make the master a node of
        its graph, keeping every source tensor (a freshly initialised model on the GPU) alive.
        """
        if self.master is None:
            self.settle()
            self._write_master(unit, tensors)
            return
        views = self.named_views(unit)
        for p in unit.params:
            if p.tied_to is None:  # a mirror takes its owner's value, loaded before it
                views[p.hf_name].copy_(tensors[p.hf_name])
        self.refresh_copy(unit.name)
        for owner in ({unit.name} | {m.owner for m in self.spec.mirrors.get(unit.name, ())}) & self._mirrors_of.keys():
            self._copy_to_mirrors(owner, 0, self.layout.numels[owner])

    def _write_master(self, unit: UnitSpec, tensors: dict[str, torch.Tensor]) -> None:
        """A unit's weights into the master's files, a chunk at a time: never an fp32 copy of a whole parameter in
        RAM (the 3B embedding's would be 1.2 GB, and its concatenation as much again: the run's peak)."""
        at = self.layout.offsets[unit.name]
        for p in unit.params:
            flat = tensors[p.hf_name].detach().reshape(-1)
            for lo in range(0, p.numel, self.chunk_numel):
                self.access_flat("master", at + lo, flat[lo : lo + self.chunk_numel].to("cpu", torch.float32), write=True)
            at += p.numel

    def settle(self) -> None:
        """Finish the state tier's writes and drop its reads ahead, so the state can be read or written by range
        (between steps, after the optimizer has caught up)."""
        self.state.flush()

    def flat_ranges(self) -> dict[str, FlatRange]:
        """Each flat checkpoint tensor read by range (`CheckpointManager.save_ranges`); call `settle` first."""
        return {name: FlatRange(self, name, numel) for name, (numel, _) in self.flat_parts().items()}

    def _master_from_disk(self, unit: UnitSpec) -> torch.Tensor:
        self.settle()
        flat = torch.empty(unit.numel, dtype=torch.float32)
        self.access_flat("master", self.layout.offsets[unit.name], flat, write=False)
        return flat

    def _register(self, buf: torch.Tensor) -> None:
        # Page-lock the streamed buffer once: host->device copies from pageable memory run ~10x slower.
        self._registered.append(register_pinned(buf))

    def close(self) -> None:
        if self.on_device is not None:
            self.on_device.close()
        self.state.close()
        for buf in self._registered:
            unregister_pinned(buf)
        self._registered.clear()

    def rss_bytes_per_param(self) -> float:
        """Peak resident memory of this process divided by the parameter count (what users pay)."""
        return peak_rss_bytes() / self.layout.total


@dataclass(frozen=True)
class FlatRange:
    """One of a store's flat checkpoint tensors, read by range: what `CheckpointManager.save_ranges` writes from."""

    store: HostStore
    name: str
    numel: int
    dtype: torch.dtype = torch.float32

    def read(self, lo: int, dest: torch.Tensor) -> None:
        self.store.access_flat(self.name, lo, dest, write=False)


class HostTier:
    """The state tier of host placement: a chunk is a view of the flat buffers, updated in place."""

    def __init__(self, layout: StoreLayout, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor):
        self.layout, self.master, self.exp_avg, self.exp_avg_sq = layout, master, exp_avg, exp_avg_sq

    def acquire(self, unit: str, lo: int, hi: int) -> ChunkState:
        off = self.layout.offsets[unit]
        m_off = self.layout.moment_offsets.get(unit)  # None for a frozen unit: it has no moments
        if m_off is None:
            return ChunkState(self.master[off + lo : off + hi], None, None)
        return ChunkState(self.master[off + lo : off + hi], self.exp_avg[m_off + lo : m_off + hi],
                          self.exp_avg_sq[m_off + lo : m_off + hi])

    def release(self, unit: str, lo: int) -> None:
        """Nothing to write back: the update was in place."""

    def expect(self, units: list[str]) -> None:
        """Nothing to read ahead."""

    def flush(self) -> None:
        """No I/O in flight."""

    def close(self) -> None:
        """The buffers belong to the store."""


def peak_rss_bytes() -> int:
    try:
        for line in Path(f"/proc/{os.getpid()}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return psutil.Process().memory_info().rss


def unit_views(unit: UnitSpec, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """Hugging Face parameter name -> shaped view of `flat`, a unit's weights in the store's (and an arena's)
    layout: its parameters one after another."""
    views, off = {}, 0
    for p in unit.params:
        views[p.hf_name] = flat[off : off + p.numel].view(p.shape)
        off += p.numel
    return views
