"""The cluster's waits sleep on the arena's bell (no poll) and end, bounded, naming the worker, the unit and what it
waited for; the driver's recovery policy is a typed decision."""

import resource
import threading
import time

import pytest
import torch

from mt_ray.cluster.arena import ArenaLayout, NodeArena
from mt_ray.cluster.errors import ClusterError, ClusterLostError
from mt_ray.cluster.partition import ShardPlan
from mt_ray.cluster.recovery import RecoveryAction, StepReport, decide_recovery
from mt_ray.models.discovery import discover
from tests.tiny_models import tiny_config


def arena(workers: int = 1) -> NodeArena:
    spec = discover(tiny_config("llama"))
    return NodeArena.create(ArenaLayout.build(spec, ShardPlan.build(spec, 1), 0, torch.float32, torch.float32, workers))


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def test_a_version_wait_sleeps_until_the_shard_writes_the_word():
    node = arena()
    node.begin(generation=1)
    unit = node.layout.units[2]
    t0, cpu0 = time.monotonic(), cpu_seconds()
    threading.Timer(0.5, node.set_version, (unit, 1)).start()
    node.wait_version(unit, 1, generation=1, timeout_s=10)
    woke, cpu = time.monotonic() - t0, cpu_seconds() - cpu0
    assert 0.5 <= woke < 2
    assert cpu < 0.1  # asleep on the bell, not polling the word


def test_a_shard_in_another_process_wakes_the_wait(tmp_path):
    """The bell is a futex on the shared mapping: the shard's write wakes a worker's wait in another process."""
    import multiprocessing

    node = arena()
    node.begin(generation=1)
    unit = node.layout.units[0]
    ctx = multiprocessing.get_context("fork")
    done = ctx.Event()
    child = ctx.Process(target=_wait_in_child, args=(node.handle(), unit, done))
    child.start()
    time.sleep(0.3)  # the child is asleep on the bell (a test's pause, not the wait under test)
    t0 = time.monotonic()
    node.set_version(unit, 5)
    child.join(10)
    assert child.exitcode == 0 and done.is_set() and time.monotonic() - t0 < 5


def _wait_in_child(handle, unit, done):
    NodeArena.attach(handle).wait_version(unit, 5, generation=1, timeout_s=10)
    done.set()


def test_a_step_whose_gradients_are_never_summed_ends_naming_the_worker_and_the_unit(local_ray):
    """`flush` (the worker's last wait of a step) is bounded: the report that no shard acknowledges ends it with the
    worker, the unit and what it waited for."""
    from types import SimpleNamespace

    from mt_ray.cluster.landing import ArenaGrads, LandingBuffers

    node = arena()
    node.begin(generation=0)
    unit = next(iter(node.layout.grad_offsets))
    silent = SimpleNamespace(put_grad=SimpleNamespace(remote=lambda *args: local_ray.put(None)))  # never acknowledges
    landing = LandingBuffers(node, 0, {unit: node.layout.numels[unit]}, timeout_s=0.5)
    grads = ArenaGrads(silent, 3, 0, 0, None, landing, [unit], 0.5, torch.device("cpu"))
    grads.submit(unit, None, None, 0.0)  # a unit its rows did not use: one report
    t0 = time.monotonic()
    with pytest.raises(ClusterError, match=rf"worker 3: .*{unit}"):
        grads.flush()
    assert time.monotonic() - t0 < 5
    grads.close()


def test_recovery_is_a_typed_decision():
    done = StepReport(complete=True, touched=False, norm_sq=None, snapshot_step=None)
    assert decide_recovery(4, [done, done], True, 0, False).action is RecoveryAction.COMPLETED
    lone = StepReport(complete=True, touched=False, norm_sq=2.0, snapshot_step=None)
    completed = decide_recovery(4, [lone], True, 0, False)
    assert (completed.resume_at, completed.norm_sq) == (5, 2.0)
    partial = StepReport(complete=False, touched=True, norm_sq=None, snapshot_step=2)
    redone = decide_recovery(4, [partial], clips=True, snapshot_every=0, keeps_answers=False)
    assert (redone.action, redone.resume_at, redone.restore_snapshot) == (RecoveryAction.REDONE, 4, False)
    restored = decide_recovery(4, [partial], clips=False, snapshot_every=2, keeps_answers=False)
    assert (restored.action, restored.resume_at, restored.restore_snapshot) == (RecoveryAction.RESTORED, 2, True)
    # GRPO's first step of a rollout is never completed without its answers: redone (clipped) instead.
    assert decide_recovery(4, [done], True, 0, keeps_answers=True).action is RecoveryAction.REDONE
    with pytest.raises(ClusterLostError, match="restarts from the newest checkpoint"):
        decide_recovery(4, [partial], clips=False, snapshot_every=0, keeps_answers=False)
