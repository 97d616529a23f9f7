"""The driver's calls to the coordinator shards that move or read the whole state: bounded shard calls, the master
weights, checkpoints (every shard its own range at once, in the single engine's format) and the export.

A mixin of `DataParallelTrainer` (mt_ray.cluster.driver), kept apart so the step loop reads in one file.
"""

from __future__ import annotations

from pathlib import Path

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError
from transformers import GenerationConfig

from mt_ray.cluster.errors import ClusterLostError
from mt_ray.cluster.wire import from_numpy
from mt_ray.engine.host_store import plan_layout
from mt_ray.models.weights import export_hf


class ShardedState:
    """State-sized work on the shards; the trainer provides `shards`, `workers`, `spec`, `plan`, `generation`,
    `step_idx`, `_kept` and `weights_timeout_s`."""

    def _ask_shards(self, refs: list[ray.ObjectRef], timeout_s: float | None = None) -> list:
        """The answers of shard calls, within `timeout_s` (default `weights_timeout_s`; a state-sized transfer is
        given `_io_timeout_s`); losing a shard loses its part of the run's state."""
        timeout_s = self.weights_timeout_s if timeout_s is None else timeout_s
        try:
            return ray.get(refs, timeout=timeout_s)
        except GetTimeoutError:
            raise ClusterLostError(f"the coordinator shards did not answer within {timeout_s:g} s: a shard is hung "
                                   "(its log says where); restart from a checkpoint, or raise "
                                   "cluster.step_timeout_s if this node is this slow") from None
        except RayActorError as e:
            raise ClusterLostError("a coordinator shard (or its node) was lost with its part of the training "
                                   "state; restart from a checkpoint") from e

    def _io_timeout_s(self) -> float:
        """A bound for moving the whole fp32 state (a load, a checkpoint, an export): at 20 MB/s, plus the step's."""
        return self.weights_timeout_s + 12 * self.spec.num_params / 20e6

    # ------------------------------------------------------------------ state, checkpoints, export

    def synchronize(self) -> None:
        """Wait until every update of the steps run so far is in the shards' master weights."""
        self._ask_shards([s.wait_updated.remote(self.step_idx) for s in self.shards])

    def state_dict(self) -> dict[str, torch.Tensor]:
        """fp32 master weights by Hugging Face name (copies: they outlive the trainer and its Ray)."""
        return {k: v.clone() for k, v in self._fetch_state().items()}

    def export(self, out_dir: str | Path, tokenizer=None, dtype: torch.dtype = torch.float32,
               extra_files: tuple[Path, ...] = (), generation: GenerationConfig | None = None) -> Path:
        """Write a Hugging Face folder here, on the driver's node (where checkpoints and MLflow are), `extra_files`
        copied in (an image-text model's processor files)."""
        return export_hf(self.spec, self._fetch_state(), out_dir, tokenizer, dtype, extra_files=extra_files,
                         generation=generation)

    def _fetch_state(self) -> dict[str, torch.Tensor]:
        """Master weights as read-only views of the objects fetched from the shards."""
        self.synchronize()
        parts = self._ask_shards([s.state_part.remote() for s in self.shards], self._io_timeout_s())
        return {k: from_numpy(a, torch.float32) for part in parts for k, a in part.items()}

    def save_checkpoint(self, manager, step: int, extra_meta: dict) -> str:
        """Every shard writes its range of the flat state at once; the manifest (the single engine's
        format, so any worker or node count resumes from it) is written here, last."""
        self.synchronize()
        layout = plan_layout(self.spec, None)
        ranges = self.plan.flat_ranges()  # frozen units have no moments: the moment buffers are shorter
        shard_bytes = manager.config.shard_bytes
        records = {name: _plan_pieces(name, ranges[name][-1][1], shard_bytes, [hi for _, hi in ranges[name][:-1]])
                   for name in ranges}

        def write(writer) -> dict:
            calls = []
            for i, shard in enumerate(self.shards):
                mine = {n: ranges[n][i] for n in ranges}
                pieces = {n: [p for p in r.pieces if mine[n][0] <= p.start < mine[n][1]] for n, r in records.items()}
                calls.append(shard.write_checkpoint_part.remote(writer, pieces, {n: lo for n, (lo, _) in mine.items()},
                                                                manager.config.io_workers))
            return {f: rec for part in self._ask_shards(calls, self._io_timeout_s()) for f, rec in part.items()}

        meta = {"step": step, "layout": layout.describe(), **extra_meta}
        behind = {u: c for part in self._ask_shards([s.adam_counts_behind.remote(step) for s in self.shards])
                  for u, c in part.items()}
        if behind:  # as the single engine's meta: units whose Adam count is not the step
            meta["adam_counts"] = behind
        return manager.save_with(step, records, meta, write)

    def restore_checkpoint(self, manager, uri: str | None = None) -> dict:
        """Every shard reads its range of a checkpoint (of any run shape) at once; workers rejoin at its step."""
        layout = plan_layout(self.spec, None)
        self.synchronize()

        def read(stored) -> dict:
            layout.check_matches(stored.manifest.meta["layout"])
            ranges = self.plan.flat_ranges()
            self._ask_shards([s.read_checkpoint_part.remote(stored, {n: ranges[n][i][0] for n in ranges})
                              for i, s in enumerate(self.shards)], self._io_timeout_s())
            return stored.manifest.meta

        meta = manager.load_with(read, uri)
        self.generation += 1
        self._ask_shards([s.start.remote(self.generation, meta["step"]) for s in self.shards])
        ray.get([w.rejoin.remote(self.generation, meta["step"]) for w in self.workers], timeout=self.weights_timeout_s)
        self.step_idx = meta["step"]
        self._kept.clear()
        return meta

    def memory_metrics(self) -> dict[str, float]:
        """Peak host memory growth of the most loaded node since its shard started, per parameter."""
        reports = self._ask_shards([s.host_bytes.remote() for s in self.shards])
        return {"host_bytes_per_param": max(r["node_growth"] for r in reports) / self.spec.num_params}


def _plan_pieces(name: str, numel: int, shard_bytes: int, cuts: list[int]):
    from mt_ray.tracking.ckpt_format import plan_pieces  # tracking is needed only when checkpointing

    return plan_pieces(name, torch.float32, [numel], shard_bytes, cuts)
