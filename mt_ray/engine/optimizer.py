"""AdamW over the host store's flat unit buffers, and the learning-rate schedule.

Each unit gets one optimizer over its chunks (`state_files.chunk_bounds`: the decayed and
non-decayed slices, cut to the store's chunk size), which updates the store's state chunk by chunk
(`HostStore.chunk`: views of its buffers, or a slot read from NVMe), so the optimizer allocates
nothing and a checkpoint of the store is a checkpoint of the optimizer. It keeps only the step
counts. The update is `engine.host_adamw`'s one-pass kernel (`optimizer.impl: numba`, the default),
or torch's or DeepSpeed's optimizer with one parameter bound to each chunk's state.

A tensor that got no gradient in a step (`skip`: LLaVA's tower norm, which `get_image_features` never reads) is
left as torch's AdamW leaves a parameter whose `.grad` is None: weights and moments untouched, no decay, and its
own step count stays behind the unit's (`lags`), so its bias correction is its own when it trains later.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from mt_ray.engine.config import OptimizerConfig
from mt_ray.engine.host_adamw import AdamStep, adamw_step
from mt_ray.engine.host_store import HostStore
from mt_ray.engine.state_files import chunk_bounds
from mt_ray.errors import ConfigError
from mt_ray.models.discovery import UnitSpec

Spans = tuple[tuple[int, int], ...]
"""[lo, hi) ranges of a unit's flat state, sorted and disjoint."""

Scratch = Callable[[int], torch.Tensor]
"""fp32 room for at least n elements, into which torch's AdamW gets a gradient upcast (the caller's, reused)."""


def lr_at(step: int, cfg: OptimizerConfig, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based), matching transformers' schedules."""
    warmup = cfg.warmup(total_steps)
    if step < warmup:
        return cfg.lr * step / max(1, warmup)
    if cfg.schedule == "constant":
        return cfg.lr
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    decay = 0.5 * (1.0 + math.cos(math.pi * progress)) if cfg.schedule == "cosine" else 1.0 - progress
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay)


def counts_behind(optimizers: dict[str, UnitOptimizer], step: int) -> dict[str, int]:
    """Each unit's Adam count where it is not `step` (a vision unit skips the steps without images, as torch's
    AdamW skips a parameter whose gradient is None), and each span's lag behind its unit (`unit@lo:hi`).
    A checkpoint stores these beside its step."""
    behind = {unit: count for unit, opt in optimizers.items() if (count := opt.step_count()) != step}
    return behind | {f"{unit}@{lo}:{hi}": lag for unit, opt in optimizers.items() for (lo, hi), lag in opt.span_lags().items()}


def restore_counts(optimizers: dict[str, UnitOptimizer], step: int, behind: dict[str, int]) -> None:
    """Set every unit's Adam count back to `step`, or to its count in `behind` (`counts_behind`), and its spans' lags."""
    lags: dict[str, dict[tuple[int, int], int]] = {}
    for key, lag in behind.items():
        unit, _, span = key.partition("@")
        if span:
            lo, hi = span.split(":")
            lags.setdefault(unit, {})[(int(lo), int(hi))] = lag
    for unit, opt in optimizers.items():
        opt.set_step(behind.get(unit, step), lags.get(unit, {}))


def _adamw_for(master: torch.Tensor) -> Callable[..., None]:
    """The one-pass AdamW for state where `master` is: the host's numba kernel, or its Triton twin on a GPU
    (`device_state.py`), the same arithmetic; either takes `chunk`: its elements as that many a host call."""
    if master.is_cuda:
        from mt_ray.engine.device_adamw import adamw_step as on_device  # Triton: CUDA builds only

        return on_device
    return _host_calls


def _host_calls(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor,
                step: AdamStep, copy: torch.Tensor | None = None, chunk: int | None = None) -> None:
    n = master.numel()
    for lo in range(0, n, chunk or max(1, n)):
        hi = min(n, lo + (chunk or n))
        adamw_step(master[lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi], grad[lo:hi], step,
                   None if copy is None else copy[lo:hi])


def deepspeed_available() -> bool:
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: F401
    except Exception:  # deepspeed raises assorted errors when its ops cannot build
        return False
    return True


class UnitOptimizer:
    """AdamW for one unit, stepping in place on the store's master/moment chunks, one chunk at a time."""

    def __init__(self, store: HostStore, unit: UnitSpec, cfg: OptimizerConfig, chunk_numel: int | None = None):
        """`chunk_numel`: elements per chunk, by default the store's (a file-backed store's chunks are its records)."""
        self.store = store
        self.unit = unit.name
        self.cfg = cfg
        self.use_ds = cfg.impl == "deepspeed"
        if self.use_ds and not deepspeed_available():
            raise ConfigError("optimizer.impl: deepspeed needs DeepSpeed's CPUAdam, which does not import or build "
                              "here; pip install deepspeed (with a C++ toolchain), or use impl: numba")
        self.chunk_numel = chunk_numel or store.chunk_numel
        self.numel = unit.numel
        self.bounds = chunk_bounds(unit, self.chunk_numel)
        # torch's and DeepSpeed's optimizers step one bound parameter a chunk; the numba kernel needs none.
        self.opt = None if cfg.impl == "numba" else _build(
            [{"params": [nn.Parameter(torch.empty(0), requires_grad=False)],  # bound to the state per step
              "weight_decay": cfg.weight_decay if decays else 0.0} for _, _, decays in self.bounds], cfg, self.use_ds)
        self.count = 0  # updates the unit has had
        self.lags: dict[tuple[int, int], int] = {}  # spans that missed updates of their unit (`skip`), and how many

    def step(self, grad: torch.Tensor, lr: float, clip_coef: float = 1.0, scratch: Scratch = torch.empty,
             read_only: bool = False, skip: Spans = ()) -> None:
        """One AdamW update from the unit's flat gradient, scaled by `clip_coef`; the `skip` spans got no gradient.

        Chunks are stepped one at a time, each bound to its state from the store and handed back to it after, and
        each reading its slice of `grad`, in runs that share a step count, the skipped ones left out (torch skips
        parameters without a gradient). The numba kernel reads the gradient as it is and writes the chunk's streamed
        copy itself; torch's upcasts a compute-dtype gradient through `scratch`, and a `read_only` one too (fused
        AdamW writes the scaled gradient back). A unit kept on the device is updated in one launch a part instead.
        """
        if self.opt is None and not skip and not self.lags and self.store.kept_on_device(self.unit):
            self._step_on_device(grad, lr, clip_coef)
            return
        for i, (lo, hi, decays) in enumerate(self.bounds):
            chunk = self.store.chunk(self.unit, lo, hi)
            copy = self.store.copy_of(self.unit, lo, hi) if self.opt is None else None
            for a, b, lag in _runs(lo, hi, skip, self.lags):
                state = (chunk.master[a - lo : b - lo], chunk.exp_avg[a - lo : b - lo],
                         chunk.exp_avg_sq[a - lo : b - lo])
                if self.opt is None:
                    adam = AdamStep(lr, *self.cfg.betas, self.cfg.eps, self.cfg.weight_decay if decays else 0.0,
                                    self.count - lag + 1, clip_coef)
                    _adamw_for(state[0])(*state, grad[a:b], adam, None if copy is None else copy[a - lo : b - lo])
                else:
                    part = grad[a:b]
                    if part.dtype != torch.float32 or read_only:
                        part = scratch(b - a).copy_(part)
                    self._step_torch(self.opt.param_groups[i], state, part, lr, clip_coef, lag)
            self.store.chunk_updated(self.unit, lo, hi, chunk, copy_written=copy is not None)
        self.count += 1
        for span in skip:
            self.lags[span] = self.lags.get(span, 0) + 1

    def _step_on_device(self, grad: torch.Tensor, lr: float, clip_coef: float) -> None:
        """The chunks' updates in one launch for the decayed part and one for the rest (`device_adamw`, in the
        host's `chunk_numel` calls over each), on the current stream: a few Python calls a unit, which the
        engine's thread (launching the next forward) would otherwise hold up a GIL switch each."""
        whole = self.store.chunk(self.unit, 0, self.numel)
        update = _adamw_for(whole.master)
        split = sum(hi - lo for lo, hi, decays in self.bounds if decays)
        for a, b, decays in ((0, split, True), (split, self.numel, False)):
            if a < b:
                adam = AdamStep(lr, *self.cfg.betas, self.cfg.eps, self.cfg.weight_decay if decays else 0.0,
                                self.count + 1, clip_coef)
                update(*(t[a:b] for t in whole), grad[a:b], adam, chunk=self.chunk_numel)
        self.store.chunk_updated(self.unit, 0, self.numel, whole)
        self.count += 1

    def _step_torch(self, group: dict, state: tuple[torch.Tensor, ...], grad: torch.Tensor, lr: float,
                    clip_coef: float, lag: int) -> None:
        """One run through torch's (or DeepSpeed's) optimizer, its one parameter bound to the run's state."""
        group["lr"] = lr
        p = group["params"][0]
        p.data = state[0]
        self.opt.state[p] = {"step": self._count_state(self.count - lag), "exp_avg": state[1], "exp_avg_sq": state[2]}
        p.grad = grad
        self._apply_clip(p.grad, clip_coef)
        self.opt.step()
        p.grad = None

    def _count_state(self, count: int) -> int | torch.Tensor:
        return count if self.use_ds else torch.tensor(float(count))

    def _apply_clip(self, grad: torch.Tensor, coef: float) -> None:
        if self.use_ds:
            if coef != 1.0:
                grad.mul_(coef)
            return
        # torch's fused AdamW divides gradients by `grad_scale` inside its one pass over the
        # data, which saves a separate multiply over every gradient.
        self.opt.grad_scale = None if coef == 1.0 else torch.tensor(1.0 / coef)
        self.opt.found_inf = None if coef == 1.0 else torch.tensor(0.0)

    def step_count(self) -> int:
        """Updates applied so far: the bias-correction count of every tensor that has not missed one (`lags`)."""
        return self.count

    def span_lags(self) -> dict[tuple[int, int], int]:
        """The spans whose own count is behind the unit's, and by how many updates."""
        return dict(self.lags)

    def set_step(self, step: int, lags: dict[tuple[int, int], int] | None = None) -> None:
        """Restore the bias-correction step count, and the spans' lags (after loading a checkpoint)."""
        self.count = step
        self.lags = dict(lags or {})


def _runs(lo: int, hi: int, skip: Spans, lags: dict[tuple[int, int], int]) -> list[tuple[int, int, int]]:
    """[a, b) runs of the chunk [lo, hi) outside `skip`, each with one lag (`UnitOptimizer.lags`)."""
    cuts = sorted({lo, hi, *(x for s in (*skip, *lags) for x in s if lo < x < hi)})
    runs: list[tuple[int, int, int]] = []
    for a, b in zip(cuts, cuts[1:], strict=False):
        if any(s <= a and b <= e for s, e in skip):
            continue
        lag = next((n for (s, e), n in lags.items() if s <= a and b <= e), 0)
        if runs and runs[-1][1] == a and runs[-1][2] == lag:
            runs[-1] = (runs[-1][0], b, lag)
        else:
            runs.append((a, b, lag))
    return runs


def _build(groups: list[dict], cfg: OptimizerConfig, use_deepspeed: bool) -> torch.optim.Optimizer:
    if use_deepspeed:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, adamw_mode=True, fp32_optimizer_states=True)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=True)
