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
places beside the workers (`rollout_host`, mt_ray.cluster.actors), reading the weights from their node's
arena. Workers sit in a placement group, the same number on each node beside that
node's coordinator shard (mt_ray.cluster.shard), which sums their gradients and owns one
contiguous part of the fp32 state.

A step: the workers run forward and backward; each shard reports the norm² of its summed
units; the driver adds them (shard order) and hands the global norm back, which starts the
clipped updates. A worker lost mid-step (its actor died, or the step timed out) stops the
step on every shard; new workers start and the steps since the resume point are replayed from
the batches kept here, so no data and no update is lost or applied twice. A lost shard or
node loses state: `ClusterLostError`, and `jobs.train` restarts from the newest checkpoint.

Owners: the actors and their placement (mt_ray.cluster.actors), the shards as the driver calls them and the
whole-state transfers (mt_ray.cluster.shard_set), the recovery policy (mt_ray.cluster.recovery); this module runs
the steps.
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
from transformers import GenerationConfig

from mt_ray.cluster.actors import (
    ClusterActors,
    Reservation,
    RolloutHost,
    check_cluster_resources,
    resolve_gpus_per_worker,
)
from mt_ray.cluster.arena import ring_numel
from mt_ray.cluster.config import ClusterConfig
from mt_ray.cluster.errors import ClusterError, StepTimeoutError
from mt_ray.cluster.partition import ShardPlan
from mt_ray.cluster.placement import RolloutPlace, check_plan, init_ray
from mt_ray.cluster.recovery import FailureEvent, decide_recovery
from mt_ray.cluster.rollout_host import WeightsVersion
from mt_ray.cluster.run_spec import RunSpec, freeze_options, plan_nodes
from mt_ray.cluster.shard_set import ShardSet
from mt_ray.cluster.sizing import landers, size_cluster
from mt_ray.cluster.split import Batch, count_loss_tokens, rows, shard_batch
from mt_ray.cluster.stages import WHOLE_MICRO_BATCHES, stage_objective, summed_metrics
from mt_ray.cluster.step_wait import ask_workers, sort_answers, step_timeout, wait_workers, weights_timeout
from mt_ray.cluster.wire import to_numpy
from mt_ray.engine.batch import preference_counts
from mt_ray.engine.config import EngineConfig, OptimizerConfig
from mt_ray.engine.grpo import GrpoConfig
from mt_ray.engine.optimizer import lr_at
from mt_ray.engine.preference import PreferenceConfig
from mt_ray.engine.results import EvalResult, StepResult
from mt_ray.engine.sizing import Stage
from mt_ray.errors import ConfigError
from mt_ray.models.discovery import ModelSpec, discover

log = logging.getLogger(__name__)

_LOST_WORKER = (RayActorError, GetTimeoutError, ObjectLostError, StepTimeoutError)
@dataclass
class DataParallelResult:
    """What a data-parallel run returns; `state_dict` is None unless asked for."""

    losses: list[float]
    grad_norms: list[float]
    events: list[FailureEvent] = field(default_factory=list)
    state_dict: dict[str, torch.Tensor] | None = None
    seconds: float = 0.0
    step_seconds: list[float] = field(default_factory=list)  # driver wall time of each step, recoveries included


class DataParallelTrainer:
    """Controller of one run: a coordinator shard per node, `num_workers` engine workers, the step loop.

    It trains like a `StreamingEngine` (`train_step`, `save_checkpoint`, `export`, ...), so the
    `Trainer` drives either. `after_launch(step, trainer)` runs right after a step's work is
    handed to the workers (a seam for tests and fault injection). `stage` is the run's `training.stage`
    with its `pref` (or `grpo`) section; the reference a preference stage (or GRPO at β > 0) streams is the
    starting weights, kept in each node's arena. GRPO's completions come from rollout replicas the training
    side places beside the workers (`rollout_host`); the workers only train.
    """

    def __init__(self, model, engine_cfg: EngineConfig, opt_cfg: OptimizerConfig, num_workers: int,
                 total_steps: int, cluster: ClusterConfig | None = None, weights: int | str | dict = 0,
                 after_launch: Callable[[int, DataParallelTrainer], None] | None = None, stage: str = "sft",
                 pref: PreferenceConfig | None = None, grpo: GrpoConfig | None = None):
        self.stage, self.pref, self.grpo = stage, pref or PreferenceConfig(), grpo or GrpoConfig()
        self.objective = stage_objective(stage, self.pref, self.grpo)
        self.reference = Stage.of(stage, self.pref, self.grpo).reference  # each node's arena keeps the reference
        if engine_cfg.state_placement != "host":  # the shards keep master and moments in the node's shared memory
            raise ConfigError(f"engine.state_placement: {engine_cfg.state_placement} runs on a single engine for now; "
                              "use cluster.num_workers: 1, or state_placement: host")
        self.spec = model if isinstance(model, ModelSpec) else discover(model)
        self.engine_cfg, self.opt_cfg, self.num_workers, self.total_steps = engine_cfg, opt_cfg, num_workers, total_steps
        self.cluster = cluster or ClusterConfig()
        self.after_launch = after_launch
        self.events: list[FailureEvent] = []
        self.step_idx, self.generation = 0, 0
        self._kept_logps: list[torch.Tensor] = []
        self._kept: dict[int, Batch] = {}  # batches a recovery may have to replay
        self._inflight: list[ray.ObjectRef] = []
        self._check_config()
        self.landers = landers(self.workers_per_node, self.cluster.grad_reduce)
        self.sizing = size_cluster(self.spec, engine_cfg, opt_cfg, num_workers, self.cluster.num_nodes,
                                   self.cluster.grad_reduce, self.cluster.grad_ring_mb, self.reference,
                                   rollout=stage == "grpo")
        check_plan(self.sizing, engine_cfg, num_workers)
        self.actors: ClusterActors | None = None
        self.state: ShardSet | None = None
        self._started_ray = init_ray(self.cluster, self.sizing.object_store_bytes)
        try:
            self._launch(weights)
        except BaseException:
            self.close()  # a failed start leaves no named placement group, actor or Ray of ours behind
            raise

    def _check_config(self) -> None:
        nodes = self.cluster.num_nodes
        if self.num_workers % nodes:
            raise ConfigError(f"cluster.num_workers={self.num_workers} cannot spread evenly over "
                              f"cluster.num_nodes={nodes}; make num_nodes a divisor of num_workers")
        self.workers_per_node = self.num_workers // nodes
        if self.engine_cfg.grad_torch_dtype == torch.float16:
            raise ConfigError("a data-parallel run sums gradients in bf16 or fp32; engine.compute_dtype: fp16 with "
                              "engine.grad_dtype: compute would send fp16. Set engine.grad_dtype: fp32, or "
                              "engine.compute_dtype: bf16")
        if self.cluster.grad_reduce == "nccl" and self.spec.vision is not None:
            raise ConfigError("cluster.grad_reduce: nccl cannot train an image-text model (a worker whose rows hold "
                              "no image sends no vision gradient, so the node's collectives would not match); use "
                              "cluster.grad_reduce: host")

    def _launch(self, weights: int | str | dict) -> None:
        """Plan every node once, then place and start the shards and workers on the Ray `__init__` joined."""
        self.gpus_per_worker = resolve_gpus_per_worker(self.cluster)
        self.rollout = RolloutPlace.resolve(self.stage, self.cluster.rollout_gpus)
        want = Reservation(self.num_workers, self.gpus_per_worker, self.rollout)
        check_cluster_resources(self.cluster, want, self.sizing)
        if self.engine_cfg.compute_dtype == "auto":
            # Decided once, from where the workers run: a shard on a CPU-only node would
            # otherwise pick fp32 while GPU workers send bf16 gradients.
            dtype = "bf16" if self.gpus_per_worker > 0 else "fp32"
            self.engine_cfg = self.engine_cfg.model_copy(update={"compute_dtype": dtype})
        self.plan = ShardPlan.build(self.spec, self.cluster.num_nodes)
        self.run_spec = RunSpec(self.spec.config, freeze_options(self.spec), self.engine_cfg, self.opt_cfg,
                                self.total_steps, self.cluster.num_nodes, self.stage, self.pref, self.grpo)
        ring = ring_numel(self.spec, self.engine_cfg.grad_torch_dtype, self.cluster.grad_ring_mb)
        nodes = plan_nodes(self.spec, self.plan, self.engine_cfg, self.workers_per_node, self.landers, ring,
                           self.reference)
        self.actors = ClusterActors(self.run_spec, nodes, self.cluster, want)
        self.actors.place()
        self.state = ShardSet(self.actors.build_shards(), self.spec, self.plan, self.weights_timeout_s)
        self.state.call("set_peers", self.state.handles)
        self._load(weights)
        self.actors.arenas = self.state.call("arena_handle")
        self.state.call("start", self.generation, 0)
        self.actors.workers = list(self.actors.build_workers(self.generation, 0).values())
        self.actors.form_groups()

    def _load(self, weights: int | str | dict) -> None:
        """The starting weights into every shard: a seed, a checkpoint folder or a state dict."""
        if isinstance(weights, int):
            self.state.call("load_random", weights, timeout_s=self.state.io_timeout_s)
        elif isinstance(weights, (str, Path)):
            self.state.call("load_pretrained", str(weights), timeout_s=self.state.io_timeout_s)
        else:
            state = ray.put({k: to_numpy(v.detach().contiguous()) for k, v in weights.items()})
            self.state.call("load_state_dict", state, timeout_s=self.state.io_timeout_s)

    @property
    def shards(self) -> list:
        """The coordinator shards' handles, by node."""
        return self.state.handles if self.state is not None else []

    @property
    def workers(self) -> list:
        """The workers' handles, by rank."""
        return self.actors.workers if self.actors is not None else []

    @property
    def weights_timeout_s(self) -> float:
        """How long a reader of the arena waits for a step's updates to land (`cluster.step_timeout_s`)."""
        return weights_timeout(self.cluster)

    @property
    def _lone_lander(self) -> bool:
        """Whether worker 0 lands every gradient of the run (one node, one lander): its GPU's norm is the global one."""
        return self.landers == 1 and self.cluster.num_nodes == 1

    @property
    def rollout_host(self) -> RolloutHost:
        """GRPO's rollout replicas' interface to the cluster (`actors.RolloutHost`)."""
        return RolloutHost(self.actors, self.rollout, self._weights_version, self.weights_timeout_s)

    def _weights_version(self) -> WeightsVersion:
        return WeightsVersion(self.step_idx, self.generation, self.weights_timeout_s)

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
                self.state.call("ping")
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
        timeout = self._timeout(batch)
        self._inflight = [w.train_step.remote(step, s, n_global, timeout, counts)
                          for w, s in zip(self.workers, shards, strict=True)]
        norms = [s.local_norm_sq.remote(self.generation, step, timeout) for s in self.shards]
        if self.after_launch is not None:
            self.after_launch(step, self)
        # The driver waits here for every worker's share of the step (its gradients summed on its node)...
        outs = wait_workers(step, self._inflight, norms, timeout, lambda: self._pending_units(step))
        # ...then for every shard's norm², whose total (shard order, so a rerun clips alike) starts the updates;
        # where one worker lands the only gradients (a lone worker, or one node's NCCL sum) it is that GPU's.
        shard_norm_sq = sum(self.state.gather(norms, "its norm² of the step"))  # also: every partial sum sent on has arrived
        norm_sq = outs[0]["norm_sq"] if self._lone_lander else shard_norm_sq
        self.state.call("apply_norm", step, norm_sq)
        loss = sum(o["loss"] for o in outs)  # each worker's loss is its share of the global mean
        self._kept_logps = [t for o in outs for t in o["kept_logps"]]  # rank order is micro-batch order
        aux = None if outs[0]["aux_loss"] is None else torch.tensor(sum(o["aux_loss"] for o in outs), dtype=torch.float64)
        metrics = None if counts is None else self.objective.metrics(summed_metrics(o["pref_sums"] for o in outs), counts)
        return StepResult(torch.tensor(loss, dtype=torch.float64), torch.tensor(norm_sq, dtype=torch.float32).sqrt(),
                          lr_at(step, self.opt_cfg, self.total_steps), sum(o["num_tokens"] for o in outs), n_global,
                          aux, metrics)

    def evaluate(self, micro_batches: Batch) -> EvalResult:
        """Held-out loss of `micro_batches` split across the workers, forward only (no gradient, no update); a
        preference stage's metric sums added over the workers, with the whole batch's counts."""
        whole = self.stage in WHOLE_MICRO_BATCHES
        parts = shard_batch(micro_batches, min(self.num_workers, len(micro_batches) if whole else rows(micro_batches)),
                            whole)
        timeout = self._timeout(micro_batches)
        outs = ask_workers([w.evaluate.remote(p, timeout) for w, p in zip(self.workers, parts, strict=False)],
                           "evaluate their rows", timeout)  # fewer rows than workers: some idle
        pref = (None, None) if self.objective is None else (summed_metrics(o["pref_sums"] for o in outs),
                                                             preference_counts(micro_batches))
        return EvalResult(torch.tensor(sum(o["loss_sum"] for o in outs), dtype=torch.float64),
                          sum(o["num_loss_tokens"] for o in outs), sum(o["num_tokens"] for o in outs), *pref)

    def sequence_logps(self, micro_batches: Batch) -> list[torch.Tensor]:
        """Each micro-batch's sequence log-prob sums under the current weights (`StreamingEngine.sequence_logps`),
        whole micro-batches on each worker (nothing here is normalised over the batch)."""
        parts = shard_batch(micro_batches, min(self.num_workers, len(micro_batches)), whole=True)
        timeout = self._timeout(micro_batches)
        outs = ask_workers([w.sequence_logps.remote(p, timeout) for w, p in zip(self.workers, parts, strict=False)],
                           "score their sequences", timeout)
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

    def _timeout(self, batch: Batch) -> float:
        return step_timeout(self.cluster, self.spec, self.engine_cfg, self.gpus_per_worker, self.num_workers, batch)

    def _pending_units(self, step: int) -> dict[str, list[int]]:
        """Units of `step` the shards still wait for, each with the workers whose gradient of it is in."""
        return {u: ranks for part in self.state.call("pending", step) for u, ranks in part.items()}

    # ------------------------------------------------------------------ failures

    def _recover(self, step: int, error: BaseException) -> int:
        self.state.call("ping")  # a lost shard is not a lost worker
        healthy, lost = sort_answers(self._inflight, self.cluster.recovery_grace_s)
        if len(self.events) >= self.cluster.max_restarts:
            raise ClusterError(f"step {step} failed ({error}) after {len(self.events)} restarts; giving up") from error
        if self.actors.grouped:
            healthy = []  # a lost member breaks its node's process group: every worker is replaced
        replaced = [r for r in range(self.num_workers) if r not in healthy]
        self.actors.kill_workers(replaced)
        reports = self.state.call("stop", step)
        decision = decide_recovery(step, reports, self.opt_cfg.max_grad_norm > 0, self.cluster.snapshot_every,
                                   self._keeps_logps(step))
        if decision.norm_sq is not None:
            self.state.call("apply_norm", step, decision.norm_sq)
        resume = decision.resume_at
        if resume < min(self._kept, default=resume):
            raise ClusterError(f"cannot replay from step {resume}: its batch is no longer kept")
        self.generation += 1
        self.state.call("start", self.generation, resume, decision.restore_snapshot)
        event = FailureEvent(step, f"{type(error).__name__}: {error}".splitlines()[0], lost, resume, decision.action)
        self.events.append(event)
        log.warning("worker(s) %s lost in step %d (%s); %s; resuming at step %d", lost, step, event.error,
                    decision.action, resume)
        # Workers that finished the step are healthy: they rejoin (no restart, no re-import); the rest are replaced.
        fresh = self.actors.build_workers(self.generation, resume, replaced)
        ask_workers([self.workers[r].rejoin.remote(self.generation, resume) for r in healthy], "rejoin",
                    self.weights_timeout_s, healthy)
        self.actors.workers = [fresh.get(r, w) for r, w in enumerate(self.workers)]
        self.actors.form_groups()
        return resume

    def _keeps_logps(self, step: int) -> bool:
        """Whether `step` is a GRPO rollout's first of several, whose workers' log-probs the next steps need."""
        return self.stage == "grpo" and self.grpo.num_iterations > 1 and "old_logps" not in self._kept[step][0]

    # ------------------------------------------------------------------ state (mt_ray.cluster.shard_set)

    def synchronize(self) -> None:
        """Wait until every update of the steps run so far is in the shards' master weights."""
        self.state.synchronize(self.step_idx)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """fp32 master weights by Hugging Face name (copies: they outlive the trainer and its Ray)."""
        return {k: v.clone() for k, v in self.state.fetch_state(self.step_idx).items()}

    def export(self, out_dir: str | Path, tokenizer=None, dtype: torch.dtype = torch.float32,
               extra_files: tuple[Path, ...] = (), generation: GenerationConfig | None = None) -> Path:
        """Write a Hugging Face folder here, on the driver's node, `extra_files` copied in (processor files)."""
        return self.state.export(self.step_idx, out_dir, tokenizer, dtype, extra_files, generation)

    def save_checkpoint(self, manager, step: int, extra_meta: dict) -> str:
        return self.state.save_checkpoint(manager, step, extra_meta)

    def restore_checkpoint(self, manager, uri: str | None = None) -> dict:
        """Every shard reads its range of a checkpoint (of any run shape) at once; workers rejoin at its step."""
        meta = self.state.read_checkpoint(manager, self.step_idx, uri)
        self.generation += 1
        self.state.call("start", self.generation, meta["step"])
        ask_workers([w.rejoin.remote(self.generation, meta["step"]) for w in self.workers], "rejoin",
                    self.weights_timeout_s)
        self.step_idx = meta["step"]
        self._kept.clear()
        return meta

    def memory_metrics(self) -> dict[str, float]:
        return self.state.memory_metrics()

    def close(self) -> None:
        if self.actors is not None:
            self.actors.close()
        if self._started_ray:
            ray.shutdown()
