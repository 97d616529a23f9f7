"""Tiny image-text models with their processors, saved as transformers saves them, and images made here.

Each family's folder holds what a hub checkpoint holds: config.json and safetensors written by
`save_pretrained`, the tokenizer (the tiny one plus the family's image tokens) and the processor's
files, so the engine, the data pipeline and transformers' reference all read the same folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import AutoConfig, AutoModelForImageTextToText, PretrainedConfig

from mt_ray.data import load_tiny_tokenizer
from mt_ray.data.mm_processor import load_processor

QWEN_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
# ChatML whose messages may also hold a list of parts, an image written as Qwen2.5-VL's template writes it.
QWEN_VL_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}{%- else %}{%- for part in message.content %}"
    "{%- if part.type == 'image' %}{{- '" + QWEN_IMAGE + "' }}{%- elif part.type == 'text' %}{{- part.text }}"
    "{%- endif %}{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
VLM_VOCAB = 896  # the tiny tokenizer and the image tokens, rounded up


# Two language layers and three vision blocks (one with full attention, two with 8x8-pixel windows).
QWEN2_5_VL = dict(
    processor="Qwen2_5_VLProcessor",
    text=dict(rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}),
    vision=dict(window_size=8, fullatt_block_indexes=[1]),
)
# Three language layers, the first two taking deepstack features from vision blocks 0 and 2 (each through
# its own merger); interleaved mrope over 12-dim heads; a 4x4 learned position grid, resampled per image.
QWEN3_VL = dict(
    processor="Qwen3VLProcessor",
    text=dict(num_hidden_layers=3, head_dim=12, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 2, 2], "mrope_interleaved": True}),
    vision=dict(num_position_embeddings=16, deepstack_visual_indexes=[0, 2]),
)
# Qwen3-VL whose language layers route each token to 2 of 4 experts.
QWEN3_VL_MOE = dict(QWEN3_VL, text=dict(QWEN3_VL["text"], num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16))
# Qwen3.5: a gated-delta linear-attention layer, then a full-attention one (so each document of a packed row runs
# through the layers alone, with its own images); interleaved mrope over half of 12-dim heads; no deepstack.
QWEN3_5 = dict(
    processor="Qwen3VLProcessor",
    text=dict(head_dim=12, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, rope_parameters={
                  "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "mrope_section": [1, 1, 1]}),
    vision=dict(num_position_embeddings=16),
)
QWEN_VL = {"qwen2_5_vl": QWEN2_5_VL, "qwen3_vl": QWEN3_VL, "qwen3_vl_moe": QWEN3_VL_MOE, "qwen3_5": QWEN3_5}


def qwen_vl_config(family: str, tokenizer, **text) -> PretrainedConfig:
    """A tiny Qwen-VL of `family` (see QWEN_VL): 32-wide language layers, three 16-wide vision blocks of 4x4 patches."""
    ids = dict(zip(QWEN_TOKENS, tokenizer.convert_tokens_to_ids(QWEN_TOKENS), strict=True))
    shape = QWEN_VL[family]
    return AutoConfig.for_model(
        family,
        text_config={**dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=VLM_VOCAB, initializer_range=0.2), **shape["text"], **text},
        vision_config=dict(depth=3, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           patch_size=4, spatial_merge_size=2, temporal_patch_size=2, initializer_range=0.2,
                           **shape["vision"]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )


def save_qwen_vl(folder: Path, family: str = "qwen2_5_vl", seed: int = 0, **text) -> Path:
    """A random tiny Qwen-VL written by transformers, with its tokenizer and image processor."""
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = load_tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *QWEN_TOKENS]})
    tokenizer.chat_template = QWEN_VL_TEMPLATE
    torch.manual_seed(seed)
    AutoModelForImageTextToText.from_config(qwen_vl_config(family, tokenizer, **text)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=8 * 8,
                             max_pixels=24 * 24).save_pretrained(folder)
    (Path(folder) / "processor_config.json").write_text(json.dumps({"processor_class": QWEN_VL[family]["processor"]}))
    return Path(folder)


GEMMA_IMAGE_TOKEN = 90


def save_gemma3(folder: Path, seed: int = 0, **vision) -> Path:
    """A random tiny Gemma 3 (SigLIP tower of 16x16-pixel images, 4 image tokens each; sliding and full
    attention layers) written by transformers. No processor: its documents are made by hand."""
    config = AutoConfig.for_model(
        "gemma3",
        text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, vocab_size=96, sliding_window=4, initializer_range=0.2,
                         layer_types=["sliding_attention", "full_attention"]),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                           image_size=16, patch_size=4, **vision),
        mm_tokens_per_image=4, image_token_id=GEMMA_IMAGE_TOKEN, boi_token_id=91, eoi_token_id=92, initializer_range=0.2)
    torch.manual_seed(seed)
    AutoModelForImageTextToText.from_config(config).save_pretrained(folder)
    return Path(folder)


def gemma3_document(text_tokens: int, images: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """[begin of image, its 4 tokens, end of image] per image, then text; what Gemma 3's processor returns
    (token_type_ids mark the image tokens, which attend to each other both ways)."""
    text = torch.randint(3, 89, (text_tokens,), generator=generator).tolist()
    ids = torch.tensor([[t for _ in range(images) for t in (91, *[GEMMA_IMAGE_TOKEN] * 4, 92)] + text])
    labels = ids.clone()
    labels[:, :6 * images + 2] = -100
    doc = {"input_ids": ids, "labels": labels, "token_type_ids": (ids == GEMMA_IMAGE_TOKEN).long()}
    if images:
        doc["pixel_values"] = torch.randn(images, 3, 16, 16, generator=generator)
    return doc


def save_llava(folder: Path, seed: int = 0) -> Path:
    """A random tiny LLaVA (CLIP tower of 16x16-pixel images, features of its second-to-last layer without
    the CLS token: 16 image tokens each; a Llama language model) written by transformers."""
    config = AutoConfig.for_model(
        "llava",
        text_config=dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=96, initializer_range=0.2),
        vision_config=dict(model_type="clip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                           num_attention_heads=2, image_size=16, patch_size=4, projection_dim=16),
        image_token_id=GEMMA_IMAGE_TOKEN, vision_feature_layer=-2, vision_feature_select_strategy="default",
        initializer_range=0.2)
    torch.manual_seed(seed)
    AutoModelForImageTextToText.from_config(config).save_pretrained(folder)
    return Path(folder)


def llava_document(text_tokens: int, images: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Each image's 16 tokens, then text (the prompt's first two text tokens carry no loss)."""
    text = torch.randint(3, 89, (text_tokens,), generator=generator).tolist()
    ids = torch.tensor([[GEMMA_IMAGE_TOKEN] * 16 * images + text])
    labels = ids.clone()
    labels[:, :16 * images + 2] = -100
    doc = {"input_ids": ids, "labels": labels}
    if images:
        doc["pixel_values"] = torch.randn(images, 3, 16, 16, generator=generator)
    return doc


def paligemma_processor():
    """PaliGemma's own processor around the tiny tokenizer (an existing special token as its bos) and SigLIP's image
    processor of 16x16-pixel pictures (16 image tokens each)."""
    from transformers import PaliGemmaProcessor
    from transformers.models.siglip import SiglipImageProcessorPil

    tokenizer = load_tiny_tokenizer()
    tokenizer.bos_token = "<|im_start|>"
    images = SiglipImageProcessorPil(size={"height": 16, "width": 16})
    images.image_seq_length = 16
    return PaliGemmaProcessor(image_processor=images, tokenizer=tokenizer)


def save_paligemma(folder: Path, processor, seed: int = 0) -> Path:
    """A random tiny PaliGemma (SigLIP tower of 16x16-pixel images, 16 image tokens each; a Gemma language model)
    written by transformers, its image token `processor`'s."""
    config = AutoConfig.for_model(
        "paligemma",
        text_config=dict(model_type="gemma", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=VLM_VOCAB,
                         initializer_range=0.2),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=2, image_size=16, patch_size=4),
        image_token_index=processor.image_token_id, vocab_size=VLM_VOCAB, projection_dim=32, hidden_size=32)
    torch.manual_seed(seed)
    AutoModelForImageTextToText.from_config(config).save_pretrained(folder)
    return Path(folder)


def paligemma_document(processor, prompt: str, suffix: str, images: list[Image.Image]) -> dict[str, torch.Tensor]:
    """One document as PaliGemma's processor writes it for training: its images' tokens, bos, the prompt and a
    newline (token type 0, labels -100), then the suffix and eos (token type 1, labelled). The processor takes no
    document without images: one is tokenized as it tokenizes the text of one (a text pair), labelled alike."""
    if images:
        text = "<image>" * len(images) + prompt
        return dict(processor(text=[text], images=[images], suffix=[suffix], return_tensors="pt"))
    tokenizer = processor.tokenizer
    out = dict(tokenizer([tokenizer.bos_token + prompt + "\n"], text_pair=[suffix + tokenizer.eos_token],
                         return_token_type_ids=True, return_tensors="pt"))
    return out | {"labels": out["input_ids"].masked_fill(out["token_type_ids"] == 0, -100)}


def make_image(seed: int, height: int = 16, width: int = 24) -> Image.Image:
    """A random RGB picture (its sizes are multiples of 8, so it keeps its size in the tiny processor)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def image_document(folder: Path, text: str, images: list[Image.Image], prompt_words: int) -> dict[str, torch.Tensor]:
    """One document through the folder's own processor: `text` with the family's image placeholders,
    labels masked over the first `prompt_words` pieces and every image token."""
    processor = load_processor(folder)
    out = processor(text=[text], images=images or None, return_tensors="pt")
    ids = out["input_ids"]
    labels = ids.clone()
    labels[:, :prompt_words] = -100
    labels[ids == processor.image_token_id] = -100
    return {**out, "labels": labels}


def reference_model(folder: Path, freeze_tower: bool = True, freeze_projector: bool = False) -> torch.nn.Module:
    """transformers' own model from `folder` (eager attention), frozen as LLaMA-Factory freezes it."""
    model = AutoModelForImageTextToText.from_pretrained(folder, attn_implementation="eager").float()
    for name, p in model.named_parameters():
        tower = (".visual." in name and ".merger." not in name) or ".vision_tower." in name
        projector = ".merger." in name or ".multi_modal_projector." in name
        if (tower and freeze_tower) or (projector and freeze_projector):
            p.requires_grad_(False)
    return model


def qwen_example(folder: Path, text: str, images: list[Image.Image], prompt_words: int = 3):
    """A Qwen-VL document as the data pipeline holds it (a `TokenizedExample`, each image's own tensors), ready
    for `mt_ray.data.packing.collate`."""
    from mt_ray.data.schema import TokenizedExample

    doc = image_document(folder, text, images, prompt_words)
    pixels = doc["pixel_values"].split(doc["image_grid_thw"].prod(-1).tolist()) if images else []
    per_image = tuple({"pixel_values": p, "image_grid_thw": doc["image_grid_thw"][k:k + 1]} for k, p in enumerate(pixels))
    return TokenizedExample(tuple(doc["input_ids"][0].tolist()), (-100, *doc["labels"][0, 1:].tolist()), per_image)
