"""Which transformers attention backend the engine runs a family with.

SDPA cannot express attention-logit soft-capping (Gemma 2) or learned attention sinks (GPT-OSS):
transformers' SDPA path drops both without a word, and the model trains as a different model. Nor does
transformers' SDPA path keep a dynamic mask causal (Doge's `prepare_dynamic_mask` builds its additive mask from
the one it is given, and under SDPA an unpacked row is given none, so every token attends to later ones).
`auto` (the default) takes eager attention, which implements all three exactly as transformers
defines them, where the family needs any. Otherwise it takes `PACKED_ROWS_BACKEND` on CUDA
where that backend can run the model (packed rows then keep their documents apart with no dense
T x T mask: see mt_ray/models/varlen.py), and SDPA elsewhere (the CPU, fp32). A backend named
explicitly that lacks a feature the family uses, or cannot run here, is refused.
"""

from __future__ import annotations

import logging

import torch

from mt_ray.errors import ConfigError
from mt_ray.models.discovery import ModelSpec
from mt_ray.models.varlen import (
    VARLEN,
    bounds_attention_by_cu_seqlens,
    register_tower_varlen,
    register_varlen,
    varlen_problem,
)

logger = logging.getLogger(__name__)

# What each backend implements of the features SDPA lacks ("sinks" in flex attention: CUDA only).
_IMPLEMENTS = {
    "eager": {"soft-capping", "sinks", "dynamic mask"},
    "flex_attention": {"soft-capping", "sinks on cuda"},
    "flash_attention_2": {"soft-capping"},
    VARLEN: set(),
}

# What `auto` trains with on CUDA where the family allows it: packed rows (the data default) at the
# speed of unpacked ones, with no mask held through the step (measured: bench/results/packed_7b.json).
PACKED_ROWS_BACKEND = VARLEN


def attention_features(spec: ModelSpec) -> set[str]:
    """Features of the family's attention that SDPA does not implement."""
    features = set()
    if getattr(spec.config, "attn_logit_softcapping", None):
        features.add("soft-capping")
    if any(name.endswith("sinks") for name, _ in spec.skeleton.named_parameters()):
        features.add("sinks")
    if any(hasattr(module, "prepare_dynamic_mask") for module in spec.skeleton.modules()):
        features.add("dynamic mask")
    return features


def resolve_attention(spec: ModelSpec, requested: str, device: torch.device,
                      dtype: torch.dtype) -> str | dict[str, str]:
    """What to set as `config._attn_implementation` for `requested` ('auto', 'varlen' or a transformers
    name), computing in `dtype` on `device`: the backend's name, or per sub-config (see `_language_only`)."""
    needs = attention_features(spec)
    model_type = spec.config.model_type
    if requested == "auto":
        if needs:
            logger.info("attention: eager for '%s', which uses %s (SDPA drops it)", model_type, ", ".join(sorted(needs)))
            return "eager"
        if device.type == "cuda" and _can_run(spec, PACKED_ROWS_BACKEND, device, dtype):
            return _language_only(spec, _registered(PACKED_ROWS_BACKEND))
        return spec.skeleton.get_correct_attn_implementation(None)  # SDPA, or eager where the family lacks it
    if requested == "flex_attention" and device.type != "cuda":
        raise ConfigError("engine.attn_implementation: 'flex_attention' trains on CUDA only (torch's FlexAttention "
                          f"has no backward on {device.type}); use 'auto'")
    implements = {f.removesuffix(f" on {device.type}") for f in _IMPLEMENTS.get(requested, ())}
    lacking = needs - implements
    if lacking:
        raise ConfigError(
            f"engine.attn_implementation: '{requested}' does not implement the attention {', '.join(sorted(lacking))} "
            f"that '{model_type}' uses (transformers would drop it silently); use 'auto' (eager attention)"
        )
    if requested == VARLEN:
        problem = varlen_problem(spec, device, dtype)
        if problem:
            raise ConfigError(f"engine.attn_implementation: 'varlen' {problem}; use 'auto'")
        return _language_only(spec, register_varlen())
    try:
        return spec.skeleton.get_correct_attn_implementation(requested)
    except (ValueError, ImportError) as e:
        raise ConfigError(f"engine.attn_implementation: '{requested}' cannot run '{model_type}': {e}") from None


def _can_run(spec: ModelSpec, backend: str, device: torch.device, dtype: torch.dtype) -> bool:
    if backend == VARLEN:
        return varlen_problem(spec, device, dtype) is None
    try:
        spec.skeleton.get_correct_attn_implementation(backend)
    except (ValueError, ImportError):
        return False
    return True


def _registered(backend: str) -> str:
    return register_varlen() if backend == VARLEN else backend


def _language_only(spec: ModelSpec, backend: str) -> str | dict[str, str]:
    """`backend` for the language model. An image-text model's vision tower attends both ways: where its blocks
    bound attention by `cu_seqlens` it takes the same kernel both ways (`TOWER_VARLEN`), else transformers'
    default backend, as do its other parts."""
    if backend != VARLEN or spec.vision is None:
        return backend
    others = spec.skeleton.get_correct_attn_implementation(None)
    tower = register_tower_varlen() if bounds_attention_by_cu_seqlens(spec.vision.blocks) else others
    vision_config = getattr(spec.config, "vision_config", None)
    subs = {}
    for key in spec.config.sub_configs:
        sub = getattr(spec.config, key, None)
        subs[key] = backend if sub is spec.base.config else tower if sub is vision_config else others
    return {"": backend, **subs}
