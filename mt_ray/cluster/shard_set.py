"""The driver's side of the coordinator shards: bounded calls to all of them, naming any that does not answer, and
what moves or reads the whole state: the master weights, checkpoints (every shard its own range at once, in the
single engine's format) and the export.
"""

from __future__ import annotations

from pathlib import Path

import ray
import torch
from ray.exceptions import RayActorError
from transformers import GenerationConfig

from mt_ray.cluster.errors import ClusterLostError
from mt_ray.cluster.partition import ShardPlan
from mt_ray.cluster.wire import from_numpy
from mt_ray.engine.host_store import plan_layout
from mt_ray.models.discovery import ModelSpec
from mt_ray.models.weights import export_hf


class ShardSet:
    """The run's coordinator shards (one per node, by node) as the driver sees them; calls bounded by `timeout_s`
    (`cluster.step_timeout_s`), a state-sized transfer by `io_timeout_s`."""

    def __init__(self, shards: list, spec: ModelSpec, plan: ShardPlan, timeout_s: float):
        self.handles = shards
        self.spec = spec
        self.plan = plan
        self.timeout_s = timeout_s

    def call(self, method: str, *args, timeout_s: float | None = None, **kwargs) -> list:
        """Every shard's answer to `method(*args, **kwargs)`, in shard order (bounded, see `gather`)."""
        return self.gather([getattr(s, method).remote(*args, **kwargs) for s in self.handles], method, timeout_s)

    def gather(self, calls: list[ray.ObjectRef], what: str, timeout_s: float | None = None) -> list:
        """The answers of `calls` (one per shard, shard order) within `timeout_s` (default `timeout_s`); a shard
        that does not answer, or is lost, is named with `what` it was asked: it held part of the run's state."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        _, late = ray.wait(calls, num_returns=len(calls), timeout=timeout_s)
        if late:
            names = [i for i, c in enumerate(calls) if c in late]
            raise ClusterLostError(f"coordinator shard(s) {names} did not answer {what} within {timeout_s:g} s: hung "
                                   "(its log says where); restart from a checkpoint, or raise cluster.step_timeout_s "
                                   "if this node is this slow")
        answers = []
        for i, call in enumerate(calls):
            try:
                answers.append(ray.get(call))  # ready: returns at once
            except RayActorError as e:
                raise ClusterLostError(f"coordinator shard {i} (or its node) was lost, asked {what}, with its part of "
                                       "the training state; restart from a checkpoint") from e
        return answers

    @property
    def io_timeout_s(self) -> float:
        """A bound for moving the whole fp32 state (a load, a checkpoint, an export): at 20 MB/s, plus the step's."""
        return self.timeout_s + 12 * self.spec.num_params / 20e6

    # ------------------------------------------------------------------ state, checkpoints, export

    def synchronize(self, step: int) -> None:
        """Wait until every update of the `step` steps run so far is in the shards' master weights."""
        self.call("wait_updated", step)

    def fetch_state(self, step: int) -> dict[str, torch.Tensor]:
        """Master weights after `step` steps, as read-only views of the objects fetched from the shards."""
        self.synchronize(step)
        parts = self.call("state_part", timeout_s=self.io_timeout_s)
        return {k: from_numpy(a, torch.float32) for part in parts for k, a in part.items()}

    def export(self, step: int, out_dir: str | Path, tokenizer=None, dtype: torch.dtype = torch.float32,
               extra_files: tuple[Path, ...] = (), generation: GenerationConfig | None = None) -> Path:
        """Write a Hugging Face folder here, on the driver's node (where checkpoints and MLflow are)."""
        return export_hf(self.spec, self.fetch_state(step), out_dir, tokenizer, dtype, extra_files=extra_files,
                         generation=generation)

    def save_checkpoint(self, manager, step: int, extra_meta: dict) -> str:
        """Every shard writes its range of the flat state at once; the manifest (the single engine's
        format, so any worker or node count resumes from it) is written here, last."""
        self.synchronize(step)
        layout = plan_layout(self.spec, None)
        ranges = self.plan.flat_ranges()  # frozen units have no moments: the moment buffers are shorter
        shard_bytes = manager.config.shard_bytes
        records = {name: _plan_pieces(name, ranges[name][-1][1], shard_bytes, [hi for _, hi in ranges[name][:-1]])
                   for name in ranges}

        def write(writer) -> dict:
            calls = []
            for i, shard in enumerate(self.handles):
                mine = {n: ranges[n][i] for n in ranges}
                pieces = {n: [p for p in r.pieces if mine[n][0] <= p.start < mine[n][1]] for n, r in records.items()}
                calls.append(shard.write_checkpoint_part.remote(writer, pieces, {n: lo for n, (lo, _) in mine.items()},
                                                                manager.config.io_workers))
            parts = self.gather(calls, "to write its part of a checkpoint", self.io_timeout_s)
            return {f: rec for part in parts for f, rec in part.items()}

        meta = {"step": step, "layout": layout.describe(), **extra_meta}
        behind = {u: c for part in self.call("adam_counts_behind", step) for u, c in part.items()}
        if behind:  # as the single engine's meta: units whose Adam count is not the step
            meta["adam_counts"] = behind
        return manager.save_with(step, records, meta, write)

    def read_checkpoint(self, manager, step: int, uri: str | None = None) -> dict:
        """Every shard reads its range of a checkpoint (of any run shape) at once; returns its meta. The caller
        starts a generation at its step."""
        layout = plan_layout(self.spec, None)
        self.synchronize(step)

        def read(stored) -> dict:
            layout.check_matches(stored.manifest.meta["layout"])
            ranges = self.plan.flat_ranges()
            self.gather([s.read_checkpoint_part.remote(stored, {n: ranges[n][i][0] for n in ranges})
                         for i, s in enumerate(self.handles)], "to read its part of a checkpoint", self.io_timeout_s)
            return stored.manifest.meta

        return manager.load_with(read, uri)

    def memory_metrics(self) -> dict[str, float]:
        """Peak host memory growth of the most loaded node since its shard started, per parameter."""
        reports = self.call("host_bytes")
        return {"host_bytes_per_param": max(r["node_growth"] for r in reports) / self.spec.num_params}


def _plan_pieces(name: str, numel: int, shard_bytes: int, cuts: list[int]):
    from mt_ray.tracking.ckpt_format import plan_pieces  # tracking is needed only when checkpointing

    return plan_pieces(name, torch.float32, [numel], shard_bytes, cuts)
