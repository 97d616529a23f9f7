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

One swap is undone: a module that multiplies its own weight matrices, which in Liger 0.8 means
the MoE expert banks (`LigerExperts`, swapped in for Mixtral, Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE
and DeepSeek-V3 experts). Its fused grouped GEMM calls Triton's `tl.dot` with no
`input_precision`, and Triton's default for fp32 operands on tensor cores is TF32 (10-bit
mantissa), whatever torch's `allow_tf32` says: an fp32 run would silently train its experts at
TF32. On the H100 that put Mixtral's, Qwen3-Next's and DeepSeek-V3's weight updates past 1e-2 of
transformers' (tests/gpu/test_families_cuda.py); in Triton's CPU interpreter, whose `tl.dot` is
exact fp32, the same Liger swaps, experts included, match transformers within 1% of that
tolerance, and rounding the dot operands to TF32 there reproduces the H100's failures. The swaps
kept (RMSNorm, SwiGLU/GeGLU, rotary) are elementwise Triton kernels with no `tl.dot`: their MLPs'
matrix products stay in the modules' own `nn.Linear`, which honours torch's precision settings.
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
    """Liger's own swap for the family, loss kernels off, less its expert banks (see the module's
    docstring), on any instance (the engine's skeleton, or a benchmark peer's whole model so both run
    the same kernels).

    A Liger function that fails on the model (Liger 0.8.5's qwen3_moe function assumes every layer
    is sparse, so a Qwen3-MoE with dense layers ends in an AttributeError) is refused, and the
    module-level names it had already replaced are put back, so that later models in this process
    run transformers' own code.
    """
    apply = _apply_fn_for(model_type, load_liger_fns() if liger_fns is None else liger_fns)
    namespaces = {f: dict(vars(sys.modules[f])) for f in _model_files(model)}
    try:
        apply(model=model, **_loss_flags_off(apply))
    except Exception as e:
        _restore_namespaces(namespaces)
        raise ModelNotSupportedError(
            f"Liger's {getattr(apply, '__name__', 'apply function')} failed on this "
            f"'{model_type}' model ({type(e).__name__}: {e}); use kernels: torch"
        ) from e
    _keep_transformers_experts(model, model_type, namespaces)


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


def _model_files(model: nn.Module) -> set[str]:
    """The modules that define the model's classes (its modeling file among them)."""
    return {type(m).__module__ for m in model.modules()} & sys.modules.keys()


def _restore_namespaces(namespaces: dict[str, dict[str, object]]) -> None:
    """Put back every module-level name changed since `namespaces` was taken."""
    for f, before in namespaces.items():
        module = sys.modules[f]
        for name in vars(module).keys() - before.keys():
            delattr(module, name)
        for name, value in before.items():
            if vars(module).get(name) is not value:
                setattr(module, name, value)


def _keep_transformers_experts(model: nn.Module, model_type: str, namespaces: dict[str, dict[str, object]]) -> None:
    """Undo Liger's swap of every module that owns a weight matrix itself (an MoE expert bank: its
    forward is one fused GEMM kernel, TF32 in fp32) and put its class back in its modeling file, where
    Liger's class swap would otherwise reach every expert bank built later in this process."""
    for name, m in model.named_modules():
        if "forward" not in vars(m) or all(p.dim() < 2 for p in m.parameters(recurse=False)):
            continue
        for attr in ("forward", "_get_name"):  # what Liger binds on the instance
            vars(m).pop(attr, None)
        cls = type(m)
        if cls.__module__.startswith("liger_kernel"):  # built after a class swap this process never undid
            raise ModelNotSupportedError(
                f"'{name}' of this '{model_type}' model is Liger's {cls.__name__}, whose fused GEMMs run fp32 as "
                "TF32; build the model in a process where Liger has not replaced transformers' classes, or use "
                "kernels: torch"
            )
        if namespaces.get(cls.__module__, {}).get(cls.__name__) is cls:
            setattr(sys.modules[cls.__module__], cls.__name__, cls)


def _rotary_fns(model: nn.Module) -> dict[str, object]:
    """Each modeling file's module-level `apply_rotary_pos_emb`, which attention looks up per call."""
    return {f: getattr(sys.modules[f], "apply_rotary_pos_emb", None) for f in _model_files(model)}


def _changed_rotary(model: nn.Module, before: dict[str, object]) -> list[str]:
    after = _rotary_fns(model)
    return [f"{f}.apply_rotary_pos_emb" for f in sorted(after) if after[f] is not before.get(f)]


def _collapse_layer_indices(names: list[str]) -> list[str]:
    """'model.layers.7.mlp' -> 'model.layers.*.mlp', so the log line stays one line."""
    return list(dict.fromkeys(re.sub(r"\.\d+\.", ".*.", n) for n in names))
