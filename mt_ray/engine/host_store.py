"""Host-memory home of the whole training state.

Every unit (embedding, each decoder layer, final norm + head) owns one contiguous slice of
four big host buffers: the fp32 master weights, the fp32 Adam moments m and v, and the copy
that is streamed to the device (in the compute dtype, or no copy at all when the fp32 master
is streamed and cast on the device). A frozen unit (a frozen vision tower) has no slice of
the moments: it is never updated. One allocation per buffer keeps pinning cheap: a single
`cudaHostRegister` call covers the whole streamed buffer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch

from mt_ray.engine.pinning import register_pinned, unregister_pinned
from mt_ray.errors import CheckpointError, InsufficientMemoryError
from mt_ray.models.discovery import ModelSpec, UnitSpec

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
    """fp32 master, fp32 Adam moments and the streamed copy of every unit (or of `units` only), in host memory."""

    def __init__(self, spec: ModelSpec, copy_dtype: torch.dtype | None, pin: bool, extra_bytes: int = 0,
                 host_memory_limit_gb: float | None = None, units: list[UnitSpec] | None = None,
                 master: torch.Tensor | None = None):
        """`master`: an fp32 buffer of the units' size to hold the master weights in (a data-parallel node's
        shared memory, which its workers stream from) instead of one of this store's own."""
        self.spec = spec
        self.units = spec.units if units is None else units
        self.layout = plan_layout(spec, copy_dtype, self.units)
        need = self.layout.nbytes + extra_bytes - (0 if master is None else master.nbytes)
        have = available_host_bytes(host_memory_limit_gb)
        if need > have:
            raise InsufficientMemoryError(
                f"training state needs {need / GIB:.1f} GiB of host RAM ({self.layout.bytes_per_param:.0f} B/param "
                f"x {self.layout.total / 1e9:.2f} B params + {extra_bytes / GIB:.1f} GiB buffers) but only "
                f"{have / GIB:.1f} GiB is available. Use engine.stream_master=true (drops the compute-dtype copy), "
                "a smaller model, or a host with more memory (engine.host_memory_limit_gb overrides detection)."
            )
        n = self.layout.total
        self.master = torch.empty(n, dtype=torch.float32) if master is None else master
        if self.master.shape != (n,) or self.master.dtype != torch.float32:
            raise ValueError(f"the master buffer must be {n} fp32 elements, not {tuple(self.master.shape)} {self.master.dtype}")
        self.exp_avg = torch.zeros(self.layout.moment_total, dtype=torch.float32)
        self.exp_avg_sq = torch.zeros(self.layout.moment_total, dtype=torch.float32)
        self.copy = torch.empty(n, dtype=copy_dtype) if copy_dtype is not None else None
        self._registered: list[torch.Tensor] = []
        if pin:
            self._register(self.streamed_buffer)

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
        off = self.layout.moment_offsets[unit]  # KeyError for a frozen unit: it has no moments
        n = self.layout.numels[unit]
        return self.exp_avg[off : off + n], self.exp_avg_sq[off : off + n]

    def streamed_of(self, unit: str) -> torch.Tensor:
        return self._slice(self.streamed_buffer, unit)

    def release(self, unit: str, copied: torch.cuda.Event | None) -> None:
        """Nothing to do: the streamed buffer lives as long as the store (WeightSource surface)."""

    def refresh_copy(self, unit: str) -> None:
        """Re-derive the compute-dtype copy of a unit from its just-updated master."""
        if self.copy is not None:
            self._slice(self.copy, unit).copy_(self.master_of(unit))

    def named_views(self, unit: UnitSpec, buf: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Hugging Face parameter name -> shaped view of this unit's slice of `buf` (master by default)."""
        flat = self._slice(self.master if buf is None else buf, unit.name)
        views, off = {}, 0
        for p in unit.params:
            views[p.hf_name] = flat[off : off + p.numel].view(p.shape)
            off += p.numel
        return views

    def state_dict(self) -> dict[str, torch.Tensor]:
        """All fp32 master weights by Hugging Face name (views, no copies)."""
        out: dict[str, torch.Tensor] = {}
        for unit in self.units:
            out.update(self.named_views(unit))
        return out

    def flat_state(self) -> dict[str, torch.Tensor]:
        """The fp32 buffers a checkpoint holds: master and both moments (the live buffers, no copies)."""
        return {"master": self.master, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

    def load_flat_state(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy in buffers shaped like `flat_state()` and re-derive the streamed copy from the master."""
        for name, buf in self.flat_state().items():
            buf.copy_(tensors[name])
        if self.copy is not None:
            self.copy.copy_(self.master)

    @torch.no_grad()
    def load_named(self, unit: UnitSpec, tensors: dict[str, torch.Tensor]) -> None:
        """Copy one unit's weights (by Hugging Face name) into the master and the streamed copy.

        Without autograd: copying a parameter into a view would make the master a node of
        its graph, keeping every source tensor (a freshly initialised model on the GPU) alive.
        """
        views = self.named_views(unit)
        for name, view in views.items():
            view.copy_(tensors[name])
        self.refresh_copy(unit.name)

    def _register(self, buf: torch.Tensor) -> None:
        # Page-lock the streamed buffer once: host->device copies from pageable memory run ~10x slower.
        self._registered.append(register_pinned(buf))

    def close(self) -> None:
        for buf in self._registered:
            unregister_pinned(buf)
        self._registered.clear()

    def rss_bytes_per_param(self) -> float:
        """Peak resident memory of this process divided by the parameter count (what users pay)."""
        return peak_rss_bytes() / self.layout.total


def peak_rss_bytes() -> int:
    try:
        for line in Path(f"/proc/{os.getpid()}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return psutil.Process().memory_info().rss
