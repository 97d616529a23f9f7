"""The cluster's per-node plan: sharding cuts the state, the worker count adds only unit-sized buffers."""

import pytest

from mt_ray.cluster.arena import ArenaLayout
from mt_ray.cluster.partition import ShardPlan, state_cost
from mt_ray.cluster.sizing import ACK_BYTES, WORKER_PROCESS_BYTES, size_cluster
from mt_ray.engine import EngineConfig, OptimizerConfig
from mt_ray.models.discovery import discover
from mt_ray.models.presets import preset_config

CFG = EngineConfig(device="cpu", compute_dtype="bf16", grad_dtype="compute")


@pytest.fixture(scope="module")
def spec_7b():
    return discover(preset_config("qwen2.5-7b"))


def test_parts_are_contiguous_balanced_and_cover_every_unit_once(spec_7b):
    for n in (1, 2, 3, 8):
        plan = ShardPlan.build(spec_7b, n)
        assert [u.name for part in plan.parts for u in part] == [u.name for u in spec_7b.units]
        sizes = [hi - lo for lo, hi in plan.ranges()]
        assert plan.ranges()[-1][1] == spec_7b.num_params and min(sizes) > 0
        assert max(sizes) <= spec_7b.num_params / n + max(u.numel for u in spec_7b.units)


def test_the_7b_job_on_two_workers_fits_a_128_gib_host_at_16_bytes_per_param(spec_7b):
    sizing = size_cluster(spec_7b, CFG, OptimizerConfig(max_grad_norm=1.0), num_workers=2, num_nodes=1)
    assert sizing.node_host_bytes < 128 * 2**30
    assert sizing.node_host_bytes_per_param <= 16
    assert sizing.network_out_bytes_per_step == 0  # one node: nothing crosses a network


def test_sharding_divides_the_state_and_sends_each_nodes_gradients_once(spec_7b):
    one = size_cluster(spec_7b, CFG, OptimizerConfig(), 2, 1)
    two = size_cluster(spec_7b, CFG, OptimizerConfig(), 2, 2)
    assert two.state_bytes == pytest.approx(one.state_bytes / 2, rel=0.01)
    remote = spec_7b.num_params - two.shard_params
    assert two.network_out_bytes_per_step == remote * 2 + two.shard_params * 2  # bf16 gradients out, weights out


def test_more_workers_add_only_unit_sized_buffers(spec_7b):
    two = size_cluster(spec_7b, CFG, OptimizerConfig(), 2, 1)
    eight = size_cluster(spec_7b, CFG, OptimizerConfig(), 8, 1)
    largest_unit = max(u.numel for u in spec_7b.units)
    per_worker = (eight.node_host_bytes - two.node_host_bytes) / 6
    assert per_worker <= 6 * largest_unit * 2  # slabs and gradients in flight, never a model's worth
    assert eight.state_bytes == two.state_bytes


def test_a_node_grows_by_the_named_per_worker_figure_alone(spec_7b):
    """The arena (fp32 master, gradient slots) is held once per node; each further worker adds its gradient ring
    and its process, `per_worker_bytes`, and nothing model-sized: a ring of two layers' gradients, which larger
    gradients land in in pieces. Up to 4 workers a node stays within 16 B/param at 7B; 8 add 2 B/param over one
    (their rings and processes, about 2 GiB each), on one node 16.4 B/param; on two nodes 11.2."""
    for nodes in (1, 2):  # on two nodes as on one: the pool, like the slots, is the node's, not a worker's
        per_node = {n: size_cluster(spec_7b, CFG, OptimizerConfig(max_grad_norm=1.0), n * nodes, nodes)
                    for n in (1, 2, 4, 8)}
        for a, b in ((1, 2), (2, 4), (4, 8)):
            assert per_node[b].node_host_bytes - per_node[a].node_host_bytes == (b - a) * per_node[a].per_worker_bytes
    assert per_node[8].node_host_bytes_per_param < 12
    sizes = {n: size_cluster(spec_7b, CFG, OptimizerConfig(max_grad_norm=1.0), n, 1) for n in (1, 2, 4, 8)}
    layer = max(u.numel for u in spec_7b.units if u.name.startswith("layers."))
    assert 2 * layer * 2 <= sizes[1].ring_bytes < 2 * layer * 2 + 4096 < max(u.numel for u in spec_7b.units) * 2
    assert sizes[1].per_worker_bytes == sizes[1].ring_bytes + ACK_BYTES + WORKER_PROCESS_BYTES
    assert all(sizes[n].node_host_bytes_per_param <= 16 for n in (1, 2, 4)), \
        {n: sizes[n].node_host_bytes_per_param for n in sizes}
    assert sizes[8].node_host_bytes_per_param - sizes[1].node_host_bytes_per_param < 2.1


def test_the_calculator_counts_every_byte_of_the_arena_and_a_node_holds_slots_for_its_own_units_alone(spec_7b):
    """The node's arena, as the shard lays it out, is the calculator's master, arena, rings and acknowledgement
    words to the byte. On two nodes a node keeps gradient slots for its own half alone and sums the other half in a
    pool of a few units; neither depends on the worker count."""
    for nodes in (1, 2):
        plan = ShardPlan.build(spec_7b, nodes)
        loads = [sum(state_cost(u) for u in part) for part in plan.parts]
        node = loads.index(max(loads))  # the calculator's node
        for per_node in (1, 2, 8):
            s = size_cluster(spec_7b, CFG, OptimizerConfig(), per_node * nodes, nodes)
            layout = ArenaLayout.build(spec_7b, plan, node, CFG.dtype, CFG.grad_torch_dtype, per_node)
            assert 4 * s.shard_params + s.arena_bytes + s.rings * s.ring_bytes + s.landers * ACK_BYTES == layout.nbytes
            owned = sum(u.numel for u in plan.units_of(node) if not u.frozen)
            assert owned * 2 <= s.slot_bytes < owned * 2 + 4096 * len(plan.units_of(node))
    one, two = size_cluster(spec_7b, CFG, OptimizerConfig(), 2, 1), size_cluster(spec_7b, CFG, OptimizerConfig(), 4, 2)
    assert one.pool_bytes == 0 and 0 < two.pool_bytes < 0.3 * (spec_7b.num_params - two.shard_params) * 2
    # Was a bf16 slot for every trained unit on each node (2 B/param): now its own half's and a pool of a few units.
    assert two.slot_bytes + two.pool_bytes < 0.7 * spec_7b.num_params * 2


def test_grpo_adds_its_rollout_replicas_processes_and_nothing_model_sized(spec_7b):
    """Each worker's rollout replica has its copy on the worker's GPU and refreshes from the arena it maps: the node
    holds their processes alone."""
    plain = size_cluster(spec_7b, CFG, OptimizerConfig(), 2, 1)
    grpo = size_cluster(spec_7b, CFG, OptimizerConfig(), 2, 1, rollout=True)
    assert grpo.node_host_bytes - plain.node_host_bytes == grpo.rollout_process_bytes == 2 * WORKER_PROCESS_BYTES
