"""The cluster's CUDA paths on two GPUs, each run against one engine on the same rows: gradients landed by each
worker's copy stream in its node's page-locked arena and summed by the shard (`grad_reduce: host`), a node's GPUs
summing with NCCL (`grad_reduce: nccl`), and two sharded nodes of one GPU each exchanging updated units.

Runs only where two GPUs are present (the lent nvidia-h200-x2 machine); elsewhere it is skipped. Losses, norms and
weights match one engine's to fp32 rounding (the workers' row split changes the order of the batch's sums, as on
the CPU tests).
"""

import contextlib

import pytest
import torch

pytest.importorskip("ray")

from mt_ray.cluster import ClusterConfig, DataParallelTrainer  # noqa: E402
from mt_ray.engine import EngineConfig, OptimizerConfig, StreamingEngine  # noqa: E402
from mt_ray.models.discovery import discover  # noqa: E402
from tests.conftest import PRELOAD, repo_on_worker_path  # noqa: E402
from tests.tiny_models import reference_model, tiny_batches, tiny_config  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")

STEPS = 3
OPT = OptimizerConfig(lr=2e-3, weight_decay=0.1, max_grad_norm=1.0, warmup_steps=1, schedule="cosine")
SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
STORE = 256 << 20


def model_cfg():
    cfg = tiny_config("llama", **SHAPE)
    cfg._attn_implementation = "eager"  # a deterministic backward: the runs differ only by the rows' split
    return cfg


def engine_cfg() -> EngineConfig:
    return EngineConfig(device="cuda", compute_dtype="fp32", checkpoint_every=2)


def batches() -> list[list[dict[str, torch.Tensor]]]:
    """Each step: 2 micro-batches of 2 rows, so each of the 2 workers takes one whole micro-batch."""
    return [tiny_batches(n_micro=2, batch=2, seq=64, seed=s) for s in range(STEPS)]


def one_engine(state: dict[str, torch.Tensor]):
    engine = StreamingEngine(discover(model_cfg()), engine_cfg(), OPT, total_steps=STEPS)
    try:
        engine.load_state_dict(state)
        results = [engine.train_step(b) for b in batches()]
        return [r.loss.item() for r in results], [r.grad_norm.item() for r in results], engine.state_dict()
    finally:
        engine.close()


@contextlib.contextmanager
def ray_on(nodes: int):
    """A Ray of this test's own: one node with both GPUs, or two nodes of this host with one GPU each."""
    import ray

    with repo_on_worker_path():
        if nodes == 1:
            ray.init(address="local", num_cpus=4, num_gpus=2, object_store_memory=STORE, include_dashboard=False,
                     log_to_driver=False, _system_config=PRELOAD)
            try:
                yield ray
            finally:
                ray.shutdown()
            return
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 2, "num_gpus": 1, "object_store_memory": STORE, "include_dashboard": False,
            "_system_config": PRELOAD, "env_vars": {"CUDA_VISIBLE_DEVICES": "0"}})
        cluster.add_node(num_cpus=2, num_gpus=1, object_store_memory=STORE, env_vars={"CUDA_VISIBLE_DEVICES": "1"})
        ray.init(address=cluster.address, log_to_driver=False)
        try:
            yield ray
        finally:
            ray.shutdown()
            cluster.shutdown()


@pytest.mark.parametrize("nodes, reduce", [(1, "host"), (1, "nccl"), (2, "host")], ids=["host", "nccl", "sharded"])
def test_two_gpus_train_as_one_engine_on_the_same_rows(nodes, reduce):
    state = {k: v.detach().clone() for k, v in reference_model(model_cfg()).state_dict().items()}
    ref_losses, ref_norms, ref_state = one_engine(state)
    cluster = ClusterConfig(gpus_per_worker=1, cpus_per_worker=1, num_nodes=nodes, grad_reduce=reduce,
                            step_timeout_s=300)
    with ray_on(nodes) as ray:
        trainer = DataParallelTrainer(model_cfg(), engine_cfg(), OPT, num_workers=2, total_steps=STEPS,
                                      cluster=cluster, weights=state)
        try:
            devices = ray.get([w.device.remote() for w in trainer.workers])
            nodes_of_shards = ray.get([s.ping.remote() for s in trainer.shards])
            result = trainer.train(batches())
            got = trainer.state_dict()
        finally:
            trainer.close()
    assert all(d.startswith("cuda") for d in devices)
    assert len(set(nodes_of_shards)) == nodes  # sharded: one shard per node, each owning a part
    assert result.events == []
    assert result.losses == pytest.approx(ref_losses, rel=1e-5)
    assert result.grad_norms == pytest.approx(ref_norms, rel=1e-5)
    assert got.keys() == ref_state.keys()
    for name, w in ref_state.items():
        torch.testing.assert_close(got[name], w.cpu(), atol=1e-6, rtol=1e-5, msg=name)
