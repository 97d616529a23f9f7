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
VLM_VOCAB = 896  # the tiny tokenizer and the image tokens, rounded up


def qwen2_5_vl_config(tokenizer, **text) -> PretrainedConfig:
    """Two language layers and three vision blocks (one with full attention, two with 8x8-pixel windows)."""
    ids = dict(zip(QWEN_TOKENS, tokenizer.convert_tokens_to_ids(QWEN_TOKENS), strict=True))
    return AutoConfig.for_model(
        "qwen2_5_vl",
        text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VLM_VOCAB, initializer_range=0.2,
                         rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}, **text),
        vision_config=dict(depth=3, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           patch_size=4, spatial_merge_size=2, temporal_patch_size=2, window_size=8,
                           fullatt_block_indexes=[1], initializer_range=0.2),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )


def save_qwen2_5_vl(folder: Path, seed: int = 0, **text) -> Path:
    """A random tiny Qwen2.5-VL written by transformers, with its tokenizer and image processor."""
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = load_tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *QWEN_TOKENS]})
    torch.manual_seed(seed)
    AutoModelForImageTextToText.from_config(qwen2_5_vl_config(tokenizer, **text)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=8 * 8,
                             max_pixels=24 * 24).save_pretrained(folder)
    (Path(folder) / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2_5_VLProcessor"}))
    return Path(folder)


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
        tower = ".visual." in name and ".merger." not in name
        if (tower and freeze_tower) or (".merger." in name and freeze_projector):
            p.requires_grad_(False)
    return model
