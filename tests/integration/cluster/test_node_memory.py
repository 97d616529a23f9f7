"""A node's memory is flat in its worker count: the shared arena is held once, and each worker adds only
its gradient ring and its own process, the per-worker figure `mt-ray calc` names."""

import pytest

pytest.importorskip("ray")

from mt_ray.cluster import ClusterConfig, DataParallelTrainer  # noqa: E402
from mt_ray.engine import EngineConfig, OptimizerConfig  # noqa: E402
from tests.tiny_models import tiny_batches, tiny_config  # noqa: E402

ENGINE = EngineConfig(device="cpu", compute_dtype="fp32", checkpoint_every=2)
OPT = OptimizerConfig(lr=1e-3, max_grad_norm=1.0)
# About 70 M parameters: the fp32 state (0.8 GiB) outweighs a worker process, so a model-sized copy per
# worker would show.
MODEL = tiny_config("llama", hidden_size=512, intermediate_size=1024, num_hidden_layers=4, vocab_size=64000,
                    num_attention_heads=4, num_key_value_heads=2)


def node_bytes(workers: int) -> tuple[int, int]:
    """The run's host memory after two steps (every process's proportional share: the arena once), and the
    calculator's per-worker figure."""
    import ray

    trainer = DataParallelTrainer(MODEL, ENGINE, OPT, num_workers=workers, total_steps=2, weights=0,
                                  cluster=ClusterConfig(cpus_per_worker=0.25))
    try:
        for s in range(2):
            trainer.train_step(tiny_batches(n_micro=4, batch=1, seed=s, seq=16))
        trainer.synchronize()
        parts = ray.get([a.host_bytes.remote() for a in [*trainer.shards, *trainer.workers]])
        return sum(p["pss"] for p in parts), trainer.sizing.per_worker_bytes
    finally:
        trainer.close()


def test_node_memory_is_flat_in_the_worker_count(local_ray):
    one, _ = node_bytes(1)
    for workers in (2, 4):
        total, per_worker = node_bytes(workers)
        assert total <= 1.1 * one + (workers - 1) * per_worker, (workers, total / 2**30, one / 2**30)
