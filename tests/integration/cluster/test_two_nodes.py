"""Two Ray nodes x two workers, the state sharded over a coordinator shard per node, train exactly like one engine."""

import pytest
import torch

pytest.importorskip("ray")

from mt_ray.cluster import ClusterConfig, DataParallelTrainer  # noqa: E402
from mt_ray.engine import EngineConfig, OptimizerConfig, StreamingEngine  # noqa: E402
from mt_ray.models.discovery import discover  # noqa: E402
from tests.tiny_models import tiny_batches, tiny_config  # noqa: E402

STEPS = 3
OPT = OptimizerConfig(lr=2e-3, weight_decay=0.1, max_grad_norm=1.0, warmup_steps=1, schedule="cosine")
ENGINE = EngineConfig(device="cpu", compute_dtype="fp32", checkpoint_every=2)
# 2 micro-batches of 4 rows: each of the 4 workers gets one row of each.
# 8 layers: each node sums the 5 units the other owns in a pool of 4 layers' gradients, so its first worker's landing
# waits for a place that a sum sent on frees.
MODEL = tiny_config("llama", num_hidden_layers=8)
BATCHES = [tiny_batches(n_micro=2, batch=4, seed=s) for s in range(STEPS)]


def single_engine():
    engine = StreamingEngine(discover(MODEL), ENGINE, OPT, total_steps=STEPS)
    try:
        engine.load_random(seed=0)
        results = [engine.train_step(b) for b in BATCHES]
        return [r.loss.item() for r in results], [r.grad_norm.item() for r in results], engine.state_dict()
    finally:
        engine.close()


def test_two_nodes_of_two_workers_match_one_engine(two_node_ray):
    ref_losses, ref_norms, ref_state = single_engine()
    cluster = ClusterConfig(num_nodes=2, cpus_per_worker=1, snapshot_every=0, placement_timeout_s=60)
    trainer = DataParallelTrainer(MODEL, ENGINE, OPT, num_workers=4, total_steps=STEPS,
                                  cluster=cluster, weights=0)
    try:
        result = trainer.train(BATCHES)
        state = trainer.state_dict()
        worker_nodes = two_node_ray.get([w.node_id.remote() for w in trainer.workers])
        shard_nodes = two_node_ray.get([s.ping.remote() for s in trainer.shards])
    finally:
        trainer.close()
    # Workers 0, 1 and shard 0 share a node; workers 2, 3 and shard 1 share the other.
    assert worker_nodes == [shard_nodes[0]] * 2 + [shard_nodes[1]] * 2 and len(set(shard_nodes)) == 2
    assert result.losses == pytest.approx(ref_losses, rel=1e-5)
    assert result.grad_norms == pytest.approx(ref_norms, rel=1e-5)
    for name, w in ref_state.items():
        torch.testing.assert_close(state[name], w, atol=1e-6, rtol=1e-5, msg=name)
