"""GRPO on the Ray cluster: a rollout replica beside each engine worker, as VERL colocates them.

The engine workers only train. Each rollout replica holds a copy of the policy for generation (the single
engine's `PolicyCopy` and its decode loop, decode.py: no second decoder) on its worker's GPU (the CPU beside CPU
workers; `cluster.rollout_gpus` gives one replica GPUs of its own instead), and generates a consecutive share of
each rollout's prompt groups, all replicas at once; the driver joins their completions in prompt order. Each
group samples from its own seeded stream (sampling.py), so the completions do not depend on the split: one
engine's `LocalSampler` draws the same ones.

Before each rollout a replica refreshes its copy from its node's shared-memory arena (the shard's fp32 master;
other nodes' units in the compute dtype), unit by unit as each unit's version word says the last step's update is
in: a page-locked DMA and a cast on the GPU (upload.py), nothing model-sized through Ray's object store. Rewards
and advantages are scored on the driver as on a single engine. Every wait for a replica is bounded by
`cluster.step_timeout_s` and names the replica and what it was doing.
"""

from __future__ import annotations

import os

import ray
import torch
from ray.exceptions import RayActorError

from mt_ray.cluster.errors import ClusterError
from mt_ray.cluster.rollout_host import ReplicaSeat, WeightsReader, WeightsVersion
from mt_ray.cluster.run_spec import RolloutBeside
from mt_ray.engine.grpo import GrpoConfig
from mt_ray.engine.host_store import unit_views
from mt_ray.training.grpo.rollout import Rollout, build_copy, generation_eos, group_shares

REPLY_GRACE_S = 60.0  # beyond a replica's own bound on its arena waits: its copy's time, and Ray's reply


class RolloutActor:
    """A Ray actor: a rollout replica, the policy's copy for generation, refreshed from its node's arena."""

    def __init__(self, seat: ReplicaSeat, rows: int, tokens: int, placement: str = "auto",
                 devices: str | None = None):
        """`seat`: where it runs, the run's configs (its device and compute dtype) and its node's arena; a copy
        sized for `rows` completions of up to `tokens` tokens, placed as `placement` (`rollout.placement`; auto:
        resident where the whole copy fits the GPU's free memory beside the worker, else streamed), refused where
        even that cannot fit. `devices`: the CUDA devices of the worker whose GPU it shares (Ray reserved none for
        it)."""
        if devices is not None:
            _take_devices(devices)
        torch.set_num_threads(max(1, seat.threads))
        self.weights = WeightsReader(seat.run, seat.arena)
        cfg = seat.run.engine
        device = cfg.resolve_device()
        if device.type == "cuda":  # each refresh's uploads are then DMAs from the arena
            self.weights.page_lock()
        self.copy = build_copy(self.weights.spec, cfg, device, rows, tokens, placement)

    def refresh(self, version: WeightsVersion) -> float:
        """Load the weights of `version`, each unit as soon as its update is in (all within its bound); the
        seconds, waits included."""
        return self.copy.refresh(unit_views(unit, flat) for unit, flat in self.weights.updated_units(version))

    def generate(self, prompt_ids: list[list[int]], cfg: GrpoConfig, eos_ids: set[int], pad_id: int, seed: int,
                 first_group: int, width: int) -> Rollout:
        return self.copy.generate(prompt_ids, cfg, eos_ids, pad_id, seed, first_group, width)

    def generation_eos(self) -> list[int]:
        return generation_eos(self.copy.model)


def _take_devices(devices: str) -> None:
    """Make the worker's GPU this process's, before CUDA starts (it reads the variable once)."""
    if torch.cuda.is_initialized() and os.environ.get("CUDA_VISIBLE_DEVICES") != devices:
        raise ClusterError(f"a rollout replica must run on its worker's GPU (CUDA_VISIBLE_DEVICES={devices}), but "
                           "CUDA had started in its process already")
    os.environ["CUDA_VISIBLE_DEVICES"] = devices


class RemoteSampler:
    """`LocalSampler`'s surface over the rollout replicas, placed through the data-parallel trainer's public
    rollout interface (`DataParallelTrainer.rollout_host`, mt_ray.cluster.rollout_host)."""

    def __init__(self, trainer, rows: int, tokens: int, group: int, placement: str = "auto", micro_batch: int = 0):
        """Replicas sized for their share of `rows` completions (whole groups of `group`) of up to `tokens`
        tokens; returns once each has built its copy. `micro_batch`: the update's rows per micro-batch (0: `rows`),
        for the workers' plan of their GPU with a replica beside them (`plan_beside`), made before any replica
        is built."""
        self.host = host = trainer.rollout_host
        seats = host.seats()
        self.names = [seat.name for seat in seats]
        groups = rows // group
        share_rows = max(hi - lo for lo, hi in group_shares(groups, len(seats))) * group
        placements = self.plan_beside(share_rows, tokens, placement, micro_batch or rows, rows)
        devices = [None] * len(seats)
        if host.shares_gpu:  # each replica on its worker's GPU
            workers = [seat.worker for seat in seats]
            devices = self._wait(host.worker_devices(workers), "report its GPU", [f"worker {w}" for w in workers])
        cls = ray.remote(RolloutActor)
        self.replicas = [cls.options(**seat.options).remote(seat, share_rows, tokens, placements[seat.worker], dev)
                         for seat, dev in zip(seats, devices, strict=True)]
        try:
            self.eos = self._wait([r.generation_eos.remote() for r in self.replicas], "build its copy")[0]
        except BaseException:
            self.close()  # none left holding a GPU's memory
            raise

    def plan_beside(self, share_rows: int, tokens: int, placement: str, micro_batch: int, rows: int) -> list[str]:
        """Each worker plans its GPU before step 1: a replica of `share_rows` rows beside it (none where the
        replica has GPUs of its own), its kept block graphs for its share of the update's micro-batches; the
        replicas' placements by worker. A replica or a `keep_activations` that cannot fit is refused here."""
        host = self.host
        shared = host.shares_gpu
        n_micro = -(-max(1, rows // micro_batch) // host.num_workers)  # whole micro-batches, the largest share
        beside = RolloutBeside(share_rows if shared else 0, tokens, placement, micro_batch, n_micro)
        names = [f"worker {w}" for w in range(host.num_workers)]
        planned = self._wait(host.plan_beside(beside), "plan its GPU with a rollout replica beside it", names)
        return planned if shared else [placement] * host.num_workers

    def refresh(self) -> float:
        """Every replica's copy of the weights after every step so far (each waits for their updates in its
        node's arena); the slowest replica's seconds."""
        version = self.host.version()
        calls = [r.refresh.remote(version) for r in self.replicas]
        return max(self._wait(calls, f"refresh its copy to step {version.step}"))

    def generate(self, prompt_ids: list[list[int]], cfg: GrpoConfig, eos_ids: set[int], pad_id: int,
                 seed: int) -> Rollout:
        """Each replica's share of the prompt groups, generated at once, joined in prompt order."""
        width = max(len(p) for p in prompt_ids)  # every share padded alike: the positions one engine's batch has
        shares = group_shares(len(prompt_ids), len(self.replicas))
        calls = [r.generate.remote(prompt_ids[lo:hi], cfg, eos_ids, pad_id, seed, lo, width)
                 for r, (lo, hi) in zip(self.replicas, shares, strict=False)]
        return Rollout.join(self._wait(calls, "generate its share of the prompts", self.names[: len(calls)]))

    def generation_eos(self) -> list[int]:
        return self.eos

    def _wait(self, calls: list, what: str, names: list[str] | None = None) -> list:
        return wait_replies(calls, names or self.names, what, self.host.timeout_s)

    def close(self) -> None:
        """End the replicas: their copies, mappings and page-locking go with their processes."""
        for replica in self.replicas:
            ray.kill(replica, no_restart=True)


def wait_replies(calls: list, names: list[str], what: str, timeout_s: float, grace_s: float = REPLY_GRACE_S) -> list:
    """The replies of `calls` (one per actor, named in `names`, in order), waited for at most `timeout_s`
    (`cluster.step_timeout_s`) and `grace_s`; a late or lost actor is named with what it was asked to do. An
    error raised in an actor's method reaches the caller as it is."""
    _, late = ray.wait(calls, num_returns=len(calls), timeout=timeout_s + grace_s)
    if late:
        raise ClusterError(f"{', '.join(names[calls.index(c)] for c in late)} did not {what} within "
                           f"{timeout_s + grace_s:g} s (cluster.step_timeout_s={timeout_s:g} s, and {grace_s:g} s for "
                           "the reply): it is hung; raise cluster.step_timeout_s if rollouts are this slow")
    out = []
    for name, call in zip(names, calls, strict=True):
        try:
            out.append(ray.get(call))  # ready: returns at once
        except RayActorError as e:
            raise ClusterError(f"{name} was lost while asked to {what}: {e}") from e
    return out
