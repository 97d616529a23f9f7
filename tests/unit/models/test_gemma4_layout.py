"""Gemma 4's image-text bodies as mt-ray finds and records them: the parts its parity checks
(tests/vlm_sweep.py, tests/unit/engine/test_vlm.py) rest on.

Gemma 4 has a vision tower, an audio tower beside it and embedders into the language model for both; Gemma 4
Unified has no tower at all, only an image embedder its `get_image_features` runs on the patches. Both let an
image's tokens attend to each other both ways in their sliding layers, marked in `mm_token_type_ids`.
"""

from __future__ import annotations

import torch
from torch import nn

from mt_ray.models.context import Documents, LayerContextBuilder, _EmbeddingFeed
from mt_ray.models.discovery import discover
from mt_ray.models.vision import VISION_EMBED, VISION_PROJECTOR
from tests.vlm_sweep import tiny_vlm_config


def _unit(spec, name):
    return next(u for u in spec.units if u.name == name)


def test_gemma4s_audio_tower_and_audio_embedder_are_held_untrained():
    """Only `get_audio_features` reads them: they load and export with the tower, and never train."""
    spec = discover(tiny_vlm_config("gemma4"), freeze_vision_tower=False)
    vision = spec.vision
    assert (vision.tower_path, vision.projector_paths, vision.held_paths) == (
        "vision_tower", ["embed_vision"], ["audio_tower", "embed_audio"])
    embed = _unit(spec, VISION_EMBED)
    held = [p for p in embed.params if p.local_name.startswith(("audio_tower.", "embed_audio."))]
    assert held and not any(p.trainable for p in held)
    assert all(p.trainable for p in embed.params if p.local_name.startswith("vision_tower.patch_embedder."))


def test_an_image_embedder_without_a_tower_is_the_projector():
    """Gemma 4 Unified's `embed_vision` maps patches into the language model's space with no blocks: it trains as
    the projector does, and nothing is left to freeze as a tower."""
    spec = discover(tiny_vlm_config("gemma4_unified"), freeze_vision_tower=False)
    vision = spec.vision
    assert (vision.tower_path, vision.blocks_path, len(vision.blocks)) == (None, None, 0)
    assert (vision.projector_paths, vision.held_paths) == (["embed_vision"], ["embed_audio"])
    assert _unit(spec, VISION_EMBED).frozen and not any(p.trainable for p in _unit(spec, VISION_EMBED).params)
    projector = _unit(spec, VISION_PROJECTOR)
    assert not projector.frozen and {p.local_name.split(".")[1] for p in projector.params} >= {
        "patch_dense", "pos_embedding", "multimodal_embedder"}
    assert not [u for u in spec.units if u.name.startswith("vision.blocks.")]
    assert _unit(discover(tiny_vlm_config("gemma4_unified"), freeze_multi_modal_projector=True), VISION_PROJECTOR).frozen


def _sliding_mask(model_type: str) -> torch.Tensor:
    """The [T, T] mask a Gemma 4 body gives its first (sliding) layer for one row: text, two image tokens, text."""
    spec = discover(tiny_vlm_config(model_type))
    builder = LayerContextBuilder(spec, torch.device("cpu"))
    image = spec.vision.image_token_id
    ids = torch.tensor([[5, image, image, 6]])
    embeds = torch.zeros(1, 4, spec.text_config.hidden_size)
    documents = Documents([(0, 4)], torch.tensor([0, 4], dtype=torch.int32), 4)
    _, ctx = builder(embeds, ids, torch.arange(4)[None], documents, embed_weights=builder.probe_weights)
    assert spec.text_config.layer_types[0] == "sliding_attention"
    mask = ctx.whole[0]["attention_mask"]
    return mask[0, 0] if mask.dtype == torch.bool else mask[0, 0] == 0


def test_an_images_tokens_are_marked_so_they_attend_to_each_other_both_ways():
    """The engine marks image tokens in `mm_token_type_ids`, as Gemma 4's processor does: the first image token
    sees the second, text before the image does not see it, text after sees all."""
    for model_type in ("gemma4", "gemma4_unified"):
        mask = _sliding_mask(model_type)
        assert mask[1, 2] and not mask[0, 1] and mask[3, :].all(), model_type


def test_the_embedding_stand_in_reads_the_engines_weight_while_recording():
    """Gemma 4's body reads its pad embedding off the embedding's weight: the engine's, not the skeleton's (meta)."""
    with torch.device("meta"):
        original = nn.Embedding(8, 4)
    feed = _EmbeddingFeed(original, "gemma4")
    assert feed.weight is original.weight
    feed.bound = torch.randn(8, 4)
    assert feed.weight is feed.bound
