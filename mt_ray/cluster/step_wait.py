"""The driver's waits on a step: how long a step may take, every worker's answer within it, and which workers
answered a failed one.

Each wait is bounded and its error names the workers that did not answer and the units the shards still wait for.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import ray
from ray.exceptions import RayActorError

from mt_ray.cluster.config import ClusterConfig
from mt_ray.cluster.errors import StepTimeoutError
from mt_ray.cluster.split import Batch, rows
from mt_ray.engine.config import EngineConfig
from mt_ray.engine.step_time import Machine, predicted_step_seconds
from mt_ray.models.discovery import ModelSpec

# `cluster.step_timeout_s: auto`: this many times the calculator's step estimate, and at least the floor
# (a first step also builds each worker's templates and maps its arena).
STEP_TIMEOUT_FACTOR = 10
STEP_TIMEOUT_FLOOR_S = 600.0
GPU_MACHINE = Machine()
CPU_MACHINE = Machine(layer_tflops=0.02, h2d_gbps=5.0)  # a slow CPU's fp32 matmuls: a bound, not a prediction


def weights_timeout(cluster: ClusterConfig) -> float:
    """How long a reader of the arena waits for a step's updates to land (`cluster.step_timeout_s`; auto: the
    floor)."""
    timeout = cluster.step_timeout_s
    return STEP_TIMEOUT_FLOOR_S if timeout == "auto" else timeout


def step_timeout(cluster: ClusterConfig, spec: ModelSpec, cfg: EngineConfig, gpus_per_worker: float,
                 num_workers: int, batch: Batch) -> float:
    """`cluster.step_timeout_s`, or with `auto` STEP_TIMEOUT_FACTOR x the calculator's estimate of this step on
    the slowest device a worker may have, and never under STEP_TIMEOUT_FLOOR_S."""
    if cluster.step_timeout_s != "auto":
        return cluster.step_timeout_s
    seq = max(mb["input_ids"].shape[1] for mb in batch)
    machine = GPU_MACHINE if gpus_per_worker else CPU_MACHINE
    estimate = predicted_step_seconds(spec, cfg, seq, rows(batch) / num_workers, machine)
    return max(STEP_TIMEOUT_FLOOR_S, STEP_TIMEOUT_FACTOR * estimate)


def wait_workers(step: int, inflight: list[ray.ObjectRef], shard_calls: list[ray.ObjectRef], timeout: float,
                 pending_units: Callable[[], dict[str, list[int]]]) -> list[dict]:
    """Every worker's answer for `step` (`inflight`, by rank); a step past `timeout` is a hung step, named with the
    workers that did not answer and what the shards still wait for (`pending_units`). `shard_calls` (the shards'
    calls of the step) are watched too: a lost shard ends the wait at once, where its node's workers would otherwise
    wait out their own bounds on it."""
    workers, deadline = set(inflight), time.monotonic() + timeout
    pending = [*inflight, *shard_calls]
    while workers.intersection(pending):
        done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not done:
            break
        ray.get(done)  # a lost worker's (or shard's) error surfaces at once, not after the others' answers
    pending = [ref for ref in pending if ref in workers]
    if pending:
        late = [r for r, ref in enumerate(inflight) if ref in pending]
        waits = pending_units()
        raise StepTimeoutError(
            f"step {step} did not finish within cluster.step_timeout_s={timeout:g} s: worker(s) {late} did not "
            f"answer; units the shards still wait for, with the workers whose gradient is in: "
            f"{dict(list(waits.items())[:4]) or 'none'}. Raise cluster.step_timeout_s if steps are this slow")
    return ray.get(inflight)


def ask_workers(calls: list[ray.ObjectRef], what: str, timeout_s: float, ranks: list[int] | None = None) -> list:
    """The answers of `calls` (worker `ranks[i]`'s; default: rank i's) within `timeout_s`; workers that do not
    answer are named with `what` they were asked (StepTimeoutError); a lost worker's error comes as it is."""
    ranks = list(range(len(calls))) if ranks is None else ranks
    _, late = ray.wait(calls, num_returns=len(calls), timeout=timeout_s)
    if late:
        raise StepTimeoutError(f"worker(s) {[ranks[calls.index(c)] for c in late]} did not {what} within "
                               f"cluster.step_timeout_s={timeout_s:g} s: hung; raise cluster.step_timeout_s if steps "
                               "are this slow")
    return ray.get(calls)


def sort_answers(inflight: list[ray.ObjectRef], grace_s: float) -> tuple[list[int], list[int]]:
    """Ranks whose share of a failed step came back (healthy), and ranks whose actor died (lost)."""
    # Survivors never wait on a lost worker within a step, so they finish; the grace bounds a hung one.
    done, _ = ray.wait(inflight, num_returns=len(inflight), timeout=grace_s)
    healthy, lost = [], []
    for rank, ref in enumerate(inflight):
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
