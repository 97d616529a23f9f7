"""State sharded over three Ray nodes: it trains like one engine, holds a model no one node's limit
allows, and a lost shard restarts from its checkpoint with bit-identical results."""

import pytest
import torch

pytest.importorskip("ray")

from mt_ray.cluster import ClusterConfig, DataParallelTrainer  # noqa: E402
from mt_ray.cluster.sizing import size_cluster  # noqa: E402
from mt_ray.engine import EngineConfig, OptimizerConfig, StreamingEngine  # noqa: E402
from mt_ray.errors import InsufficientMemoryError  # noqa: E402
from mt_ray.models.discovery import discover  # noqa: E402
from tests.tiny_models import tiny_batches, tiny_config  # noqa: E402

STEPS = 3
OPT = OptimizerConfig(lr=2e-3, weight_decay=0.1, max_grad_norm=1.0, warmup_steps=1, schedule="cosine")
BATCHES = [tiny_batches(n_micro=1, batch=3, seed=s) for s in range(STEPS)]  # one row per worker


def engine_cfg(limit_gb: float | None = None) -> EngineConfig:
    return EngineConfig(device="cpu", compute_dtype="fp32", checkpoint_every=2, host_memory_limit_gb=limit_gb)


def between_one_and_three_nodes() -> float:
    """A host limit above what each of three nodes needs, below what one node holding everything needs."""
    spec = discover(tiny_config("llama"))
    one, three = (size_cluster(spec, engine_cfg(), OPT, 3, n).node_host_bytes for n in (1, 3))
    assert three < one
    return (one + three) / 2 / 2**30


def test_state_too_large_for_one_node_trains_sharded_like_one_engine(three_node_ray):
    limit = between_one_and_three_nodes()
    with pytest.raises(InsufficientMemoryError, match=r"engine.host_memory_limit_gb.*cluster.num_nodes"):
        DataParallelTrainer(tiny_config("llama"), engine_cfg(limit), OPT, num_workers=3, total_steps=STEPS,
                            cluster=ClusterConfig(num_nodes=1, cpus_per_worker=1))

    engine = StreamingEngine(discover(tiny_config("llama")), engine_cfg(), OPT, total_steps=STEPS)
    try:
        engine.load_random(seed=0)
        ref = [engine.train_step(b) for b in BATCHES]
        ref_state = engine.state_dict()
    finally:
        engine.close()
    cluster = ClusterConfig(num_nodes=3, cpus_per_worker=1, placement_timeout_s=60)
    trainer = DataParallelTrainer(tiny_config("llama"), engine_cfg(limit), OPT, num_workers=3, total_steps=STEPS,
                                  cluster=cluster, weights=0)
    try:
        result = trainer.train(BATCHES)
        state = trainer.state_dict()
        nodes = three_node_ray.get([s.ping.remote() for s in trainer.shards])
        parts = [len(p) for p in trainer.plan.parts]
    finally:
        trainer.close()
    assert len(set(nodes)) == 3 and all(parts)  # one shard per node, each owning a part
    assert result.losses == pytest.approx([r.loss.item() for r in ref], rel=1e-5)
    assert result.grad_norms == pytest.approx([r.grad_norm.item() for r in ref], rel=1e-5)
    for name, w in ref_state.items():
        torch.testing.assert_close(state[name], w, atol=1e-6, rtol=1e-5, msg=name)


def test_a_killed_shard_restarts_from_the_sharded_checkpoint_bit_identically(three_node_ray, tmp_path, monkeypatch):
    import mt_ray.training.launch as launch
    from mt_ray.training.callbacks import Callback
    from tests.integration.cluster.test_train_data_parallel import assert_close_weights, train

    fired = []

    class KillShard(Callback):
        def on_step_end(self, trainer, step):
            if step == 3 and not fired:
                fired.append(step)
                three_node_ray.kill(trainer.engine.shards[1], no_restart=True)

    sharded = ("cluster.num_nodes=3", "cluster.cpus_per_worker=1")
    build = launch.build_callbacks
    monkeypatch.setattr(launch, "build_callbacks", lambda cfg, run: [*build(cfg, run), KillShard()])
    _, history, weights, _ = train(tmp_path, "lost", 3, *sharded)
    monkeypatch.setattr(launch, "build_callbacks", build)
    _, clean_history, clean_weights, _ = train(tmp_path, "clean", 3, *sharded)
    assert fired == [3]
    assert [h["loss"] for h in history] == [h["loss"] for h in clean_history]
    assert_close_weights(weights, clean_weights, atol=0)
