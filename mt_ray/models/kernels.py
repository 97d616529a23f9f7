"""Optional fused kernels: Liger's RMSNorm, SwiGLU/GeGLU and rotary swapped into the skeleton.

The swap runs on the skeleton before the engine builds its templates, through Liger's own
per-family function (`apply_liger_kernel_to_<model_type>(model=skeleton)`), so each family
gets Liger's own settings: Gemma's `1 + weight` offset and fp32 casting, which norms may
overwrite their incoming gradient in place. Liger rebinds `forward` on the existing norm and
MLP modules and keeps their parameters, so the templates bind the same flat weights under
the same names (checked below).

Two things reach past the skeleton. Liger's rotary swap replaces the family's module-level
`apply_rotary_pos_emb`, and its class swaps make the family's RMSNorm and MLP classes Liger's
for models built later; both hold for the whole process, so an engine with `kernels: liger`
should own its process (each Ray worker does). Liger's loss kernels stay off: the engine
computes its own chunked fp32 cross-entropy.
"""

from __future__ import annotations

import inspect
import logging
import re
import sys
from collections.abc import Callable, Mapping

import torch
from torch import nn

from mt_ray.errors import ConfigError, ModelNotSupportedError
from mt_ray.models.discovery import ModelSpec

logger = logging.getLogger(__name__)

ApplyFn = Callable[..., None]

# The engine computes the loss itself; every Liger function that has these flags gets them off.
_LOSS_FLAGS_OFF = {"cross_entropy": False, "fused_linear_cross_entropy": False}


def apply_kernels(spec: ModelSpec, kernels: str, device: torch.device,
                  liger_fns: Mapping[str, ApplyFn] | None = None) -> list[str]:
    """Swap the chosen kernels into `spec.skeleton`; returns what was swapped ([] for 'torch').

    `liger_fns` maps model_type to Liger's apply function; by default Liger's own
    MODEL_TYPE_TO_APPLY_LIGER_FN (tests pass a fake).
    """
    if kernels == "torch":
        return []
    if device.type != "cuda":
        raise ConfigError(
            f"kernels: liger runs Triton kernels on CUDA only, but the engine's device is {device}; "
            "use kernels: torch, or a CUDA device"
        )
    params_before = _param_shapes(spec.skeleton)
    rotary_before = _rotary_fns(spec.skeleton)
    apply_liger(spec.skeleton, spec.config.model_type, liger_fns)
    if _param_shapes(spec.skeleton) != params_before:
        raise ModelNotSupportedError(
            f"Liger changed the parameter names or shapes of this '{spec.config.model_type}' model, so the "
            "engine could no longer bind its weights by name; use kernels: torch"
        )
    swapped = _rebound_modules(spec.skeleton) + _changed_rotary(spec.skeleton, rotary_before)
    if not swapped:
        raise ModelNotSupportedError(
            f"Liger's function for '{spec.config.model_type}' swapped no module of this model; use kernels: torch"
        )
    logger.info("liger kernels: %s", ", ".join(_collapse_layer_indices(swapped)))
    return swapped


def apply_liger(model: nn.Module, model_type: str, liger_fns: Mapping[str, ApplyFn] | None = None) -> None:
    """Liger's own swap for the family, loss kernels off, on any instance (the engine's skeleton, or a
    benchmark peer's whole model so both run the same kernels)."""
    apply = _apply_fn_for(model_type, load_liger_fns() if liger_fns is None else liger_fns)
    try:
        apply(model=model, **_loss_flags_off(apply))
    except Exception as e:
        raise ModelNotSupportedError(
            f"Liger's {getattr(apply, '__name__', 'apply function')} failed on this "
            f"'{model_type}' model ({type(e).__name__}: {e}); use kernels: torch"
        ) from e


def load_liger_fns() -> Mapping[str, ApplyFn]:
    """Liger's model_type -> apply function table, or an error saying how to get it."""
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError as e:  # Liger imports triton at import time; a CPU-only torch has none
        raise ConfigError(
            f"kernels: liger needs liger-kernel and triton, which do not import here ({e}); "
            "pip install liger-kernel (CUDA torch brings triton), or use kernels: torch"
        ) from e
    return MODEL_TYPE_TO_APPLY_LIGER_FN


def _apply_fn_for(model_type: str, fns: Mapping[str, ApplyFn]) -> ApplyFn:
    apply = fns.get(model_type)
    if apply is None:
        raise ModelNotSupportedError(
            f"Liger has no kernels for model_type '{model_type}' (it supports {', '.join(sorted(fns))}); "
            "use kernels: torch"
        )
    return apply


def _loss_flags_off(apply: ApplyFn) -> dict[str, bool]:
    """The loss flags this family's function takes (as Liger's own `_apply_liger_kernel_to_instance` filters)."""
    params = inspect.signature(apply).parameters
    return {k: v for k, v in _LOSS_FLAGS_OFF.items() if k in params}


def _param_shapes(model: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


def _rebound_modules(model: nn.Module) -> list[str]:
    """Modules whose `forward` is bound on the instance, which is how Liger patches one."""
    return [name for name, m in model.named_modules() if "forward" in vars(m)]


def _rotary_fns(model: nn.Module) -> dict[str, object]:
    """Each modeling file's module-level `apply_rotary_pos_emb`, which attention looks up per call."""
    files = {type(m).__module__ for m in model.modules()}
    return {f: getattr(sys.modules[f], "apply_rotary_pos_emb", None) for f in files if f in sys.modules}


def _changed_rotary(model: nn.Module, before: dict[str, object]) -> list[str]:
    after = _rotary_fns(model)
    return [f"{f}.apply_rotary_pos_emb" for f in sorted(after) if after[f] is not before.get(f)]


def _collapse_layer_indices(names: list[str]) -> list[str]:
    """'model.layers.7.mlp' -> 'model.layers.*.mlp', so the log line stays one line."""
    return list(dict.fromkeys(re.sub(r"\.\d+\.", ".*.", n) for n in names))
