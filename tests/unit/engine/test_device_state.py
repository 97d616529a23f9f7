"""Optimizer state kept on the device (`engine.device_optimizer_units`): the first units' master and moments live
there and are updated there, the rest on the host. On the CPU the "device" copy is a second host copy updated by
the same kernel, so losses, weights and moments are bit-identical to every update on the host, and a checkpoint
taken with units kept resumes bit-identically."""

import pytest
import torch

from mt_ray.engine import EngineConfig, OptimizerConfig, StreamingEngine
from mt_ray.engine.device_plan import eligible_units, plan_device_units
from mt_ray.engine.sizing import SFT
from mt_ray.errors import ConfigError, InsufficientMemoryError
from mt_ray.models.discovery import discover
from tests.family_sweep import save_tiny
from tests.tiny_models import reference_model, tiny_batches, tiny_config

CLIP = OptimizerConfig(lr=2e-3, weight_decay=0.1, max_grad_norm=1.0, warmup_steps=1, schedule="cosine")
NO_CLIP = CLIP.model_copy(update={"max_grad_norm": 0.0})


def _engine(cfg, opt, units, total_steps):
    ecfg = EngineConfig(device="cpu", compute_dtype="fp32", checkpoint_every=2, device_optimizer_units=units)
    return StreamingEngine(discover(cfg), ecfg, opt, total_steps=total_steps)


def _train(cfg, weights, batches, opt, units):
    """Losses, master weights and checkpoint tensors (master and moments) after a step per entry of `batches`,
    and which units the engine kept on the device."""
    engine = _engine(cfg, opt, units, len(batches))
    try:
        engine.load_state_dict(weights)
        losses = [engine.train_step(mbs).loss.item() for mbs in batches]
        kept = list(engine.store.on_device.units) if engine.store.on_device else []
        tensors, _ = engine.checkpoint_state()
        return losses, {k: v.clone() for k, v in engine.state_dict().items()}, \
            {k: v.clone() for k, v in tensors.items()}, kept
    finally:
        engine.close()


@pytest.mark.parametrize(("family", "opt", "units"), [
    ("qwen3_moe", CLIP, 3),  # the embedding and two layers; with clipping updates wait for the norm
    ("llama", NO_CLIP, 2),  # updates as gradients land, the host's from its recycled slabs
    ("qwen2-tied", CLIP, 1),  # the embedding kept, its gradient summed with the tied head's
])
def test_units_kept_on_the_device_train_bit_identically_to_the_host(family, opt, units):
    cfg = tiny_config(family)
    weights = reference_model(cfg).state_dict()
    batches = [tiny_batches(seed=0)] * 3  # the same rows: the loss must fall
    host = _train(cfg, weights, batches, opt, 0)
    device = _train(cfg, weights, batches, opt, units)
    spec = discover(cfg)
    assert device[3] == [u.name for u in spec.units][:units] and host[3] == []
    assert device[0] == host[0]
    assert host[0][-1] < host[0][0]
    for name, w in host[1].items():
        assert torch.equal(device[1][name], w), name
    for name, t in host[2].items():  # the moments too: brought home for the checkpoint
        assert torch.equal(device[2][name], t), name


def test_a_checkpoint_with_units_on_the_device_resumes_bit_identically():
    cfg = tiny_config("llama")
    steps = [tiny_batches(seed=s) for s in range(4)]
    a = _engine(cfg, CLIP, 2, 4)
    a.load_random(seed=1)
    losses_a = [a.train_step(mbs).loss.item() for mbs in steps]
    final_a = {k: v.clone() for k, v in a.state_dict().items()}
    a.close()

    b = _engine(cfg, CLIP, 2, 4)
    b.load_random(seed=1)
    for mbs in steps[:2]:
        b.train_step(mbs)
    tensors, meta = b.checkpoint_state()
    saved = {k: v.clone() for k, v in tensors.items()}
    b.close()

    c = _engine(cfg, CLIP, 2, 4)
    c.train_step(steps[0])  # units already kept when the checkpoint is read: it must reach them too
    c.load_checkpoint_state(saved, meta)
    losses_c = [c.train_step(mbs).loss.item() for mbs in steps[2:]]
    assert losses_c == losses_a[2:]
    for k, v in c.state_dict().items():
        assert torch.equal(v, final_a[k]), k
    c.close()


def test_units_that_cannot_be_kept_are_refused_by_name():
    spec = discover(tiny_config("llama"))
    order = [u.name for u in spec.units]
    eligible = eligible_units(spec, order, set(order))
    cpu = EngineConfig(device="cpu", compute_dtype="fp32")

    def plan(units, opt=CLIP, local=True, **kw):
        return plan_device_units(spec, cpu.model_copy(update={"device_optimizer_units": units, **kw}), opt, local,
                                 eligible, None, SFT, 2, 12, 2, 0)

    assert plan("auto") == [] and plan(0) == []  # auto keeps none on the CPU
    assert plan(2) == order[:2]
    with pytest.raises(ConfigError, match=f"only {len(eligible)} units"):
        plan(len(eligible) + 1)
    with pytest.raises(ConfigError, match="optimizer.impl: torch runs on the host only"):
        plan(1, opt=CLIP.model_copy(update={"impl": "torch"}))
    with pytest.raises(ConfigError, match="data-parallel worker"):
        plan(1, local=False)
    assert plan("auto", opt=CLIP.model_copy(update={"impl": "torch"})) == []


def test_units_tied_between_layers_stay_on_the_host(tmp_path):
    save_tiny("zamba2", tmp_path)  # layers.3 mirrors a block of layers.1
    spec = discover(str(tmp_path))
    order = [u.name for u in spec.units]
    assert eligible_units(spec, order, set(order)) == ["embed", "layers.0", "layers.2", "head"]


def test_auto_fills_the_gpu_left_beside_the_step_and_a_number_past_it_is_refused():
    spec = discover(tiny_config("llama", hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                                num_key_value_heads=4, num_hidden_layers=28, vocab_size=152064))
    order = [u.name for u in spec.units]
    cfg = EngineConfig(device="cpu", compute_dtype="bf16", grad_dtype="compute", keep_activations=0)

    def plan(units, gpu_gb):
        return plan_device_units(spec, cfg.model_copy(update={"device_optimizer_units": units}), CLIP, True, order,
                                 gpu_gb, SFT, 16, 1024, 8, 0)

    small, large = plan("auto", 80), plan("auto", 120)
    assert 0 < len(small) < len(large) < len(order)
    assert large[: len(small)] == small == order[: len(small)]  # a prefix in forward order
    assert plan(len(large), 120) == large
    with pytest.raises(InsufficientMemoryError, match=f"the largest that fits is {len(large)}"):
        plan(len(large) + 1, 120)
