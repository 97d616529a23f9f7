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


def test_a_vision_unit_resumes_with_the_adam_count_of_the_steps_it_trained(tmp_path):
    """The projector skips a step without images (torch skips a None gradient), so its Adam count stays one
    behind the step: the checkpoint keeps that count, and a step with images after the resume is bit-exact."""
    from mt_ray.data.packing import collate
    from tests.family_checks import OPT as EPS_ONE  # eps = 1: the update follows the count's bias correction
    from tests.vlm_models import QWEN_IMAGE, make_image, qwen_example, save_qwen_vl

    folder = save_qwen_vl(tmp_path)
    text = qwen_example(folder, "some text only here and more", [])
    image = qwen_example(folder, f"{QWEN_IMAGE}what is this? a cat", [make_image(0)])
    steps = [[collate([[text]], None, 0)], [collate([[image], [text]], None, 0)]]

    def engine():
        e = StreamingEngine(discover(str(folder)), EngineConfig(device="cpu", compute_dtype="fp32"), EPS_ONE, 2)
        e.load_pretrained(folder)
        return e

    a, b = engine(), engine()
    for mbs in steps:
        a.train_step(mbs)
    b.train_step(steps[0])
    tensors, meta = b.checkpoint_state()
    assert meta["adam_counts"] == {"vision.projector": 0}
    c = engine()
    c.load_checkpoint_state({k: v.clone() for k, v in tensors.items()}, meta)
    c.train_step(steps[1])
    final_a, final_c = a.state_dict(), c.state_dict()
    assert all(torch.equal(final_a[k], final_c[k]) for k in final_a)
    for e in (a, b, c):
        e.close()
