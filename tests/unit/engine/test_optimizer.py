"""LR schedules match transformers'; the optimizer uses the store's moments in place."""

import pytest
import torch
from transformers import get_scheduler

from mt_ray.engine.config import OptimizerConfig
from mt_ray.engine.host_adamw import CONTRACTED_IN_EIGHTS
from mt_ray.engine.host_store import HostStore
from mt_ray.engine.optimizer import UnitOptimizer, counts_behind, deepspeed_available, lr_at, restore_counts
from mt_ray.errors import ConfigError
from mt_ray.models.discovery import discover
from tests.tiny_models import tiny_config


@pytest.mark.parametrize("schedule", ["constant", "cosine", "linear"])
def test_schedule_matches_transformers(schedule):
    cfg = OptimizerConfig(lr=3e-4, warmup_steps=5, schedule=schedule)
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=cfg.lr)
    name = {"constant": "constant_with_warmup", "cosine": "cosine", "linear": "linear"}[schedule]
    sched = get_scheduler(name, opt, num_warmup_steps=5, num_training_steps=50)
    for step in range(50):
        assert lr_at(step, cfg, 50) == pytest.approx(opt.param_groups[0]["lr"], abs=1e-12), step
        opt.step()
        sched.step()


def test_cosine_floor():
    cfg = OptimizerConfig(lr=1.0, schedule="cosine", min_lr_ratio=0.1)
    assert lr_at(100, cfg, 100) == pytest.approx(0.1)


def test_unit_optimizer_steps_store_in_place():
    spec = discover(tiny_config("llama"))
    store = HostStore(spec, None, pin=False)
    store.master.zero_()
    unit = spec.unit("layers.0")
    opt = UnitOptimizer(store, unit, OptimizerConfig(lr=0.1, weight_decay=0.0, impl="torch"))
    opt.step(torch.ones(unit.numel), lr=0.1)
    m, v = store.moments_of("layers.0")
    assert torch.allclose(m, torch.full_like(m, 0.1))
    assert torch.allclose(store.master_of("layers.0"), torch.full((unit.numel,), -0.1), atol=1e-6)


def test_bad_betas_rejected():
    with pytest.raises(ValueError, match="betas"):
        OptimizerConfig(betas=(0.9, 1.5))


@pytest.mark.skipif(not deepspeed_available(), reason="DeepSpeed CPUAdam is not installed (needs a build toolchain)")
def test_deepspeed_cpu_adam_matches_torch():
    spec = discover(tiny_config("llama"))
    unit = spec.unit("layers.0")
    results = []
    for impl in ("torch", "deepspeed"):
        store = HostStore(spec, None, pin=False)
        torch.manual_seed(0)
        store.master.normal_()
        opt = UnitOptimizer(store, unit, OptimizerConfig(lr=1e-2, weight_decay=0.1, impl=impl))
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            opt.step(torch.randn(unit.numel, generator=g), lr=1e-2)
        results.append(store.master_of("layers.0").clone())
    torch.testing.assert_close(results[0], results[1], atol=1e-6, rtol=1e-5)


def test_chunked_steps_with_bf16_grads_and_clip_match_one_piece():
    spec = discover(tiny_config("llama"))
    unit = spec.unit("layers.0")
    g = torch.randn(unit.numel, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    results = []
    for chunk in (unit.numel, 1000):
        store = HostStore(spec, None, pin=False)
        store.master.fill_(0.5)
        opt = UnitOptimizer(store, unit, OptimizerConfig(lr=1e-2, weight_decay=0.1, impl="torch"), chunk_numel=chunk)
        for _ in range(2):
            opt.step(g, lr=1e-2, clip_coef=0.5)
        results.append((store.master_of("layers.0").clone(), store.moments_of("layers.0")[0].clone()))
    assert len(UnitOptimizer(store, unit, OptimizerConfig(impl="torch"), chunk_numel=1000).opt.param_groups) > 2
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)
    expected_m = 0.1 * 0.5 * g.float() * (1 + 0.9)
    torch.testing.assert_close(results[0][1], expected_m, rtol=1e-5, atol=1e-7)


@pytest.mark.skipif(deepspeed_available(), reason="checks the message shown where DeepSpeed is missing")
def test_deepspeed_adam_without_deepspeed_says_how_to_fix():
    spec = discover(tiny_config("llama"))
    store, unit = HostStore(spec, None, pin=False), spec.unit("layers.0")
    with pytest.raises(ConfigError, match="pip install deepspeed.*impl: numba"):
        UnitOptimizer(store, unit, OptimizerConfig(impl="deepspeed"))


@pytest.mark.parametrize("chunk", [None, 1000], ids=["one-chunk", "chunks-cutting-tensors"])
def test_tensors_without_a_gradient_step_as_torch_adamw_skips_a_none_grad(chunk):
    """Per step, some of a unit's tensors get no gradient (`skip`): as torch's AdamW with `.grad` None, their
    weights and moments stay (no decay) and their own bias-correction count falls behind, so a later update of
    theirs equals torch's. The counts survive a checkpoint's `counts_behind`/`restore_counts`."""
    spec = discover(tiny_config("llama"))
    unit = spec.unit("layers.0")
    cfg = OptimizerConfig(lr=1e-2, weight_decay=0.1, impl="torch")
    store = HostStore(spec, None, pin=False)
    store.master.normal_(generator=torch.Generator().manual_seed(0))
    opt = UnitOptimizer(store, unit, cfg, chunk_numel=chunk)
    starts = [0, *torch.tensor([p.numel for p in unit.params]).cumsum(0).tolist()]
    span = {k: (starts[k], starts[k + 1]) for k in range(len(unit.params))}
    refs = [torch.nn.Parameter(t.clone()) for t in store.master_of("layers.0").split([p.numel for p in unit.params])]
    ref = torch.optim.AdamW([{"params": [r], "weight_decay": 0.1 if p.decays else 0.0}
                             for r, p in zip(refs, unit.params, strict=True)], lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for skipped in ({0, 2}, set(), {2, 5}, {0}):
        grad = torch.randn(unit.numel, generator=g)
        for k, r in enumerate(refs):
            r.grad = None if k in skipped else grad[slice(*span[k])].clone()
        ref.step()
        opt.step(grad, lr=1e-2, skip=tuple(span[k] for k in sorted(skipped)))
        behind = counts_behind({"layers.0": opt}, 4)
        restore_counts({"layers.0": opt}, 4, behind)
    torch.testing.assert_close(store.master_of("layers.0"), torch.cat([r.detach() for r in refs]), rtol=1e-6, atol=1e-7)
    assert behind == {f"layers.0@{span[0][0]}:{span[0][1]}": 2, f"layers.0@{span[2][0]}:{span[2][1]}": 2,
                      f"layers.0@{span[5][0]}:{span[5][1]}": 1}


def test_warmup_ratio_rounds_up_as_transformers():
    cfg = OptimizerConfig(lr=1.0, warmup_ratio=0.1, schedule="constant")
    assert cfg.warmup(95) == 10 and lr_at(5, cfg, 95) == pytest.approx(0.5) and lr_at(10, cfg, 95) == 1.0
    with pytest.raises(ValueError, match="warmup_steps or warmup_ratio"):
        OptimizerConfig(warmup_steps=3, warmup_ratio=0.1)


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_numba_adamw_equals_torch_fused_adamw_over_clipped_steps(grad_dtype):
    """The default one-pass kernel against torch's fused AdamW over three clipped, decayed steps in chunks that cut
    tensors (so runs end off ATen's full eights), one span skipped in a step: bit-identical on AVX2/AVX512 hosts, and the streamed bf16 copy written in the same pass is the master's rounding."""
    spec = discover(tiny_config("llama"))
    unit = spec.unit("layers.0")
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(unit.numel, generator=gen).to(grad_dtype) for _ in range(3)]
    results = {}
    for impl in ("torch", "numba"):
        store = HostStore(spec, torch.bfloat16, pin=False)
        store.master.copy_(torch.randn(store.master.numel(), generator=torch.Generator().manual_seed(1)))
        opt = UnitOptimizer(store, unit, OptimizerConfig(lr=1e-2, weight_decay=0.1, impl=impl), chunk_numel=1000)
        for i, g in enumerate(grads):
            # A clone: torch's fused AdamW writes the scaled fp32 gradient back.
            opt.step(g.clone(), lr=1e-2 * (i + 1), clip_coef=0.37, skip=((40, 77),) if i == 1 else ())
        results[impl] = (store.master_of("layers.0").clone(), *(m.clone() for m in store.moments_of("layers.0")))
        assert torch.equal(store.streamed_of("layers.0"), results[impl][0].bfloat16())
    exact = torch.backends.cpu.get_cpu_capability() in CONTRACTED_IN_EIGHTS
    for ours, theirs in zip(results["numba"], results["torch"], strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0 if exact else 1e-6, atol=0 if exact else 1e-7)
