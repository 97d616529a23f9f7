"""Which transformers attention backend the engine runs a family with.

SDPA cannot express attention-logit soft-capping (Gemma 2) or learned attention sinks (GPT-OSS):
transformers' SDPA path drops both without a word, and the model trains as a different model.
`auto` (the default) takes SDPA where the family needs neither, and eager attention, which
implements both exactly as transformers defines them, where it does. A backend named explicitly
that lacks a feature the family uses is refused.
"""

from __future__ import annotations

import logging

import torch

from mt_ray.errors import ConfigError
from mt_ray.models.discovery import ModelSpec

logger = logging.getLogger(__name__)

# What each backend implements of the features SDPA lacks ("sinks" in flex attention: CUDA only).
_IMPLEMENTS = {
    "eager": {"soft-capping", "sinks"},
    "flex_attention": {"soft-capping", "sinks on cuda"},
    "flash_attention_2": {"soft-capping"},
}


def attention_features(spec: ModelSpec) -> set[str]:
    """Features of the family's attention that SDPA does not implement."""
    features = set()
    if getattr(spec.config, "attn_logit_softcapping", None):
        features.add("soft-capping")
    if any(name.endswith("sinks") for name, _ in spec.skeleton.named_parameters()):
        features.add("sinks")
    return features


def resolve_attention(spec: ModelSpec, requested: str, device: torch.device) -> str:
    """The backend to set as `config._attn_implementation` for `requested` ('auto' or a transformers name)."""
    needs = attention_features(spec)
    model_type = spec.config.model_type
    if requested == "auto":
        if needs:
            logger.info("attention: eager for '%s', which uses %s (SDPA drops it)", model_type, ", ".join(sorted(needs)))
            return "eager"
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
    try:
        return spec.skeleton.get_correct_attn_implementation(requested)
    except (ValueError, ImportError) as e:
        raise ConfigError(f"engine.attn_implementation: '{requested}' cannot run '{model_type}': {e}") from None
