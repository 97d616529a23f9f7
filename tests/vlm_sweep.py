"""Every model type of transformers' image-text mapping: trained at parity (tests/unit/engine/test_vlm.py) or refused
by name before anything is built.

mt-ray discovers any composite model's tower and projector by structure, but trains only the families a parity
test covers (`VERIFIED_FAMILIES`, frozen and trained tower); each other type must be refused by `discover`, naming it.
"""

from __future__ import annotations

from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from mt_ray.errors import ConfigError, ModelNotSupportedError
from mt_ray.models.discovery import discover
from mt_ray.models.vision import VERIFIED_FAMILIES
from tests.family_sweep import Outcome, _short

IMAGE_TEXT = "image-text"


def image_text_outcome(model_type: str) -> Outcome:
    """Verified families are matched (their parity tests run in test_vlm.py); any other must be refused by name."""
    if model_type in VERIFIED_FAMILIES:
        return Outcome(model_type, "matched", "")
    try:
        config = CONFIG_MAPPING[model_type]()
    except Exception as e:  # noqa: BLE001 - anything transformers raises building its own config
        return Outcome(model_type, "skipped", f"transformers cannot build its default config: {_short(e)}")
    try:
        spec = discover(config)
    except (ModelNotSupportedError, ConfigError) as e:
        if f"'{model_type}'" in str(e) or f"'{config.model_type}'" in str(e):
            return Outcome(model_type, "refused", str(e))
        return Outcome(model_type, "error", f"refused without naming the model type: {e}")
    except Exception as e:  # noqa: BLE001
        return Outcome(model_type, "error", _short(e))
    if spec.vision is None:
        return Outcome(model_type, "skipped", "transformers builds a text-only causal LM from its config (no image "
                       "path to train; the causal-LM sweep covers the text model)")
    return Outcome(model_type, "error", "discovered, but no parity test covers it: it must be refused")
