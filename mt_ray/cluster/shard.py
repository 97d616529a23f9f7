"""A coordinator shard: one per node, holding the fp32 master weights and Adam moments of its part.

The model is cut into contiguous parts (mt_ray.cluster.partition), one per node. Each node's
shard owns the node's shared-memory arena (mt_ray.cluster.arena), whose weights its workers
stream and whose gradient slots, pool and rings they land their gradients in. It is the Ray actor that
composes the node's owners, each with a module of its own:
- **node reducer** (mt_ray.cluster.node_sum, `NodeSum`). A worker tells it where each unit gradient landed
  (`put_grad`, a few bytes): the node's first worker lands it whole, in the unit's slot, or in the
  node's pool for a unit another node owns (a lone worker's is the sum); the others in pieces in
  their rings. Each range is summed in fp32, in rank order, and rounded once into the first
  worker's landing. The node's sum of a unit another shard owns is sent to that owner, once.
- **owner** (mt_ray.cluster.updates, `UnitUpdates`; mt_ray.cluster.weight_exchange, `WeightExchange`). For its
  own units it adds the nodes' partial sums (node order) in the slot and
  hands the slot to the engine's `OptimizerWorker`, which updates the master in place, in the
  arena. Each update bumps the unit's version word there, which is all a local worker waits
  for; with several nodes the owner also sends the unit's compute-dtype weights to the other
  nodes' shards, which copy them into their arenas.
- **reference keeper** (mt_ray.cluster.shard_io, `ShardStateIO`, with loads and checkpoints). A preference stage that streams a reference gets it in the arena: every
  unit's starting weights, written in the compute dtype as they are loaded (each shard reads the
  whole checkpoint or initialisation anyway), once per node; a checkpoint restores the policy only.
A frozen unit (an image-text model's vision tower, by default) is never updated: it is present
at every version. A vision unit that no worker's rows used in a step (no image anywhere in the
batch) arrives as None from every worker: like torch with a None gradient, it is left as it
is, Adam count included. With clipping, the driver gathers each shard's norm² of its summed
units (or, with one worker in the run, takes the worker's own GPU norm, as the single engine
does) and hands the global norm back (`apply_norm`); no unit is updated before every gradient
of the step is in.

Sums run on one reduce thread and Adam on the optimizer thread, each with an intra-op team of its own
(`shard_state.split_threads`): numba's, whose count holds per thread (`cluster.grad_sum`, `engine.host_adamw`).
The parts share the running generation and its health through one `ShardStatus` (one lock), handed to each.
"""

from __future__ import annotations

import ray
import torch

from mt_ray.cluster.arena import STOPPED, ArenaHandle, NodeArena
from mt_ray.cluster.errors import ClusterError
from mt_ray.cluster.grad_sum import sum_in_order
from mt_ray.cluster.node_memory import NodeMemoryPeak
from mt_ray.cluster.node_sum import NodeSum
from mt_ray.cluster.partition import ShardPlan
from mt_ray.cluster.recovery import StepReport
from mt_ray.cluster.run_spec import NodePlan, RunSpec
from mt_ray.cluster.shard_io import ShardStateIO
from mt_ray.cluster.shard_state import (
    PEER_WAIT_S,
    Generation,
    ShardStatus,
    ShardUnits,
    SumRound,
    UpdateRound,
    split_threads,
)
from mt_ray.cluster.updates import UnitUpdates
from mt_ray.cluster.weight_exchange import WeightExchange
from mt_ray.engine.host_store import HostStore


class CoordinatorShard:
    """A Ray actor with concurrent (threaded) calls; see the module docstring."""

    def __init__(self, run: RunSpec, node: NodePlan, snapshot_every: int = 0):
        """The shard of `node` in the run `run`; its arena is laid out as the driver planned (`node.layout`).
        `snapshot_every`: `cluster.snapshot_every`."""
        self.node_memory = NodeMemoryPeak()  # before anything of the run is allocated here
        spec = run.discover()
        cfg = run.engine
        num_local, num_shards = node.landers, run.num_nodes
        threads, sum_threads = split_threads(cfg.optimizer_thread_count, sums=num_local > 1 or num_shards > 1)
        torch.set_num_threads(threads)  # Ray starts actors with OMP_NUM_THREADS=1
        layout = node.layout
        # Where the workers' pieces of each gradient start and end (the first worker's lands whole; with no
        # further workers, so does every gradient).
        pieces = {u.name: layout.pieces(u.numel) if num_local > 1 else [(0, u.numel)] for u in spec.trainable_units}
        self.units = units = ShardUnits.build(spec, ShardPlan.build(spec, num_shards), node.node, num_local, pieces)
        self.arena = NodeArena.create(layout, cfg.host_memory_limit_gb)
        # The configured limit is checked per node against the whole plan by the driver (check_plan).
        owned = units.plan.units_of(node.node)
        self.store = HostStore(spec, None, False, 0, None, units=owned, master=self.arena.master())
        self.status = ShardStatus(self.arena, node.node)
        self.exchange = WeightExchange(units, self.arena, self.store, cfg.dtype, self.status)
        self.updates = UnitUpdates(units, self.store, run.optimizer, run.total_steps, threads, snapshot_every,
                                   self.status, on_updated=self.exchange.on_updated)
        # One lander on one node (a lone worker, or a node's GPUs summing with NCCL): its engine's GPU norm is the
        # global one, taken as one engine takes it; the driver hands it over.
        self.sums = NodeSum(units, self.arena, self.status, cfg.grad_torch_dtype, sum_threads,
                            gpu_norm=num_local == 1 and num_shards == 1, to_optimizer=self.updates.submit)
        self.io = ShardStateIO(spec, units.owned, self.store, self.arena, self.updates.optimizers, self.node_memory)

    @property
    def optimizers(self) -> dict:
        return self.updates.optimizers

    def set_peers(self, peers: list) -> None:
        """Every shard's handle, by shard index (partial sums go to their unit's owner, updated units to all)."""
        self.sums.peers = self.exchange.peers = peers

    def arena_handle(self) -> ArenaHandle:
        """What this node's workers (and anything beside them) map the arena with."""
        return self.arena.handle()

    # ------------------------------------------------------------------ generations

    def start(self, generation: int, step: int, restore_snapshot: bool = False) -> int:
        """Begin `generation` at `step`: retire the last one's optimizer, mark the weights of `step` as current.

        With `restore_snapshot`, the state (Adam counts included) first goes back to the snapshot; returns its
        step. Otherwise the counts stay: they are the updates each unit has had (a vision unit skips steps
        without images), whether `step` redoes a stopped step or follows a completed one.
        """
        old = self.status.gen
        if old is not None:
            old.stopped = True  # what its optimizer still applies is not sent on: this generation republishes all
            self.updates.retire(old)
        gen = Generation(generation, step, SumRound(), UpdateRound())
        step = self.updates.begin(gen, restore_snapshot)
        self.exchange.begin(gen)
        with self.status.cond:
            self.status.gen = gen
            self.status.error = None
            self.status.cond.notify_all()  # messages of this generation that came early
        self.arena.begin(generation)
        self.exchange.publish_all(gen)
        return step

    def stop(self, step: int) -> StepReport:
        """Refuse this generation's calls from now on (a worker was lost in `step`); report what `step` reached.

        complete: every gradient of this shard's units is summed (with `norm_sq`); touched: some
        unit was updated (only without clipping, where units update as their sums land).
        """
        with self.status.cond:
            gen = self.status.gen
            gen.stopped = True
            self.status.cond.notify_all()
        self.arena.set_state(STOPPED)  # workers waiting for weights or for acknowledgements give up
        self.sums.stop(gen)  # sums already queued have finished
        norms = gen.updates.norms.get(step, {})
        complete = step in gen.updates.ended or len(norms) == len(self.units.trained)
        norm_sq = None
        if complete and step not in gen.updates.ended:
            # A lone worker's norm was its GPU's, lost with it: taken here from the slots it landed in instead.
            norm_sq = self.updates.norm_total({u: sum_in_order([self.arena.grad(u)], None) if n is None else n
                                               for u, n in norms.items()})
        snapshot = self.updates.snapshot
        return StepReport(complete, step in gen.updates.touched, norm_sq, snapshot.step if snapshot else None)

    def wait_updated(self, version: int) -> None:
        """Block until every trained unit of this shard has had `version` optimizer steps."""
        self.updates.wait_updated(self.status.gen, version)

    def busy_seconds(self) -> dict[str, float]:
        """Cumulative busy time of the sums, the publication puts and Adam (this generation's optimizer)."""
        return {"sum": self.sums.busy_s, "publish": self.exchange.busy_s,
                "adam": self.updates.busy_seconds(self.status.gen)}

    def units_summed(self, step: int) -> int:
        """How many of this shard's units of `step` are summed (for monitoring and tests)."""
        with self.status.cond:
            return len(self.updates.summed(self.status.gen, step))

    def pending(self, step: int) -> dict[str, list[int]]:
        """Units of `step` not yet summed here, each with the local workers whose gradient of it is in
        (what a hung step waits for)."""
        with self.status.cond:
            gen = self.status.gen
            done = self.updates.summed(gen, step)
            local = self.sums.ranks_in(gen, step)
            return {u: local.get(u, []) for u in self.units.trained if u not in done} | local

    def local_norm_sq(self, generation: int, step: int, timeout_s: float = PEER_WAIT_S) -> float:
        """Once every unit of this shard is summed for `step` (and partials sent on have arrived): its norm²
        (0 with one worker in the run: the driver takes its GPU's). Bounded by `timeout_s`, naming what is missing."""
        status, trained = self.status, self.units.trained
        with status.cond:
            done = status.cond.wait_for(lambda: status.stale(generation) or status.error is not None
                                        or len(status.gen.updates.norms.get(step, {})) == len(trained),
                                        timeout=timeout_s)
            status.raise_if_stale(generation)
            gen = status.gen
            if not done:
                missing = [u for u in trained if u not in gen.updates.norms.get(step, {})]
                raise ClusterError(f"shard {self.units.shard}: step {step}'s sums of {missing[:4]} ({len(missing)} "
                                   f"units) did not come within {timeout_s:g} s (cluster.step_timeout_s)")
        self.sums.wait_forwarded(gen, step, timeout_s)
        return self.updates.norm_total(gen.updates.norms.get(step, {}))  # a shard of frozen units alone has none

    def apply_norm(self, step: int, norm_sq: float) -> None:
        """The step's global norm² (from every shard): the clipped updates of this shard's units begin."""
        self.updates.apply_norm(self.status.gen, step, norm_sq)

    def ping(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def close(self) -> None:
        self.node_memory.close()
        if self.status.gen is not None:
            self.status.gen.updates.opt.close()
        self.exchange.close()
        self.sums.close()

    # ------------------------------------------------------------------ workers' and peers' calls

    def put_grad(self, generation: int, step: int, rank: int, unit: str, where: int | None,
                 piece: int | None, seq: int) -> None:
        """A local worker's gradient of `unit` has landed (`NodeSum.put_grad`); returns at once."""
        self.sums.put_grad(generation, step, rank, unit, where, piece, seq)

    def put_partial(self, generation: int, step: int, node: int, unit: str, partial: list) -> None:
        """Another node's sum of an owned unit's gradients (`NodeSum.put_partial`)."""
        self.sums.put_partial(generation, step, node, unit, partial)

    def put_weights(self, generation: int, unit: str, version: int, weights: list) -> None:
        """Another shard's updated unit, copied into this node's arena (`WeightExchange.put_weights`)."""
        self.exchange.put_weights(generation, unit, version, weights)

    # ------------------------------------------------------------------ state in and out (ShardStateIO)

    def load_random(self, seed: int = 0) -> None:
        self.io.load_random(seed)

    def load_pretrained(self, folder: str) -> None:
        self.io.load_pretrained(folder)

    def load_state_dict(self, state: dict) -> None:
        self.io.load_state_dict(state)

    def state_part(self) -> dict:
        return self.io.state_part()

    def write_checkpoint_part(self, writer, pieces: dict[str, list], starts: dict[str, int], io_workers: int) -> dict:
        return self.io.write_checkpoint_part(writer, pieces, starts, io_workers)

    def read_checkpoint_part(self, stored, starts: dict[str, int]) -> None:
        self.io.read_checkpoint_part(stored, starts)

    def adam_counts_behind(self, step: int) -> dict[str, int]:
        return self.io.adam_counts_behind(step)

    def host_bytes(self) -> dict[str, int]:
        return self.io.host_bytes()
