"""AdamW over the host store's flat unit buffers, and the learning-rate schedule.

Each unit gets one optimizer over two flat parameters (its decayed and non-decayed slices),
whose Adam moments *are* the store's m and v slices, so the optimizer allocates nothing and a
checkpoint of the store is a checkpoint of the optimizer.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mt_ray.engine.config import OptimizerConfig
from mt_ray.engine.host_store import HostStore
from mt_ray.models.discovery import UnitSpec


def lr_at(step: int, cfg: OptimizerConfig, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based), matching transformers' schedules."""
    if step < cfg.warmup_steps:
        return cfg.lr * step / max(1, cfg.warmup_steps)
    if cfg.schedule == "constant":
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    decay = 0.5 * (1.0 + math.cos(math.pi * progress)) if cfg.schedule == "cosine" else 1.0 - progress
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay)


def deepspeed_available() -> bool:
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: F401
    except Exception:  # deepspeed raises assorted errors when its ops cannot build
        return False
    return True


class UnitOptimizer:
    """AdamW for one unit, stepping in place on the store's master/moment slices."""

    def __init__(self, store: HostStore, unit: UnitSpec, cfg: OptimizerConfig):
        master = store.master_of(unit.name)
        m, v = store.moments_of(unit.name)
        n_decay = sum(p.numel for p in unit.params if p.decays)
        self.unit = unit.name
        self.params: list[nn.Parameter] = []
        groups = []
        for lo, hi, wd in ((0, n_decay, cfg.weight_decay), (n_decay, unit.numel, 0.0)):
            if hi > lo:
                p = nn.Parameter(master[lo:hi], requires_grad=False)
                self.params.append(p)
                groups.append({"params": [p], "weight_decay": wd, "bounds": (lo, hi)})
        use_ds = cfg.impl == "deepspeed" or (cfg.impl == "auto" and deepspeed_available())
        self.opt = _build(groups, cfg, use_ds)
        for g in self.opt.param_groups:
            lo, hi = g["bounds"]
            self.opt.state[g["params"][0]] = {
                "step": 0 if use_ds else torch.tensor(0.0),
                "exp_avg": m[lo:hi],
                "exp_avg_sq": v[lo:hi],
            }

    def step(self, grad: torch.Tensor, lr: float) -> None:
        """Apply one AdamW update with fp32 `grad` (the unit's flat gradient)."""
        for g in self.opt.param_groups:
            lo, hi = g["bounds"]
            g["lr"] = lr
            g["params"][0].grad = grad[lo:hi]
        self.opt.step()
        for p in self.params:
            p.grad = None

    def set_step(self, step: int) -> None:
        """Restore the bias-correction step count (after loading a checkpoint)."""
        for state in self.opt.state.values():
            state["step"] = step if isinstance(state["step"], int) else torch.tensor(float(step))


def _build(groups: list[dict], cfg: OptimizerConfig, use_deepspeed: bool) -> torch.optim.Optimizer:
    if use_deepspeed:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, adamw_mode=True, fp32_optim_states=True)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=True)
