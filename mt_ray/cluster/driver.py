"""The driver: places the coordinator and the workers, runs steps, replaces lost workers.

Each global batch (a list of micro-batches) is split across the workers; every worker scales
its loss by the global loss-token count, so the coordinator's sum of their gradients is the
gradient one engine would compute on the whole batch. A worker lost mid-step (its actor died,
or the step timed out) ends that step on the coordinator (see `Coordinator.recover`); new
workers are started and the steps since the resume point are replayed from the batches kept
here, so no data and no update is lost or applied twice.

With `cluster.num_nodes > 1` the workers sit in a placement group, the same number on each
node, next to a reducer (mt_ray.cluster.reducer): only per-node gradient sums reach the
coordinator. A lost worker is replaced on its node; a lost node (its reducer) ends the run.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import ray
import torch
from ray.exceptions import GetTimeoutError, ObjectLostError, RayActorError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from mt_ray.cluster.config import ClusterConfig
from mt_ray.cluster.coordinator import Coordinator
from mt_ray.cluster.errors import ClusterError, ClusterLostError
from mt_ray.cluster.reducer import NodeReducer
from mt_ray.cluster.wire import from_numpy, to_numpy
from mt_ray.cluster.worker import EngineWorker
from mt_ray.engine.batch import IGNORE_INDEX
from mt_ray.engine.config import EngineConfig, OptimizerConfig
from mt_ray.engine.engine import StepResult
from mt_ray.engine.host_store import plan_layout
from mt_ray.engine.optimizer import lr_at
from mt_ray.models.discovery import ModelSpec, discover
from mt_ray.models.weights import export_hf

log = logging.getLogger(__name__)

Batch = list[dict[str, torch.Tensor]]
_LOST_WORKER = (RayActorError, GetTimeoutError, ObjectLostError)


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


def count_loss_tokens(batch: Batch) -> int:
    """Tokens whose next-token label carries loss, counted as the engine counts them."""
    return sum(int((mb.get("labels", mb["input_ids"])[:, 1:] != IGNORE_INDEX).sum()) for mb in batch)


def shard_batch(batch: Batch, num_workers: int) -> list[Batch]:
    """Split a global batch: whole micro-batches when they divide evenly, else rows of each.

    Every piece is a copy: a view (of the loader's step batch, say) would ship its whole storage.
    """
    m = len(batch)
    if m % num_workers == 0:
        per = m // num_workers
        return [[{k: v.clone() for k, v in mb.items()} for mb in batch[r * per : (r + 1) * per]]
                for r in range(num_workers)]
    shards: list[Batch] = [[] for _ in range(num_workers)]
    for mb in batch:
        pieces = {k: torch.tensor_split(v, num_workers) for k, v in mb.items()}
        for r in range(num_workers):
            piece = {k: p[r].clone() for k, p in pieces.items()}
            if piece["input_ids"].shape[0]:
                shards[r].append(piece)
    if any(not s for s in shards):
        rows = sum(mb["input_ids"].shape[0] for mb in batch)
        raise ClusterError(f"a global batch of {rows} rows cannot feed {num_workers} workers; use fewer workers")
    return shards


def plan_object_store_bytes(spec: ModelSpec, cfg: EngineConfig, num_workers: int) -> int:
    """Two versions of the compute-dtype weights, plus one wire-dtype gradient of the model per worker."""
    weight, grad = cfg.dtype.itemsize, cfg.grad_torch_dtype.itemsize
    return int(spec.num_params * (2 * weight + num_workers * grad) * 1.1) + (256 << 20)


def init_ray(cfg: ClusterConfig, object_store_bytes: int) -> bool:
    """Join the configured cluster, 'auto' under RAY_ADDRESS, else start Ray here. True if we started it."""
    if ray.is_initialized():
        return False
    address = cfg.address or ("auto" if os.environ.get("RAY_ADDRESS") else None)
    if address is not None:
        ray.init(address=address)
        return True
    store = int(cfg.object_store_memory_gb * 2**30) if cfg.object_store_memory_gb else object_store_bytes
    ray.init(num_cpus=cfg.num_cpus, object_store_memory=store, include_dashboard=False)
    return True


class DataParallelTrainer:
    """Controller of one run: a coordinator, `num_workers` engine workers, and the step loop.

    It trains like a `StreamingEngine` (`train_step`, `checkpoint_state`, `export`, ...), so the
    `Trainer` drives either. `after_launch(step, trainer)` runs right after a step's work is
    handed to the workers (a seam for tests and fault injection).
    """

    def __init__(self, model, engine_cfg: EngineConfig, opt_cfg: OptimizerConfig, num_workers: int,
                 total_steps: int, cluster: ClusterConfig | None = None, weights: int | str | dict = 0,
                 after_launch: Callable[[int, DataParallelTrainer], None] | None = None):
        self.spec = model if isinstance(model, ModelSpec) else discover(model)
        self.model = self.spec.config  # what the actors rediscover the spec from
        self.engine_cfg = engine_cfg
        self.opt_cfg = opt_cfg
        self.num_workers = num_workers
        self.total_steps = total_steps
        self.cluster = cluster or ClusterConfig()
        self.after_launch = after_launch
        self.events: list[FailureEvent] = []
        self.step_idx = 0
        self._kept: dict[int, Batch] = {}  # batches a recovery may have to replay
        nodes = self.cluster.num_nodes
        if num_workers % nodes:
            raise ClusterError(f"{num_workers} workers cannot spread evenly over {nodes} nodes")
        self.workers_per_node = num_workers // nodes
        self._started_ray = init_ray(self.cluster, plan_object_store_bytes(self.spec, engine_cfg, num_workers))
        self.gpus_per_worker = self._resolve_gpus_per_worker()
        if engine_cfg.compute_dtype == "auto":
            # Decided once, from where the workers run: a coordinator on a CPU-only node would
            # otherwise pick fp32 while GPU workers send bf16 gradients.
            dtype = "bf16" if self.gpus_per_worker > 0 else "fp32"
            self.engine_cfg = engine_cfg = engine_cfg.model_copy(update={"compute_dtype": dtype})
        self.placement = self._build_placement()
        self.coordinator = self._build_coordinator(weights)
        self.reducers = self._build_reducers()
        self.generation = ray.get(self.coordinator.start.remote(0))
        self.workers = list(self._build_workers(0).values())

    def _resolve_gpus_per_worker(self) -> float:
        """The configured GPUs per worker, else one when the cluster has GPUs (decided once per run)."""
        gpus = self.cluster.gpus_per_worker
        if gpus is None:
            gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
        return gpus

    def _build_placement(self) -> PlacementGroup | None:
        """One bundle per node (STRICT_SPREAD) holding its workers; None on one node, where Ray places freely."""
        nodes = self.cluster.num_nodes
        if nodes == 1:
            return None
        per = self.workers_per_node
        bundle = {k: v * per for k, v in (("CPU", self.cluster.cpus_per_worker), ("GPU", self.gpus_per_worker)) if v}
        if not bundle:
            raise ClusterError("workers spread over nodes must reserve something there: set cluster.cpus_per_worker > 0")
        pg = placement_group([bundle] * nodes, strategy="STRICT_SPREAD", name="mt-ray-nodes")
        ready, _ = ray.wait([pg.ready()], timeout=self.cluster.placement_timeout_s)
        if not ready:
            remove_placement_group(pg)
            raise ClusterError(f"the cluster did not offer {nodes} separate nodes with {bundle} each within "
                               f"{self.cluster.placement_timeout_s:.0f} s; add nodes or lower cluster.num_nodes")
        return pg

    def _on_node(self, node: int) -> dict:
        """Actor options that pin an actor to `node`'s bundle (nothing on a single-node run)."""
        if self.placement is None:
            return {}
        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=node)}

    def _build_coordinator(self, weights: int | str | dict):
        node_sums = self.placement is not None
        actor = ray.remote(Coordinator).options(
            num_cpus=self.cluster.coordinator_cpus, max_concurrency=8 + 4 * self.num_workers,
        ).remote(self.model, self.engine_cfg.model_dump(), self.opt_cfg.model_dump(), self.total_steps,
                 self.cluster.num_nodes if node_sums else self.num_workers, self.cluster.snapshot_every, node_sums)
        if isinstance(weights, int):
            ray.get(actor.load_random.remote(weights))
        elif isinstance(weights, (str, Path)):
            ray.get(actor.load_pretrained.remote(str(weights)))
        else:
            ray.get(actor.load_state_dict.remote(weights))
        return actor

    def _build_reducers(self) -> list:
        """A reducer on each node of a multi-node run (none on one node: workers send to the coordinator)."""
        if self.placement is None:
            return []
        cls = ray.remote(NodeReducer)
        return [cls.options(num_cpus=0, max_concurrency=4 + 4 * self.workers_per_node, max_restarts=0,
                            **self._on_node(n)).remote(self.coordinator, n, self.workers_per_node,
                                                       self.engine_cfg.model_dump())
                for n in range(self.cluster.num_nodes)]

    def _build_workers(self, start_step: int, ranks: list[int] | None = None) -> dict[int, object]:
        cls = ray.remote(EngineWorker)
        ranks = range(self.num_workers) if ranks is None else ranks
        workers = {}
        for r in ranks:
            node = r // self.workers_per_node
            workers[r] = cls.options(num_gpus=self.gpus_per_worker, num_cpus=self.cluster.cpus_per_worker,
                                     max_restarts=0, **self._on_node(node)).remote(
                r, self.model, self.engine_cfg.model_dump(), self.opt_cfg.model_dump(), self.total_steps,
                self.coordinator, self.generation, start_step, self.reducers[node] if self.reducers else None)
        return workers

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

        If a worker is lost, the step ends on the coordinator, new workers start, and the steps
        since the coordinator's resume point are replayed from the batches kept here, so no data
        and no update is lost or applied twice. Should the coordinator complete this very step
        from the gradients already in, its loss is unknown (the lost worker held a share): NaN.
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
            if self.step_idx == target:
                result = outcome
            self.step_idx += 1
        self._forget()
        if result is None:
            nan = torch.tensor(float("nan"))
            return StepResult(nan, nan, lr_at(target, self.opt_cfg, self.total_steps), 0, count_loss_tokens(micro_batches))
        return result

    def _run_step(self, step: int, batch: Batch) -> StepResult:
        shards = shard_batch(batch, self.num_workers)
        n_global = count_loss_tokens(batch)
        self._inflight = [w.train_step.remote(step, s, n_global) for w, s in zip(self.workers, shards, strict=True)]
        if self.after_launch is not None:
            self.after_launch(step, self)
        # The only place the driver waits: for every worker to finish its share of the step.
        outs = ray.get(self._inflight, timeout=self.cluster.step_timeout_s)
        [grad_norm] = [o["grad_norm"] for o in outs if o["grad_norm"] is not None]  # one call ended the step
        loss = sum(o["loss"] for o in outs)  # each worker's loss is its share of the global mean
        return StepResult(torch.tensor(loss, dtype=torch.float64), torch.tensor(grad_norm, dtype=torch.float64),
                          lr_at(step, self.opt_cfg, self.total_steps), sum(o["num_tokens"] for o in outs), n_global)

    def _forget(self) -> None:
        """Drop batches no recovery can need: those before the snapshot before last."""
        every, step = self.cluster.snapshot_every, self.step_idx
        oldest = step if every == 0 else max(0, (step // every - 1) * every)
        for s in [s for s in self._kept if s < oldest]:
            del self._kept[s]

    def _recover(self, step: int, error: BaseException) -> int:
        healthy, lost = self._sort_workers()
        if len(self.events) >= self.cluster.max_restarts:
            raise ClusterError(f"step {step} failed ({error}) after {len(self.events)} restarts; giving up") from error
        for rank, w in enumerate(self.workers):
            if rank not in healthy:
                ray.kill(w, no_restart=True)
        try:
            ray.get([r.node_id.remote() for r in self.reducers])
        except RayActorError as e:
            raise ClusterLostError("a node's reducer was lost (did the node fail?); restart from a checkpoint") from e
        resume, self.generation, action = self._ask_coordinator(self.coordinator.recover.remote(step))
        if resume < min(self._kept):
            raise ClusterError(f"cannot replay from step {resume}: its batch is no longer kept")
        event = FailureEvent(step, f"{type(error).__name__}: {error}".splitlines()[0], lost, resume, action)
        self.events.append(event)
        log.warning("worker(s) %s lost in step %d (%s); %s; resuming at step %d", lost, step, event.error, action, resume)
        # Workers that finished the step are healthy: they rejoin (no restart, no re-import); the rest are replaced.
        fresh = self._build_workers(resume, [r for r in range(self.num_workers) if r not in healthy])
        ray.get([self.workers[r].rejoin.remote(self.generation, resume) for r in healthy])
        self.workers = [fresh.get(r, w) for r, w in enumerate(self.workers)]
        return resume

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

    @staticmethod
    def _ask_coordinator(ref: ray.ObjectRef):
        """The answer of a coordinator call; losing the coordinator loses the run's state."""
        try:
            return ray.get(ref)
        except RayActorError as e:
            raise ClusterLostError("the coordinator was lost with the training state; restart from a checkpoint") from e

    def synchronize(self) -> None:
        """Wait until every update of the steps run so far is in the coordinator's master weights."""
        self._ask_coordinator(self.coordinator.wait_updated.remote(self.step_idx))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """fp32 master weights by Hugging Face name (copies: they outlive the trainer and its Ray)."""
        return {k: v.clone() for k, v in self._fetch_state().items()}

    def export(self, out_dir: str | Path, tokenizer=None, dtype: torch.dtype = torch.float32) -> Path:
        """Write a Hugging Face folder here, on the driver's node (where checkpoints and MLflow are)."""
        return export_hf(self.spec, self._fetch_state(), out_dir, tokenizer, dtype)

    def _fetch_state(self) -> dict[str, torch.Tensor]:
        """Master weights as read-only views of the object fetched from the coordinator."""
        self.synchronize()
        return {k: from_numpy(a, torch.float32) for k, a in self._ask_coordinator(self.coordinator.state_dict.remote()).items()}

    def checkpoint_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """The engine's checkpoint tensors and meta (same layout, so either kind of run resumes from it).

        The tensors are read-only views of one object fetched from the coordinator: while a
        checkpoint is written, the driver's node holds the 12 B/param of master and moments.
        """
        self.synchronize()
        arrays = self._ask_coordinator(self.coordinator.checkpoint_state.remote())
        meta = {"step": self.step_idx, "layout": plan_layout(self.spec, None).describe()}
        return {k: from_numpy(a, torch.float32) for k, a in arrays.items()}, meta

    def checkpoint_buffers(self) -> None:
        """None: a checkpoint is read into new tensors here, then shipped to the coordinator."""
        return None

    def load_checkpoint_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        """Restore `checkpoint_state()` output on the coordinator; the workers rejoin at its step."""
        plan_layout(self.spec, None).check_matches(meta["layout"])
        self.synchronize()
        arrays = {k: to_numpy(v.contiguous()) for k, v in tensors.items()}
        self.generation = self._ask_coordinator(self.coordinator.load_checkpoint_state.remote(arrays, meta))
        ray.get([w.rejoin.remote(self.generation, meta["step"]) for w in self.workers])
        self.step_idx = meta["step"]
        self._kept.clear()

    def memory_metrics(self) -> dict[str, float]:
        """Peak host bytes per parameter of the coordinator, the process holding the state."""
        return {"host_bytes_per_param": self._ask_coordinator(self.coordinator.rss_bytes_per_param.remote())}

    def close(self) -> None:
        for actor in [*self.workers, *self.reducers, self.coordinator]:
            ray.kill(actor, no_restart=True)
        if self.placement is not None:
            remove_placement_group(self.placement)
        if self._started_ray:
            ray.shutdown()


def run_data_parallel(model, engine_cfg: EngineConfig, opt_cfg: OptimizerConfig,
                      batches: Iterable[Batch] | Callable[[], Iterable[Batch]], num_workers: int,
                      total_steps: int | None = None, weights: int | str | dict = 0,
                      cluster: ClusterConfig | None = None, return_state: bool = False,
                      export_dir: str | Path | None = None) -> DataParallelResult:
    """Train `model` data-parallel on `num_workers` engine workers (one per GPU, or CPU workers).

    model: a ModelSpec, a transformers config, a config dict with model_type, or a local folder.
    batches: global batches (each a list of micro-batches), or a factory returning them.
    weights: a random-init seed, a safetensors folder, or a state dict by Hugging Face name.
    Ray is started in-process unless already running, `cluster.address` is set, or RAY_ADDRESS is.
    """
    if callable(batches):
        batches = batches()
    if total_steps is None:
        if not hasattr(batches, "__len__"):
            raise ClusterError("total_steps is needed when the batches have no length (it sets the LR schedule)")
        total_steps = len(batches)
    trainer = DataParallelTrainer(model, engine_cfg, opt_cfg, num_workers, total_steps, cluster, weights)
    try:
        result = trainer.train(batches)
        if return_state:
            result.state_dict = trainer.state_dict()
        if export_dir is not None:
            trainer.export(export_dir)
        return result
    finally:
        trainer.close()
