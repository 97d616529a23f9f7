"""A resume through CheckpointManager, loading into the new engine's own buffers, continues exactly."""

import torch

from mt_ray.engine import EngineConfig, OptimizerConfig, StreamingEngine
from mt_ray.models.discovery import discover
from mt_ray.tracking.checkpoint import CheckpointConfig, CheckpointManager
from tests.tiny_models import tiny_batches, tiny_config

OPT = OptimizerConfig(lr=1e-3, weight_decay=0.1, warmup_steps=2, max_grad_norm=1.0)


def new_engine(cfg):
    return StreamingEngine(discover(cfg), EngineConfig(device="cpu", compute_dtype="fp32"), OPT, total_steps=6)


def test_resume_from_saved_checkpoint_matches_uninterrupted_run(tmp_path):
    cfg = tiny_config("llama")
    steps = [tiny_batches(seed=s) for s in range(6)]
    ckpt = CheckpointManager(CheckpointConfig(uri=str(tmp_path), shard_bytes=8192))

    a = new_engine(cfg)
    a.load_random(seed=1)
    losses = []
    for i, mbs in enumerate(steps):
        losses.append(a.train_step(mbs).loss.item())
        if i == 2:
            tensors, meta = a.checkpoint_state()
            ckpt.save(meta["step"], tensors, {**meta, "trainer": {"losses": losses[:]}})
    final = {k: v.clone() for k, v in a.state_dict().items()}
    a.close()

    b = new_engine(cfg)
    live, _ = b.checkpoint_state()
    tensors, meta = ckpt.load(out=live)
    assert all(tensors[k] is live[k] for k in live)  # restored in place: no second copy of the state
    b.load_checkpoint_state(tensors, meta)
    assert meta["trainer"]["losses"] == losses[:3]
    resumed = [b.train_step(mbs).loss.item() for mbs in steps[3:]]
    assert resumed == losses[3:]
    for k, v in b.state_dict().items():
        assert torch.equal(v, final[k]), k
    b.close()
