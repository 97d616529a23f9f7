"""An image-text model whose language model is a whole causal LM with its own head (Llama 4) trains as transformers'.

Llama 4's composite body is the model itself: its `language_model` is a `Llama4ForCausalLM`, whose decoder body
streams as the layers and whose final norm and LM head are the head unit, and its forward applies the projector to
what `get_image_features` returns. Its chunked attention and NoPE temperature follow row positions, so the sweep's
tiny Llama 4 runs each document alone; here chunks span the row and the temperature is off, so that its packed rows
are exact and the step is checked against transformers' model on each document.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForImageTextToText

from mt_ray.models.discovery import discover
from tests.family_checks import assert_exports_as_saved
from tests.vlm_sweep import image_text_case, tiny_vlm_config

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def config():
    config = tiny_vlm_config("llama4")
    config.text_config.attention_chunk_size = 64  # longer than the packed row
    config.text_config.attn_temperature_tuning = False
    return config


def test_llama4_steps_as_transformers_with_the_tower_frozen_and_trained(tmp_path, config):
    outcome = image_text_case("llama4", tmp_path, config=config)
    assert outcome.status == "matched", outcome.reason


def test_the_wrapped_causal_lm_streams_its_decoder_body_and_its_head(config):
    spec = discover(config, freeze_vision_tower=False)
    vision = spec.vision
    assert (vision.outer is spec.skeleton, vision.causal_lm_path) == (True, "language_model")
    assert vision.forward_projectors == ["multi_modal_projector"]  # applied by the forward, not get_image_features
    head = {p.hf_name for p in spec.unit("head").params}
    assert head == {"language_model.model.norm.weight", "language_model.lm_head.weight"}
    named = sorted(p.hf_name for u in spec.units for p in u.params)
    assert named == sorted(AutoModelForImageTextToText.from_config(config).state_dict())


def test_a_checkpoint_loads_and_exports_tensor_for_tensor(tmp_path, config):
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(config).save_pretrained(tmp_path / "saved")
    assert_exports_as_saved(tmp_path / "saved", tmp_path / "exported")
