"""The driver: places the coordinator shards and the workers, runs steps, replaces lost workers.

Each global batch (a list of micro-batches) is split across the workers; every worker scales
its loss by the global loss-token count, so the shards' sum of their gradients is the gradient
one engine would compute on the whole batch. An image-text batch splits as its rows do: each
row's images are its own (`images`, one list per row), and everything else the engine derives
from a row (rotary positions, image-token masks) is computed from that row alone. A preference
stage's pair shares one row (chosen and rejected, packed or not), so no split cuts a pair; every
worker normalises by the global batch's pair (or KTO example) count, and the driver adds the
workers' metric sums before dividing by it. KTO's KL estimate is a mean over a whole micro-batch's
twins, so its micro-batches go whole to the workers, as GRPO's do (its loss is normalised per
micro-batch; mt_ray.cluster.stages). GRPO's completions come from rollout replicas the training side
places beside the workers (`rollout_options`), reading the weights from their node's arena
(`arena_access`). Workers sit in a placement group, the same number on each node beside that
node's coordinator shard (mt_ray.cluster.shard), which sums their gradients and owns one
contiguous part of the fp32 state.

A step: the workers run forward and backward; each shard reports the norm² of its summed
units; the driver adds them (shard order) and hands the global norm back, which starts the
clipped updates. A worker lost mid-step (its actor died, or the step timed out) stops the
step on every shard; new workers start and the steps since the resume point are replayed from
the batches kept here, so no data and no update is lost or applied twice. A lost shard or
node loses state: `ClusterLostError`, and `jobs.train` restarts from the newest checkpoint.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import ray
import torch
from ray.exceptions import GetTimeoutError, ObjectLostError, RayActorError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from mt_ray.cluster.arena import ArenaAccess, ring_numel
from mt_ray.cluster.config import ClusterConfig
from mt_ray.cluster.driver_state import ShardedState
from mt_ray.cluster.errors import ClusterError, ClusterLostError, StepTimeoutError
from mt_ray.cluster.partition import ShardPlan
from mt_ray.cluster.placement import RolloutPlace, check_nodes, check_plan, init_ray
from mt_ray.cluster.shard import CoordinatorShard
from mt_ray.cluster.sizing import GIB, landers, size_cluster
from mt_ray.cluster.split import Batch, count_loss_tokens, rows, shard_batch
from mt_ray.cluster.stages import WHOLE_MICRO_BATCHES, stage_objective, summed_metrics
from mt_ray.cluster.wire import to_numpy
from mt_ray.cluster.worker import EngineWorker
from mt_ray.engine.batch import preference_counts
from mt_ray.engine.config import EngineConfig, OptimizerConfig
from mt_ray.engine.grpo import GrpoConfig
from mt_ray.engine.optimizer import lr_at
from mt_ray.engine.preference import PreferenceConfig
from mt_ray.engine.results import EvalResult, StepResult
from mt_ray.engine.sizing import Stage
from mt_ray.engine.step_time import Machine, predicted_step_seconds
from mt_ray.errors import ConfigError
from mt_ray.models.discovery import ModelSpec, discover
from mt_ray.models.vision import VISION_EMBED, VISION_PROJECTOR

log = logging.getLogger(__name__)

_LOST_WORKER = (RayActorError, GetTimeoutError, ObjectLostError, StepTimeoutError)
# `cluster.step_timeout_s: auto`: this many times the calculator's step estimate, and at least the floor
# (a first step also builds each worker's templates and maps its arena).
STEP_TIMEOUT_FACTOR = 10
STEP_TIMEOUT_FLOOR_S = 600.0
GPU_MACHINE = Machine()
CPU_MACHINE = Machine(layer_tflops=0.02, h2d_gbps=5.0)  # a slow CPU's fp32 matmuls: a bound, not a prediction


@dataclass
class FailureEvent:
    """A lost worker and what the driver did about it."""

    step: int
    error: str
    lost_ranks: list[int]
    resumed_at: int
    action: str


@dataclass
class DataParallelResult:
    """What a data-parallel run returns; `state_dict` is None unless asked for."""

    losses: list[float]
    grad_norms: list[float]
    events: list[FailureEvent] = field(default_factory=list)
    state_dict: dict[str, torch.Tensor] | None = None
    seconds: float = 0.0
    step_seconds: list[float] = field(default_factory=list)  # driver wall time of each step, recoveries included


class DataParallelTrainer(ShardedState):
    """Controller of one run: a coordinator shard per node, `num_workers` engine workers, the step loop.

    It trains like a `StreamingEngine` (`train_step`, `save_checkpoint`, `export`, ...), so the
    `Trainer` drives either. `after_launch(step, trainer)` runs right after a step's work is
    handed to the workers (a seam for tests and fault injection). `stage` is the run's `training.stage`
    with its `pref` (or `grpo`) section; the reference a preference stage (or GRPO at β > 0) streams is the
    starting weights, kept in each node's arena. GRPO's completions come from rollout replicas the training
    side places beside the workers (`rollout_options`, `arena_access`); the workers only train.
    """

    def __init__(self, model, engine_cfg: EngineConfig, opt_cfg: OptimizerConfig, num_workers: int,
                 total_steps: int, cluster: ClusterConfig | None = None, weights: int | str | dict = 0,
                 after_launch: Callable[[int, DataParallelTrainer], None] | None = None, stage: str = "sft",
                 pref: PreferenceConfig | None = None, grpo: GrpoConfig | None = None):
        self.stage, self.pref, self.grpo = stage, pref or PreferenceConfig(), grpo or GrpoConfig()
        self.objective = stage_objective(stage, self.pref, self.grpo)
        self.reference = Stage.of(stage, self.pref, self.grpo).reference  # each node's arena keeps the reference
        # GRPO's plan of what shares each worker's GPU (RemoteSampler sets it before step 1; a worker started later
        # plans the same at its start)
        self.rollout_beside: dict | None = None
        if engine_cfg.state_placement != "host":  # the shards keep master and moments in the node's shared memory
            raise ConfigError(f"engine.state_placement: {engine_cfg.state_placement} runs on a single engine for now; "
                              "use cluster.num_workers: 1, or state_placement: host")
        self.spec = model if isinstance(model, ModelSpec) else discover(model)
        self.model = self.spec.config  # what the actors rediscover the spec from, with these options
        self.freeze = freeze_options(self.spec)
        self.engine_cfg = engine_cfg
        self.opt_cfg = opt_cfg
        self.num_workers = num_workers
        self.total_steps = total_steps
        self.cluster = cluster or ClusterConfig()
        self.after_launch = after_launch
        self.events: list[FailureEvent] = []
        self.step_idx = 0
        self._kept_logps: list[torch.Tensor] = []
        self._kept: dict[int, Batch] = {}  # batches a recovery may have to replay
        nodes = self.cluster.num_nodes
        if num_workers % nodes:
            raise ConfigError(f"cluster.num_workers={num_workers} cannot spread evenly over cluster.num_nodes={nodes}; "
                              "make num_nodes a divisor of num_workers")
        self.workers_per_node = num_workers // nodes
        if engine_cfg.grad_torch_dtype == torch.float16:
            raise ConfigError("a data-parallel run sums gradients in bf16 or fp32; engine.compute_dtype: fp16 with "
                              "engine.grad_dtype: compute would send fp16. Set engine.grad_dtype: fp32, or "
                              "engine.compute_dtype: bf16")
        if self.cluster.grad_reduce == "nccl" and self.spec.vision is not None:
            raise ConfigError("cluster.grad_reduce: nccl cannot train an image-text model (a worker whose rows hold "
                              "no image sends no vision gradient, so the node's collectives would not match); use "
                              "cluster.grad_reduce: host")
        self.landers = landers(self.workers_per_node, self.cluster.grad_reduce)
        self.sizing = size_cluster(self.spec, engine_cfg, opt_cfg, num_workers, nodes, self.cluster.grad_reduce,
                                   self.cluster.grad_ring_mb, self.reference, rollout=stage == "grpo")
        check_plan(self.sizing, engine_cfg, num_workers)
        self.workers, self.shards, self.placement = [], [], None
        self._started_ray = init_ray(self.cluster, self.sizing.object_store_bytes)
        try:
            self._launch(weights)
        except BaseException:
            self.close()  # a failed start leaves no named placement group, actor or Ray of ours behind
            raise

    def _launch(self, weights: int | str | dict) -> None:
        """Place and start the shards and workers on the Ray `__init__` joined."""
        engine_cfg = self.engine_cfg
        self.gpus_per_worker = self._resolve_gpus_per_worker()
        self.rollout = RolloutPlace.resolve(self.stage, self.cluster.rollout_gpus)
        self._check_cluster_resources()
        if engine_cfg.compute_dtype == "auto":
            # Decided once, from where the workers run: a shard on a CPU-only node would
            # otherwise pick fp32 while GPU workers send bf16 gradients.
            dtype = "bf16" if self.gpus_per_worker > 0 else "fp32"
            self.engine_cfg = engine_cfg = engine_cfg.model_copy(update={"compute_dtype": dtype})
        self.plan = ShardPlan.build(self.spec, self.cluster.num_nodes)
        self.ring = ring_numel(self.spec, engine_cfg.grad_torch_dtype, self.cluster.grad_ring_mb)
        self.generation = 0
        self.placement = self._build_placement()
        self.shards = self._build_shards(weights)
        self._ask_shards([s.start.remote(self.generation, 0) for s in self.shards])
        self.workers = list(self._build_workers(0).values())
        self._form_groups()

    # ------------------------------------------------------------------ building

    def _resolve_gpus_per_worker(self) -> float:
        """The configured GPUs per worker, else one when the cluster has GPUs (decided once per run)."""
        gpus = self.cluster.gpus_per_worker
        if gpus is None:
            gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
        return gpus

    def _check_cluster_resources(self) -> None:
        """Refuse a run the cluster cannot place: more GPU workers than GPUs, an object store too small."""
        have = ray.cluster_resources()
        own = self.rollout.own_gpus if self.rollout else 0.0
        need = self.num_workers * self.gpus_per_worker + own
        if need and need > have.get("GPU", 0):
            rollout = f" and a rollout actor of {own:g} (cluster.rollout_gpus)" if own else ""
            raise ConfigError(f"cluster.num_workers={self.num_workers} workers of {self.gpus_per_worker:g} GPU each"
                              f"{rollout} need {need:g} GPUs; the cluster has {have.get('GPU', 0):g}. Lower "
                              "cluster.num_workers or add GPU nodes")
        stores = sorted(n["Resources"].get("object_store_memory", 0) for n in ray.nodes() if n["Alive"])
        need = self.sizing.object_store_bytes
        usable = stores[-self.cluster.num_nodes:] if len(stores) >= self.cluster.num_nodes else []
        if not usable or min(usable) < need:
            raise ConfigError(
                f"each of the cluster.num_nodes={self.cluster.num_nodes} nodes needs a {need / GIB:.2f} GiB object "
                f"store (batches, and unit-sized transfers between nodes); the cluster's are "
                f"{[round(b / GIB, 2) for b in stores]} GiB. Start Ray with a larger --object-store-memory (or "
                "cluster.object_store_memory_gb in-process), or spread the state over more nodes")

    def _build_placement(self) -> PlacementGroup | None:
        """One bundle per node holding its workers (STRICT_SPREAD); the node's shard joins its bundle."""
        per = self.workers_per_node
        bundle = {k: v * per for k, v in (("CPU", self.cluster.cpus_per_worker), ("GPU", self.gpus_per_worker)) if v}
        if not bundle:
            if self.cluster.num_nodes > 1:
                raise ConfigError("workers spread over nodes must reserve something there: set cluster.cpus_per_worker > 0")
            return None
        check_nodes(ray.nodes(), bundle, self.cluster.num_nodes, self.cluster)
        strategy = "STRICT_SPREAD" if self.cluster.num_nodes > 1 else "STRICT_PACK"
        bundles = [dict(bundle) for _ in range(self.cluster.num_nodes)]
        if self.rollout and self.rollout.own_gpus:  # the rollout actor's own GPUs, beside node 0's workers
            bundles[0]["GPU"] = bundles[0].get("GPU", 0) + self.rollout.own_gpus
        pg = placement_group(bundles, strategy=strategy, name="mt-ray-nodes")
        ready, _ = ray.wait([pg.ready()], timeout=self.cluster.placement_timeout_s)
        if not ready:
            remove_placement_group(pg)
            raise ClusterError(f"the cluster did not offer {self.cluster.num_nodes} separate nodes with {bundle} "
                               f"each within {self.cluster.placement_timeout_s:.0f} s; add nodes, or lower "
                               "cluster.num_nodes or cluster.num_workers")
        return pg

    def _on_node(self, node: int) -> dict:
        """Actor options that pin an actor to `node`'s bundle."""
        if self.placement is None:
            return {}
        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=node)}

    def _build_shards(self, weights: int | str | dict) -> list:
        cls = ray.remote(CoordinatorShard)
        n = self.cluster.num_nodes
        shards = [cls.options(num_cpus=self.cluster.coordinator_cpus, max_restarts=0,
                              max_concurrency=16 + 2 * self.num_workers + 4 * self.workers_per_node + 4 * n, **self._on_node(s)).remote(
            self.model, self.engine_cfg.model_dump(), self.opt_cfg.model_dump(), self.total_steps, s, n,
            self.landers, self.num_workers, self.cluster.snapshot_every, self.ring, self.freeze, self.reference)
            for s in range(n)]
        self._ask_shards([s.set_peers.remote(shards) for s in shards])
        if isinstance(weights, int):
            calls = [s.load_random.remote(weights) for s in shards]
        elif isinstance(weights, (str, Path)):
            calls = [s.load_pretrained.remote(str(weights)) for s in shards]
        else:
            state = ray.put({k: to_numpy(v.detach().contiguous()) for k, v in weights.items()})
            calls = [s.load_state_dict.remote(state) for s in shards]
        self._ask_shards(calls, self._io_timeout_s())
        self.arenas = self._ask_shards([s.arena_handle.remote() for s in shards])
        return shards

    def _build_workers(self, start_step: int, ranks: list[int] | None = None) -> dict[int, object]:
        cls = ray.remote(EngineWorker)
        ranks = range(self.num_workers) if ranks is None else ranks
        workers = {}
        for r in ranks:
            node = r // self.workers_per_node
            workers[r] = cls.options(num_gpus=self.gpus_per_worker, num_cpus=self.cluster.cpus_per_worker,
                                     max_restarts=0, **self._on_node(node)).remote(
                r, self.model, self.engine_cfg.model_dump(), self.opt_cfg.model_dump(), self.total_steps,
                self.shards[node], node, self.cluster.num_nodes, self.landers, self.ring, self.arenas[node],
                self.generation, start_step, self.cluster.placement_timeout_s, self.freeze, self.stage,
                self.pref.model_dump(), self.grpo.model_dump(), self.rollout_beside)
        return workers

    def rollout_options(self, worker: int = 0) -> dict:
        """Ray actor options that place a GRPO rollout replica in worker `worker`'s node bundle (`RolloutPlace`)."""
        node = worker // self.workers_per_node
        return {"num_gpus": self.rollout.gpus, "num_cpus": 0, "max_restarts": 0, **self._on_node(node)}

    def arena_access(self, node: int = 0) -> ArenaAccess:
        """What an actor on `node` needs to map its arena and read the weights the workers stream (a rollout actor
        refreshes its copy from it: nothing model-sized goes through Ray)."""
        cfg = self.engine_cfg
        return ArenaAccess(self.model, self.freeze, self.cluster.num_nodes, node, cfg.dtype, cfg.grad_torch_dtype,
                           self.landers, self.ring, self.reference, self.arenas[node])

    @property
    def weights_timeout_s(self) -> float:
        """How long a reader of the arena waits for a step's updates to land (`cluster.step_timeout_s`)."""
        timeout = self.cluster.step_timeout_s
        return STEP_TIMEOUT_FLOOR_S if timeout == "auto" else timeout

    @property
    def _lone_lander(self) -> bool:
        """Whether worker 0 lands every gradient of the run (one node, one lander): its GPU's norm is the global one."""
        return self.landers == 1 and self.cluster.num_nodes == 1

    @property
    def _grouped(self) -> bool:
        """Whether each node's workers sum gradients between them in a process group (`grad_reduce: nccl`)."""
        return self.landers != self.workers_per_node

    def _form_groups(self) -> None:
        """With `grad_reduce: nccl`, each node's workers form one process group (rank 0's node address)."""
        per = self.workers_per_node
        if not self._grouped:
            return
        calls = []
        for node in range(self.cluster.num_nodes):
            ranks = range(node * per, (node + 1) * per)
            address, port = ray.get(self.workers[ranks[0]].rendezvous.remote(), timeout=self.cluster.placement_timeout_s)
            calls += [self.workers[r].join_group.remote(address, port, i, per, self.cluster.placement_timeout_s)
                      for i, r in enumerate(ranks)]
        ray.get(calls, timeout=self.cluster.placement_timeout_s)

    # ------------------------------------------------------------------ steps

    def train(self, batches: Iterable[Batch]) -> DataParallelResult:
        """Run until `total_steps` or the batches end; returns losses, norms and failure events."""
        t0 = time.perf_counter()
        results, times = [], []
        for batch in itertools.islice(batches, self.total_steps - self.step_idx):
            t_step = time.perf_counter()
            results.append(self.train_step(batch))
            times.append(time.perf_counter() - t_step)
        self.synchronize()
        return DataParallelResult([r.loss.item() for r in results], [r.grad_norm.item() for r in results],
                                  list(self.events), seconds=time.perf_counter() - t0, step_seconds=times)

    def train_step(self, micro_batches: Batch) -> StepResult:
        """One global step over `micro_batches` (split across the workers); returns when all are done.

        If a worker is lost, the step stops on the shards, new workers start, and the steps since
        the resume point are replayed from the batches kept here, so no data and no update is
        lost or applied twice. Should the shards complete this very step from the gradients
        already in, its loss is unknown (the lost worker held a share): NaN.
        """
        target = self.step_idx
        self._kept[target] = micro_batches
        result = None
        while self.step_idx <= target:
            try:
                outcome = self._run_step(self.step_idx, self._kept[self.step_idx])
            except _LOST_WORKER as e:
                self.step_idx = self._recover(self.step_idx, e)
                continue
            except RayTaskError:
                # A lost shard can surface first as another shard's error through a worker (its peer died while it
                # summed): that is the lost shard's ClusterLostError, and jobs.train restarts from a checkpoint.
                self._ask_shards([s.ping.remote() for s in self.shards])
                raise
            if self.step_idx == target:
                result = outcome
            self.step_idx += 1
        self._forget()
        if result is None:
            nan = torch.tensor(float("nan"))
            return StepResult(nan, nan, lr_at(target, self.opt_cfg, self.total_steps), 0, count_loss_tokens(micro_batches))
        return result

    def _run_step(self, step: int, batch: Batch) -> StepResult:
        shards = shard_batch(batch, self.num_workers, whole=self.stage in WHOLE_MICRO_BATCHES)
        n_global = count_loss_tokens(batch)
        counts = preference_counts(batch) if self.objective is not None else None
        timeout = self._step_timeout(batch)
        self._inflight = [w.train_step.remote(step, s, n_global, timeout, counts)
                          for w, s in zip(self.workers, shards, strict=True)]
        norms = [s.local_norm_sq.remote(self.generation, step, timeout) for s in self.shards]
        if self.after_launch is not None:
            self.after_launch(step, self)
        # The driver waits here for every worker's share of the step (its gradients summed on its node)...
        outs = self._wait_workers(step, timeout, norms)
        # ...then for every shard's norm², whose total (shard order, so a rerun clips alike) starts the updates;
        # where one worker lands the only gradients (a lone worker, or one node's NCCL sum) it is that GPU's.
        shard_norm_sq = sum(self._ask_shards(norms))  # also: every partial sum sent on has arrived
        norm_sq = outs[0]["norm_sq"] if self._lone_lander else shard_norm_sq
        self._ask_shards([s.apply_norm.remote(step, norm_sq) for s in self.shards])
        loss = sum(o["loss"] for o in outs)  # each worker's loss is its share of the global mean
        self._kept_logps = [t for o in outs for t in o["kept_logps"]]  # rank order is micro-batch order
        aux = None if outs[0]["aux_loss"] is None else torch.tensor(sum(o["aux_loss"] for o in outs), dtype=torch.float64)
        metrics = None if counts is None else self.objective.metrics(summed_metrics(o["pref_sums"] for o in outs), counts)
        return StepResult(torch.tensor(loss, dtype=torch.float64), torch.tensor(norm_sq, dtype=torch.float32).sqrt(),
                          lr_at(step, self.opt_cfg, self.total_steps), sum(o["num_tokens"] for o in outs), n_global,
                          aux, metrics)

    def _step_timeout(self, batch: Batch) -> float:
        """`cluster.step_timeout_s`, or with `auto` STEP_TIMEOUT_FACTOR x the calculator's estimate of this step on
        the slowest device a worker may have, and never under STEP_TIMEOUT_FLOOR_S."""
        if self.cluster.step_timeout_s != "auto":
            return self.cluster.step_timeout_s
        seq = max(mb["input_ids"].shape[1] for mb in batch)
        machine = GPU_MACHINE if self.gpus_per_worker else CPU_MACHINE
        estimate = predicted_step_seconds(self.spec, self.engine_cfg, seq, rows(batch) / self.num_workers, machine)
        return max(STEP_TIMEOUT_FLOOR_S, STEP_TIMEOUT_FACTOR * estimate)

    def _wait_workers(self, step: int, timeout: float, shard_calls: list[ray.ObjectRef]) -> list[dict]:
        """Every worker's answer for `step`; a step past `timeout` is a hung step, named with what it waits for.
        `shard_calls` (the shards' calls of the step) are watched too: a lost shard ends the wait at once, where
        its node's workers would otherwise wait out their own bounds on it."""
        workers, deadline = set(self._inflight), time.monotonic() + timeout
        pending = [*self._inflight, *shard_calls]
        while workers.intersection(pending):
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                break
            ray.get(done)  # a lost worker's (or shard's) error surfaces at once, not after the others' answers
        pending = [ref for ref in pending if ref in workers]
        if pending:
            late = [r for r, ref in enumerate(self._inflight) if ref in pending]
            waits = {u: ranks for part in self._ask_shards([s.pending.remote(step) for s in self.shards])
                     for u, ranks in part.items()}
            raise StepTimeoutError(
                f"step {step} did not finish within cluster.step_timeout_s={timeout:g} s: worker(s) {late} did not "
                f"answer; units the shards still wait for, with the workers whose gradient is in: "
                f"{dict(list(waits.items())[:4]) or 'none'}. Raise cluster.step_timeout_s if steps are this slow")
        return ray.get(self._inflight)

    def evaluate(self, micro_batches: Batch) -> EvalResult:
        """Held-out loss of `micro_batches` split across the workers, forward only (no gradient, no update); a
        preference stage's metric sums added over the workers, with the whole batch's counts."""
        whole = self.stage in WHOLE_MICRO_BATCHES
        parts = shard_batch(micro_batches, min(self.num_workers, len(micro_batches) if whole else rows(micro_batches)),
                            whole)
        timeout = self._step_timeout(micro_batches)
        outs = ray.get([w.evaluate.remote(p, timeout) for w, p in zip(self.workers, parts, strict=False)],
                       timeout=timeout)  # fewer rows than workers: some idle
        pref = (None, None) if self.objective is None else (summed_metrics(o["pref_sums"] for o in outs),
                                                             preference_counts(micro_batches))
        return EvalResult(torch.tensor(sum(o["loss_sum"] for o in outs), dtype=torch.float64),
                          sum(o["num_loss_tokens"] for o in outs), sum(o["num_tokens"] for o in outs), *pref)

    def sequence_logps(self, micro_batches: Batch) -> list[torch.Tensor]:
        """Each micro-batch's sequence log-prob sums under the current weights (`StreamingEngine.sequence_logps`),
        whole micro-batches on each worker (nothing here is normalised over the batch)."""
        parts = shard_batch(micro_batches, min(self.num_workers, len(micro_batches)), whole=True)
        timeout = self._step_timeout(micro_batches)
        outs = ray.get([w.sequence_logps.remote(p, timeout) for w, p in zip(self.workers, parts, strict=False)],
                       timeout=timeout)
        return [s for out in outs for s in out]  # rank order is micro-batch order

    def kept_logps(self) -> list[torch.Tensor]:
        """GRPO: each micro-batch's token log-probs as the last step's workers computed them (`StreamingEngine.
        kept_logps`), in micro-batch order: the rollout's old policy's, without a pass of their own."""
        return list(self._kept_logps)

    def _forget(self) -> None:
        """Drop batches no recovery can need: those before the snapshot before last."""
        every, step = self.cluster.snapshot_every, self.step_idx
        oldest = step if every == 0 else max(0, (step // every - 1) * every)
        for s in [s for s in self._kept if s < oldest]:
            del self._kept[s]

    # ------------------------------------------------------------------ failures

    def _recover(self, step: int, error: BaseException) -> int:
        self._ask_shards([s.ping.remote() for s in self.shards])  # a lost shard is not a lost worker
        healthy, lost = self._sort_workers()
        if len(self.events) >= self.cluster.max_restarts:
            raise ClusterError(f"step {step} failed ({error}) after {len(self.events)} restarts; giving up") from error
        if self._grouped:
            healthy = []  # a lost member breaks its node's process group: every worker is replaced
        for rank, w in enumerate(self.workers):
            if rank not in healthy:
                ray.kill(w, no_restart=True)
        resume, restore, action = self._end_failed_step(step)
        if resume < min(self._kept, default=resume):
            raise ClusterError(f"cannot replay from step {resume}: its batch is no longer kept")
        self.generation += 1
        self._ask_shards([s.start.remote(self.generation, resume, restore) for s in self.shards])
        event = FailureEvent(step, f"{type(error).__name__}: {error}".splitlines()[0], lost, resume, action)
        self.events.append(event)
        log.warning("worker(s) %s lost in step %d (%s); %s; resuming at step %d", lost, step, event.error, action, resume)
        # Workers that finished the step are healthy: they rejoin (no restart, no re-import); the rest are replaced.
        fresh = self._build_workers(resume, [r for r in range(self.num_workers) if r not in healthy])
        ray.get([self.workers[r].rejoin.remote(self.generation, resume) for r in healthy], timeout=self.weights_timeout_s)
        self.workers = [fresh.get(r, w) for r, w in enumerate(self.workers)]
        self._form_groups()
        return resume

    def _end_failed_step(self, step: int) -> tuple[int, bool, str]:
        """Stop `step` on every shard and decide: (step to resume at, restore the snapshot, what was done).

        With clipping no unit is updated before every gradient of the step is in, so the step is
        redone, or completed if every gradient was in. Without clipping some units may already be
        updated: the snapshot is restored and the steps since it replayed; with no snapshot only
        the newest checkpoint holds a consistent state. A step whose answers are needed beside its
        update (GRPO's first on a rollout: its log-probs are the old policy's) is never completed
        without them: it is redone, or restored as an unclipped one.
        """
        reports = self._ask_shards([s.stop.remote(step) for s in self.shards])
        if all(r["complete"] for r in reports) and not self._keeps_logps(step):
            norm_sq = sum(r["norm_sq"] for r in reports if r["norm_sq"] is not None)
            if any(r["norm_sq"] is not None for r in reports):
                self._ask_shards([s.apply_norm.remote(step, norm_sq) for s in self.shards])
            return step + 1, False, "step had every gradient; completed"
        if self.opt_cfg.max_grad_norm > 0 or not any(r["touched"] for r in reports):
            return step, False, "no unit updated; step redone"
        if self.cluster.snapshot_every == 0:
            raise ClusterLostError(
                f"a worker was lost in step {step} after some units were updated (optimizer.max_grad_norm=0 updates "
                "each unit as its gradient lands); the run restarts from the newest checkpoint "
                "(cluster.snapshot_every > 0 recovers in memory instead, at 12 B/param more per node)")
        # Every shard with a trained unit took its snapshot at the same step; one of frozen units alone takes none.
        snapshot = next(r["snapshot_step"] for r in reports if r["snapshot_step"] is not None)
        return snapshot, True, "units partly updated; restored snapshot"

    def _keeps_logps(self, step: int) -> bool:
        """Whether `step` is a GRPO rollout's first of several, whose workers' log-probs the next steps need."""
        return self.stage == "grpo" and self.grpo.num_iterations > 1 and "old_logps" not in self._kept[step][0]

    def _sort_workers(self) -> tuple[list[int], list[int]]:
        """Ranks whose share of the failed step came back (healthy), and ranks whose actor died (lost)."""
        # Survivors never wait on a lost worker within a step, so they finish; the grace bounds a hung one.
        done, _ = ray.wait(self._inflight, num_returns=len(self._inflight), timeout=self.cluster.recovery_grace_s)
        healthy, lost = [], []
        for rank, ref in enumerate(self._inflight):
            if ref not in done:
                continue
            try:
                ray.get(ref)
                healthy.append(rank)
            except RayActorError:
                lost.append(rank)
            except Exception:  # failed some other way: replaced, not counted as lost
                pass
        return healthy, lost

    def close(self) -> None:
        for actor in [*self.workers, *self.shards]:
            ray.kill(actor, no_restart=True)
        if self.placement is not None:
            remove_placement_group(self.placement)
        if self._started_ray:
            ray.shutdown()


def freeze_options(spec: ModelSpec) -> dict[str, bool]:
    """The `discover` options that find `spec` again in an actor: an image-text model's freeze flags."""
    if spec.vision is None:
        return {}
    return {"freeze_vision_tower": spec.unit(VISION_EMBED).frozen,
            "freeze_multi_modal_projector": spec.unit(VISION_PROJECTOR).frozen}
