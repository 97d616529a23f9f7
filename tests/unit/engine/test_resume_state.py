"""checkpoint_state/load_checkpoint_state continue training bit for bit."""

import torch

from mt_ray.engine import EngineConfig, OptimizerConfig, StreamingEngine
from mt_ray.models.discovery import discover
from tests.tiny_models import tiny_batches, tiny_config

OPT = OptimizerConfig(lr=1e-3, weight_decay=0.1, warmup_steps=2, max_grad_norm=1.0)


def new_engine(cfg):
    return StreamingEngine(discover(cfg), EngineConfig(device="cpu", compute_dtype="fp32"), OPT, total_steps=6)


def test_restored_engine_continues_identically():
    cfg = tiny_config("llama")
    steps = [tiny_batches(seed=s) for s in range(6)]
    a = new_engine(cfg)
    a.load_random(seed=1)
    losses_a = [a.train_step(mbs).loss.item() for mbs in steps]
    final_a = {k: v.clone() for k, v in a.state_dict().items()}
    a.close()

    b = new_engine(cfg)
    b.load_random(seed=1)
    for mbs in steps[:3]:
        b.train_step(mbs)
    tensors, meta = b.checkpoint_state()
    saved = {k: v.clone() for k, v in tensors.items()}
    b.close()

    c = new_engine(cfg)
    c.load_checkpoint_state(saved, meta)
    losses_c = [c.train_step(mbs).loss.item() for mbs in steps[3:]]
    final_c = c.state_dict()
    assert losses_c == losses_a[3:]
    for k, v in final_a.items():
        assert torch.equal(v, final_c[k]), k
    c.close()
