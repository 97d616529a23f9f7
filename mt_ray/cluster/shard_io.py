"""A coordinator shard's state in and out: the owned units' weights loaded (random, a checkpoint folder, a state
dict), its part of the master read, its range of a checkpoint written and read, and its memory report.

Owned by the coordinator shard (mt_ray.cluster.shard). These run between steps, once `wait_updated` has returned:
nothing is updating.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from mt_ray.cluster.arena import NodeArena
from mt_ray.cluster.node_memory import NodeMemoryPeak, process_bytes
from mt_ray.cluster.wire import from_numpy, to_numpy
from mt_ray.engine.host_store import HostStore, peak_rss_bytes
from mt_ray.engine.optimizer import UnitOptimizer, counts_behind, restore_counts
from mt_ray.models.discovery import ModelSpec
from mt_ray.models.weights import init_random, load_safetensors


class ShardStateIO:
    """The owned units' state (`store`, the `optimizers`' Adam counts) and the arena's reference, in and out."""

    def __init__(self, spec: ModelSpec, owned: tuple[str, ...], store: HostStore, arena: NodeArena,
                 optimizers: dict[str, UnitOptimizer], node_memory: NodeMemoryPeak):
        self.spec = spec
        self.owned = set(owned)
        self.store = store
        self.arena = arena
        self.optimizers = optimizers
        self.node_memory = node_memory

    def load_random(self, seed: int = 0) -> None:
        init_random(self.spec, self._load_owned, seed, "cpu")  # every unit, so the RNG stream matches one engine

    def load_pretrained(self, folder: str) -> None:
        load_safetensors(self.spec, folder, self._load_owned)

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        tensors = {k: from_numpy(a, torch.float32) for k, a in state.items()}
        for unit in self.spec.units:
            self._load_owned(unit, tensors)

    def _load_owned(self, unit, tensors: dict[str, torch.Tensor]) -> None:
        """An owned unit's weights into the master; every unit's into the reference, where the arena keeps one."""
        if unit.name in self.owned:
            self.store.load_named(unit, tensors)
        if self.arena.layout.ref_offsets:  # cast as the single engine's snapshot of its fp32 master casts it
            for name, view in self.store.named_views(unit, self.arena.reference(unit.name)).items():
                view.copy_(tensors[name].detach().to(torch.float32))

    # The readers below run between steps, once `wait_updated` has returned: nothing is updating.

    def state_part(self) -> dict[str, np.ndarray]:
        """fp32 master weights of this shard's units, by Hugging Face name."""
        return {k: to_numpy(v) for k, v in self.store.state_dict().items()}

    def write_checkpoint_part(self, writer, pieces: dict[str, list], starts: dict[str, int], io_workers: int) -> dict:
        """Store this shard's pieces of the flat master/moment tensors (its range of each begins at `starts[name]`)."""
        from mt_ray.tracking.ckpt_format import ShardSource  # tracking is needed only when checkpointing

        flat = self.store.flat_state()
        sources = [ShardSource(p.file, name, p.start, flat[name][p.start - starts[name]:p.start - starts[name] + p.numel])
                   for name, ps in pieces.items() for p in ps]
        with ThreadPoolExecutor(io_workers, thread_name_prefix="ckpt-write") as io:
            return dict(zip([s.file for s in sources], io.map(writer.write_file, sources), strict=True))

    def read_checkpoint_part(self, stored, starts: dict[str, int]) -> None:
        """Read this shard's range of a stored checkpoint (cut for any number of shards) into its state;
        `starts`: where the range begins in each flat tensor. Adam counts become the checkpoint's, as the
        single engine's do."""
        for name, buf in self.store.flat_state().items():
            stored.read_range(name, starts[name], starts[name] + buf.numel(), buf)
        meta = stored.manifest.meta
        restore_counts(self.optimizers, meta["step"], meta.get("adam_counts", {}))

    def adam_counts_behind(self, step: int) -> dict[str, int]:
        """This shard's units whose Adam count is not `step` (`counts_behind`), for a checkpoint's meta."""
        return counts_behind(self.optimizers, step)

    def host_bytes(self) -> dict[str, int]:
        """Peak growth of this node's used memory since the shard started, this process's peak RSS, and its
        memory now (`process_bytes`)."""
        return {"node_growth": self.node_memory.growth, "shard_rss_peak": peak_rss_bytes(), **process_bytes()}
