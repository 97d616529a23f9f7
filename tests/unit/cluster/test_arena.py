"""The node's shared-memory arena: its layout, its version words and the workers' gradient rings."""

import threading
import time

import pytest
import torch

from mt_ray.cluster.arena import (
    ABSENT,
    ACK_WORDS,
    POOL_UNITS,
    RING_PIECES,
    SLOT,
    STOPPED,
    ArenaLayout,
    NodeArena,
    pool_numel,
    ring_numel,
)
from mt_ray.cluster.errors import ClusterError, StaleGenerationError
from mt_ray.cluster.landing import LandingBuffers
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
    worker = NodeArena.attach(shard.handle())
    # The shard's own units are its fp32 master, contiguous; the other shard's arrive in the compute dtype.
    owned = [u for u in layout.units if layout.weight_dtypes[u] == torch.float32]
    assert owned and layout.weight_dtypes[layout.units[0]] == torch.bfloat16
    assert sum(layout.numels[u] for u in owned) == shard.master().numel()
    shard.master().copy_(torch.arange(shard.master().numel(), dtype=torch.float32))
    assert torch.equal(worker.weights(owned[0]), shard.master()[: layout.numels[owned[0]]])
    shard.set_version(owned[0], 3)
    assert worker.version(owned[0]) == 3 and worker.version(layout.units[0]) == ABSENT
    assert worker.ring(1).numel() == ring_numel(discover(tiny_config("llama")), torch.bfloat16)
    with pytest.raises(IndexError, match="local worker 0 has no ring"):
        worker.ring(0)  # the first worker lands in the slots and the pool


def test_a_node_holds_slots_for_its_own_units_and_sums_the_others_in_a_bounded_pool():
    spec = discover(tiny_config("llama", num_hidden_layers=8))
    plan = ShardPlan.build(spec, 2)
    layout = ArenaLayout.build(spec, plan, 0, torch.bfloat16, torch.bfloat16, 2)
    owned = {u.name for u in plan.units_of(0)}
    remote = [u for u in spec.trainable_units if u.name not in owned]
    assert set(layout.grad_offsets) == {u.name for u in spec.trainable_units if u.name in owned}
    layer = max(u.numel for u in remote if u.name.startswith("layers."))
    assert layout.pool_numel == pool_numel(spec, plan, 0) == max(POOL_UNITS * layer, max(u.numel for u in remote))
    assert layout.pool_numel < sum(u.numel for u in remote)  # not a slot per unit
    assert pool_numel(spec, ShardPlan.build(spec, 1), 0) == 0  # one node owns every unit
    # The first worker lands owned units in their slots, the others whole in the pool, first in, first out; a full
    # pool holds its ship thread until the shard has sent the oldest on (its acknowledgement frees the place).
    arena = NodeArena.create(layout)
    first = LandingBuffers(arena, 0, {u.name: u.numel for u in spec.trainable_units}, timeout_s=0.2)
    mine = next(iter(layout.grad_offsets))
    assert first.acquire(mine, 0, layout.numels[mine])[1] == SLOT
    layers = [u for u in remote if u.name.startswith("layers.")][:POOL_UNITS + 1]
    places = [first.acquire(u.name, 0, u.numel)[1] for u in layers[:POOL_UNITS]]
    assert places == [i * layers[0].numel for i in range(POOL_UNITS)] and first.pieces(layers[0].name) == [(0, layer)]
    with pytest.raises(ClusterError, match=f"no room in the node's gradient pool for {layers[-1].name}'s piece at 0"):
        first.acquire(layers[-1].name, 0, layers[-1].numel)
    first.release(layers[0].name, 0)
    view, at = first.acquire(layers[-1].name, 0, layers[-1].numel)
    assert at == 0 and view.data_ptr() == arena.pool().data_ptr()


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
    arena = arena_of(workers=2)
    size = arena.layout.ring_numel
    numels = {"a": size // 2, "b": size // 2, "c": size // 3, "d": size // 2}
    ring = LandingBuffers(arena, 1, numels, timeout_s=0.2)
    (a, at_a), (b, at_b) = ring.acquire("a", 0, size // 2), ring.acquire("b", 0, size // 2)
    assert (at_a, at_b) == (0, size // 2) and a.data_ptr() != b.data_ptr()
    with pytest.raises(ClusterError, match="no room in this worker's gradient ring for c's piece at 0"):
        ring.acquire("c", 0, size // 3)  # full until the shard has summed the oldest
    ring.release("a", 0)
    assert ring.acquire("c", 0, size // 3)[1] == 0  # wrapped to the freed start
    ring.release("b", 0)
    ring.release("c", 0)
    assert ring.acquire("d", 0, size // 2)[1] == 0  # back at the start of an empty ring
    # A lone worker on the node lands in the unit's slot itself, whole.
    unit = next(iter(arena.layout.grad_offsets))
    n = arena.layout.numels[unit]
    slots = LandingBuffers(arena, 0, {unit: n}, timeout_s=1)
    assert slots.pieces(unit) == [(0, n)]
    view, where = slots.acquire(unit, 0, n)
    assert view.data_ptr() == arena.grad(unit).data_ptr() and where == SLOT


def test_a_gradient_larger_than_a_ring_piece_lands_in_pieces_that_cover_it():
    spec = discover(tiny_config("llama"))
    largest = max(u.numel for u in spec.trainable_units)
    ring = ring_numel(spec, torch.float32, cap_mb=(largest // 2) * 4 / 2**20)  # half the largest unit
    assert ring == largest // 2
    layout = ArenaLayout.build(spec, ShardPlan.build(spec, 1), 0, torch.float32, torch.float32, 2, ring)
    pieces = layout.pieces(largest)
    assert len(pieces) >= 8 and pieces[0][0] == 0 and pieces[-1][1] == largest
    assert all(hi - lo <= ring // RING_PIECES and hi == nxt
               for (lo, hi), (nxt, _) in zip(pieces, pieces[1:] + [(largest, 0)], strict=True))
    landing = LandingBuffers(NodeArena.create(layout), 1, {"big": largest}, timeout_s=0.2)
    assert landing.pieces("big") == pieces
    # Pieces land while the shard sums the ones before: a ring's worth fit at once, the next waits for the first.
    for lo, hi in pieces[:RING_PIECES]:
        landing.acquire("big", lo, hi)
    with pytest.raises(ClusterError, match="no room in this worker's gradient ring"):
        landing.acquire("big", *pieces[RING_PIECES])
    landing.release("big", pieces[0][0])
    landing.acquire("big", *pieces[RING_PIECES])


def test_the_ring_holds_two_of_the_largest_layers():
    spec = discover(tiny_config("llama"))
    layer = max(u.numel for u in spec.trainable_units if u.name.startswith("layers."))
    assert ring_numel(spec, torch.bfloat16) == 2 * layer


def test_acknowledgements_are_per_worker_and_a_new_generation_starts_them_afresh():
    arena = arena_of(workers=2)
    arena.begin(generation=1)
    arena.ack(1, 5)
    assert arena.acked(1, 5) and not arena.acked(0, 5) and not arena.acked(1, 4)
    arena.ack(1, 5 + ACK_WORDS)  # the word is reused once the report a ring ago is long acknowledged
    assert arena.acked(1, 5 + ACK_WORDS) and not arena.acked(1, 5)
    arena.begin(generation=2)
    assert not arena.acked(1, 5 + ACK_WORDS)
