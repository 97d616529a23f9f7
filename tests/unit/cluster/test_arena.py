"""The node's shared-memory arena: its layout, its version words and the workers' gradient rings."""

import threading
import time

import pytest
import torch

from mt_ray.cluster.arena import ABSENT, STOPPED, ArenaLayout, NodeArena, ring_numel
from mt_ray.cluster.errors import ClusterError, StaleGenerationError
from mt_ray.cluster.partition import ShardPlan
from mt_ray.errors import InsufficientMemoryError
from mt_ray.models.discovery import discover
from tests.tiny_models import tiny_config


def arena_of(shard: int = 0, shards: int = 1, workers: int = 1) -> NodeArena:
    spec = discover(tiny_config("llama"))
    layout = ArenaLayout.build(spec, ShardPlan.build(spec, shards), shard, torch.bfloat16, torch.bfloat16, workers)
    return NodeArena.create(layout)


def test_a_worker_maps_the_arena_the_shard_made_and_sees_its_writes():
    shard = arena_of(shard=1, shards=2, workers=2)
    layout = shard.layout
    worker = NodeArena.attach(layout, shard.handle())
    # The shard's own units are its fp32 master, contiguous; the other shard's arrive in the compute dtype.
    owned = [u for u in layout.units if layout.weight_dtypes[u] == torch.float32]
    assert owned and layout.weight_dtypes[layout.units[0]] == torch.bfloat16
    assert sum(layout.numels[u] for u in owned) == shard.master().numel()
    shard.master().copy_(torch.arange(shard.master().numel(), dtype=torch.float32))
    assert torch.equal(worker.weights(owned[0]), shard.master()[: layout.numels[owned[0]]])
    shard.set_version(owned[0], 3)
    assert worker.version(owned[0]) == 3 and worker.version(layout.units[0]) == ABSENT
    assert worker.ring(1).numel() == ring_numel(discover(tiny_config("llama")))
    with pytest.raises(IndexError, match="local worker 0 has no ring"):
        worker.ring(0)  # the first worker lands in the slots


def test_a_version_wait_ends_with_the_step_or_names_the_unit():
    arena = arena_of()
    arena.begin(generation=4)
    unit = arena.layout.units[1]
    threading.Timer(0.05, arena.set_version, (unit, 2)).start()
    arena.wait_version(unit, 2, generation=4, timeout_s=5)  # returns once the word reaches the step
    with pytest.raises(ClusterError, match=rf"unit {unit} did not reach step 3 within cluster.step_timeout_s=0.1 s"):
        arena.wait_version(unit, 3, generation=4, timeout_s=0.1)
    arena.set_state(STOPPED)
    t0 = time.monotonic()
    with pytest.raises(StaleGenerationError):
        arena.wait_version(unit, 3, generation=4, timeout_s=60)
    assert time.monotonic() - t0 < 5


def test_an_arena_the_node_cannot_hold_is_refused_naming_both_sizes():
    spec = discover(tiny_config("llama"))
    layout = ArenaLayout.build(spec, ShardPlan.build(spec, 1), 0, torch.float32, torch.float32, 4)
    with pytest.raises(InsufficientMemoryError, match=r"arena needs \d+\.\d GiB .* but only -?\d+\.\d GiB is free"):
        NodeArena.create(layout, host_memory_limit_gb=0.001)


def test_a_ring_hands_out_gradients_first_in_first_out_and_waits_when_full():
    from mt_ray.cluster.worker import LandingBuffers

    arena = arena_of(workers=2)
    size = arena.layout.ring_numel
    numels = {"a": size // 2, "b": size // 2, "c": size // 3, "d": size}
    ring = LandingBuffers(arena, 1, numels, ring=True, timeout_s=0.2)
    a, b = ring.acquire("a"), ring.acquire("b")
    assert (ring.where("a"), ring.where("b")) == (0, size // 2) and a.data_ptr() != b.data_ptr()
    with pytest.raises(ClusterError, match="no room for c's gradient"):
        ring.acquire("c")  # full until the shard has summed the oldest
    ring.release("a")
    ring.acquire("c")
    assert ring.where("c") == 0  # wrapped to the freed start
    ring.release("b")
    ring.release("c")
    ring.acquire("d")  # the whole ring, once it is empty
    assert ring.where("d") == 0
    # A lone worker on the node lands in the unit's slot itself.
    slots = LandingBuffers(arena, 0, numels, ring=False, timeout_s=1)
    unit = next(iter(arena.layout.grad_offsets))
    assert slots.acquire(unit).data_ptr() == arena.grad(unit).data_ptr()
