"""How many units keep their optimizer state on the GPU (`engine.device_optimizer_units`), planned at step 1.

The GPU's budget (the calculator's: its headroom of `gpu_memory_limit_gb` or the device's memory) first holds the
step as the device model sizes it, with its kept block graphs and what the stage keeps beside it (GRPO's rollout
copy): kept graphs remove compute, so they come first. What is left, less `MARGIN_GIB`, holds the state of the
first units in forward order (`device_state.kept_prefix`), 12 B a parameter and the gradient until the norm.
"""

from __future__ import annotations

from mt_ray.engine.calculator import GPU_HEADROOM
from mt_ray.engine.config import EngineConfig, OptimizerConfig
from mt_ray.engine.device_state import kept_bytes_per_param, kept_prefix
from mt_ray.engine.sizing import GIB, Stage, device_bytes
from mt_ray.errors import ConfigError, InsufficientMemoryError
from mt_ray.models.discovery import ModelSpec

# Kept free beyond the headroom: the device model's misses at the MoE and 7B shapes were about 1 GiB, and the state
# stays for the whole run, so a step the model underestimates must still fit beside it.
MARGIN_GIB = 3.0


def eligible_units(spec: ModelSpec, unit_order: list[str], trained: set[str]) -> list[str]:
    """The units (forward order) whose state may live on the device: trained, and tied to no other unit's weights
    (a mirror is written from its owner's master on the host)."""
    tied = {u for u, mirrors in spec.mirrors.items() if mirrors} | {m.owner for ms in spec.mirrors.values() for m in ms}
    return [u for u in unit_order if u in trained and u not in tied]


def why_not_on_device(cfg: EngineConfig, opt_cfg: OptimizerConfig, local: bool) -> str | None:
    """Why this engine cannot keep optimizer state on the device at all (None: it can)."""
    if not local:
        return "a data-parallel worker's optimizer runs on its node's host, not in the engine"
    if cfg.schedule != "stream":
        return "the resident schedule keeps no streamed state"
    if cfg.state_placement != "host":
        return f"engine.state_placement: {cfg.state_placement} keeps the state on disk"
    if opt_cfg.impl != "numba":
        return f"optimizer.impl: {opt_cfg.impl} runs on the host only (the device kernel is numba's twin)"
    return None


def plan_device_units(spec: ModelSpec, cfg: EngineConfig, opt_cfg: OptimizerConfig, local: bool, eligible: list[str],
                      gpu_gb: float | None, stage: Stage, micro_batch: int, seq: int, n_micro: int,
                      kept_graphs: int) -> list[str]:
    """The units (a prefix of `eligible`) whose state the run keeps on the GPU: `auto` as many as fit beside a
    step of `n_micro` micro-batches of `micro_batch` x `seq` tokens keeping `kept_graphs` block graphs (none on
    the CPU, `gpu_gb` None), a number as given, refused where it cannot run or fit."""
    want = cfg.device_optimizer_units
    if want == 0:
        return []
    reason = why_not_on_device(cfg, opt_cfg, local)
    if reason is not None:
        if want == "auto":
            return []
        raise ConfigError(f"engine.device_optimizer_units: {want} cannot run here: {reason}; set it to 0 or auto")
    if want != "auto" and want > len(eligible):
        raise ConfigError(f"engine.device_optimizer_units: {want}, but only {len(eligible)} units can keep their "
                          f"state on the device (trained, with no tied weights); set it to {len(eligible)} or less")
    per_param = kept_bytes_per_param(cfg.grad_torch_dtype)
    numels = {u.name: u.numel for u in spec.units}
    if gpu_gb is None:
        return [] if want == "auto" else eligible[:want]
    step = cfg.model_copy(update={"keep_activations": kept_graphs})
    used = device_bytes(spec, step, micro_batch, seq, micro_batch * n_micro, stage=stage)["total"]
    budget = gpu_gb * GIB * GPU_HEADROOM - used - MARGIN_GIB * GIB
    fits = kept_prefix(eligible, numels, set(eligible), budget, per_param)
    if want == "auto":
        return fits
    if want > len(fits):
        need = state_bytes(spec, cfg, eligible[:want])
        raise InsufficientMemoryError(
            f"engine.device_optimizer_units: {want} units need {need / GIB:.1f} GiB of GPU memory for their optimizer "
            f"state beside the step ({used / GIB:.1f} GiB: {n_micro} micro-batches of {micro_batch} x {seq} tokens, "
            f"{kept_graphs} kept block graphs), but {max(0.0, budget) / GIB:.1f} GiB is left of a {gpu_gb:.3g} GiB "
            f"GPU; the largest that fits is {len(fits)}: set engine.device_optimizer_units: {len(fits)} (or auto)")
    return eligible[:want]


def state_bytes(spec: ModelSpec, cfg: EngineConfig, units: list[str]) -> int:
    """GPU bytes the state of `units` takes for the run (and their gradients until the norm)."""
    numels = {u.name: u.numel for u in spec.units}
    return sum(numels[u] for u in units) * kept_bytes_per_param(cfg.grad_torch_dtype)
