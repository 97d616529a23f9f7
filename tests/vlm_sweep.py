"""Every model type of transformers' image-text mapping, built tiny and trained one step with images: its outcome.

`tiny_vlm_config` scales the family's own default config down (its text and vision sub-configs as the causal-LM
sweep scales a text config; each special token its own id above the documents' ids). `image_text_case` saves it
with `save_pretrained`, makes three documents (one image, none, two images), each image's inputs the tower takes
(`image_inputs`: pictures, flattened patches with their grid, tiles; with their sizes where the family asks) and
as many image tokens as `get_image_features` returns features for it, packs them into one row and trains one
step, with the tower frozen (the projector trained) and with everything trained, against transformers' eager
model trained on each document alone, frozen alike.
"""

from __future__ import annotations

import copy
import inspect
import tempfile
from collections.abc import Container
from pathlib import Path

import torch
from accelerate import init_empty_weights
from transformers import AutoConfig, AutoModelForImageTextToText, Ernie4_5_VLMoeProcessor, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from mt_ray.engine import EngineConfig, StreamingEngine
from mt_ray.errors import ConfigError, ModelNotSupportedError
from mt_ray.models.discovery import discover
from mt_ray.models.vision_context import image_features_of
from tests.family_checks import OPT
from tests.family_sweep import (
    _COMPASS_ROPE,
    _QWEN4_EXP,
    ALONE,
    FAMILY_OVERRIDES,
    GEMMA4_VISION,
    SWEEP_VOCAB,
    Outcome,
    _difference,
    _scaled,
    _short,
    _trace,
)
from tests.tiny_models import reference_train

IMAGE_TEXT = "image-text"
MAX_PARAMS = 4_000_000  # a tiny model builds and trains in a second

# A vision tower scaled down (where its config has the field): 16x16-pixel pictures of 4x4 patches.
_VISION_SIZES: dict[str, object] = dict(
    image_size=16, patch_size=4, depth=2, embed_dim=16, num_heads=2, out_hidden_size=32, num_channels=3, hidden_size=16,
    intermediate_size=32, num_attention_heads=2, head_dim=8, num_key_value_heads=2,
)
_SPECIAL = ("pad_token_id", "bos_token_id", "eos_token_id")
_IMAGE_TOKEN = ("image_token_id", "image_token_index")
_VISION_START = SWEEP_VOCAB - 16  # below the ids `tiny_vlm_config` gives the default's special tokens

# Per family: what its tiny model needs beyond the scaled sizes (each line says why).
VLM_OVERRIDES: dict[str, dict] = {
    "gemma3": {"mm_tokens_per_image": 4},  # 2x2 pooled tokens of the 4x4 patches (256 of 64x64 in the default)
    "shieldgemma2": {"mm_tokens_per_image": 4},
    "paligemma": {"projection_dim": 32},  # its projector's width is the language model's (2048 in the default)
    # its tower's output width is the language model's; its rotary sections default to [16, 24, 24] (128-wide heads)
    "qwen2_vl": {"vision_config": {"hidden_size": 32}, "text_config": {"rope_parameters": {
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}}},
    "internvl": {"vision_config": {"image_size": [16, 16], "patch_size": [4, 4]}},  # (height, width) pairs
    "qianfan_ocr": {"vision_config": {"image_size": [16, 16], "patch_size": [4, 4]}},
    "paddleocr_vl": {"text_config": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                         "mrope_section": [2, 1, 1]}}},  # [16, 24, 24] where none
    "qwen2_5_vl": {"text_config": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                       "mrope_section": [2, 1, 1]}}},
    # deepstack features from two of three blocks (the default's indexes lie past a tiny tower)
    **{f: {"vision_config": {"depth": 3, "deepstack_visual_indexes": [0, 2]}}
       for f in ("qwen3_vl", "qwen3_vl_moe", "cosmos3_omni")},
    "vipllava": {"vision_feature_layers": [-2, -1]},
    # the released thinker configs name the vision-start token their get_rope_index finds each image by (the
    # default config does not, so transformers' own rotary positions fail); an id no other special token takes
    "qwen2_5_omni_thinker": {"vision_start_token_id": _VISION_START, "text_config": {"rope_parameters": {
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}}},  # [16, 24, 24] where none
    # four blocks, where three would be as many as the modules of each merger's MLP list (two deepstack mergers); its
    # audio tower's convolutions narrowed (480 channels) and its output as wide as the language model (3584)
    "qwen3_omni_moe_thinker": {"vision_start_token_id": _VISION_START,
                               "vision_config": {"depth": 4, "deepstack_visual_indexes": [0, 2]},
                               "audio_config": {"downsample_hidden_size": 16, "output_dim": 32}},
    # a picture no larger than 16x16 (its position table covers 2048x2048 pixels); four XD-RoPE axes over the 8-wide
    # heads' rotary halves (the default names none, so transformers' own rotary table fails)
    "hunyuan_vl": {"vision_config": {"max_image_size": 16}, "text_config": {"rope_parameters": {
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 1, 1]}}},
    "deepseek_ocr2": {"text_config": {"mlp_layer_types": ["dense", "sparse"]}},  # derived, and lost on reload
    # its body always builds a sliding-window mask (no window in the default, so transformers' own model fails); a
    # sliding layer of its own head count and a full one, a dense MLP then experts, as the released checkpoint; its
    # tower's MLP width is derived from `mlp_ratio` on reload
    "step3p7": {"vision_config": {"mlp_ratio": 2.0}, "text_config": {
        "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"], "mlp_layer_types": ["dense", "sparse"],
        "num_sliding_attention_heads": 2, "per_layer_config": {0: {"num_attention_heads": 2}},
        "rope_parameters": {t: {"rope_type": "default", "rope_theta": 10000.0}
                            for t in ("sliding_attention", "full_attention")}}},
    # their language models' own needs, as the causal-LM sweep gives them
    **{f: {"text_config": FAMILY_OVERRIDES[f"{f}_text"]} for f in ("cohere_compass", "qwen4_exp")},
    "lfm2_vl": {"text_config": FAMILY_OVERRIDES["lfm2"]},
    "glm5_next": {"text_config": {"qk_rope_head_dim": 0, "qk_head_dim": 8}},  # its DSA layers are NoPE (0 rotary)
    # rotary halves of 8-wide heads over (h, w, t) where the config names none ([22, 22, 20] of 128)
    "ernie4_5_vl_moe": {"text_config": {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0,
                                                            "mrope_section": [1, 1, 2]}}},
    # its released language model (the default's Llama lacks the multipliers its body reads); one deepstack feature
    # (the last vision layer into the first language layer), the spatial offset groups into the two language
    # layers, 1/2-windowed Q-Former queries as wide as the tower, SigLIP's every patch (no CLS token to drop), one 16x16 resolution
    "granite4_vision": {"text_config": {"model_type": "granite"}, "deepstack_layer_map": [[-1, 0]],
                        "spatial_target_layers": [0, 1, 0, 1], "downsample_rate": "1/2",
                        "vision_feature_select_strategy": "full", "image_grid_pinpoints": [[16, 16]],
                        "projector_dropout": 0.0, "qformer_config": {"hidden_size": 16, "encoder_hidden_size": 16}},
    **{f: {"vocabulary_map": {"<image>": SWEEP_VOCAB - 1}} for f in ("chameleon", "emu3")},  # None in the default
    # its pixel shuffle (ratio 1/2) widens each token fourfold into its adapter's MLP, whose width the projector reads
    # (4096 and 7680 in the default)
    "llama4": {"vision_config": {"intermediate_size": 64, "projector_input_dim": 32, "projector_output_dim": 32,
                                 "vision_output_dim": 32}},
    "kimi_k25": {"projection_hidden_size": 16},  # the projector's norm takes the tower's width (1152 by default)
    "aria": {"projector_patch_to_query_dict": {16: 4}},  # 4 queries for the 16 patches of a picture  # the default reads five layers of a deeper tower
    # one resolution of 16x16 tiles: each image is its 16x16 overview and one tile
    "llava_next": {"image_grid_pinpoints": [[16, 16]]},
    "llava_next_video": {"image_grid_pinpoints": [[16, 16]]},
    "llava_onevision": {"image_grid_pinpoints": [[16, 16]]},
    # GLM-4V's rotary sections default to [8, 12, 12] (of 128-wide heads) where the config names none
    **{f: {"text_config": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                               "mrope_section": [2, 1, 1]}, "head_dim": 16}}
       for f in ("glm4v", "glm46v", "glm4v_moe", "glm_ocr", "glmga")},
    "qwen4_exp": {"text_config": _QWEN4_EXP},  # its layers are built with the indexer the default leaves None
    # a sliding layer with rotary positions and a NoPE global layer, as the released checkpoint has
    "cohere_compass": {"text_config": {"layer_types": ["sliding_attention", "full_attention"],
                                       "rope_parameters": _COMPASS_ROPE}},
    # its layers always hold experts (None in the default); its model always builds the tower the default leaves None
    "diffusion_gemma": {"text_config": {"num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 16},
                        "vision_config": {**GEMMA4_VISION, "pooling_kernel_size": 3}},
    # the causal-LM sweep's tower, its image tokens attending to each other both ways (as the larger released
    # checkpoints' do), and an audio tower (None in the default too) that image-text training leaves untrained
    "gemma4": {"text_config": {**FAMILY_OVERRIDES["gemma4"]["text_config"], "use_bidirectional_attention": "vision"},
               "vision_config": GEMMA4_VISION,
               "audio_config": {"model_type": "gemma4_audio", "subsampling_conv_channels": [8, 4],
                                "output_proj_dims": 32}},
    # the causal-LM sweep's image embedder, and an audio embedder of 8-sample frames (None in the default too)
    "gemma4_unified": {**FAMILY_OVERRIDES["gemma4_unified"],
                       "audio_config": {"model_type": "gemma4_unified_audio", "audio_embed_dim": 8}},
}

Images = dict[str, torch.Tensor]
# Families whose processor marks token_type_ids 0 over each document's prefix (image, bos, prompt) and 1 over the suffix
# it labels (PaliGemma's tokenizes the two as a text pair); others' mark the image tokens 1.
PREFIX_TYPES = ("paligemma",)


class _NotReloaded(Exception):  # noqa: N818 - an outcome, not an error of the sweep
    """transformers' own `from_pretrained` does not load back what its `save_pretrained` wrote: no reference."""
_SEPARATOR = 3  # a text token after each image's tokens


def tiny_vlm_config(model_type: str) -> PretrainedConfig:
    """`model_type`'s default config, each sub-config scaled down and each special token given its own id."""
    cls = CONFIG_MAPPING[model_type]
    default = cls()
    kw: dict[str, object] = {}
    for key in getattr(default, "sub_configs", None) or {}:
        sub = getattr(default, key, None)
        if isinstance(sub, PretrainedConfig):
            kw[key] = _scaled_sub(sub, vision="vision" in key)
    tokens = [k for k, v in default.to_dict().items() if k.endswith(("_token_id", "_token_index")) and k not in _SPECIAL
              and (isinstance(v, int) or k in _IMAGE_TOKEN)]  # the image token even where it defaults to None
    kw.update({k: SWEEP_VOCAB - 1 - i for i, k in enumerate(tokens)})
    for key, value in VLM_OVERRIDES.get(model_type, {}).items():
        sub = kw.get(key)
        if isinstance(value, dict) and "model_type" in value:  # a sub-config of another class than the default's
            sub = kw[key] = _scaled_sub(CONFIG_MAPPING[value["model_type"]](), vision="vision" in key)
        if isinstance(value, dict) and isinstance(sub, PretrainedConfig):
            for k, v in value.items():
                if k != "model_type":
                    setattr(sub, k, v)
        else:
            kw[key] = value
    kw = {k: _derived_again(v) if isinstance(v, PretrainedConfig) else v for k, v in kw.items()}
    return cls(**kw)


def _derived_again(config: PretrainedConfig) -> PretrainedConfig:
    """`config` built anew from its fields where its constructor derives a per-layer table from them (Gemma 4's
    `per_layer_config`, by layer index from the layer types): the scaled copy still holds the default's."""
    fields = config.to_dict()
    if fields.pop("per_layer_config", None) is None:
        return config
    return type(config)(**fields)


def _scaled_sub(config: PretrainedConfig, vision: bool) -> PretrainedConfig:
    scaled = copy.deepcopy(config)
    sizes = {**_scaled(config), **({k: v for k, v in _VISION_SIZES.items() if hasattr(config, k)} if vision else {})}
    for k, v in sizes.items():
        default = getattr(config, k, None)
        if isinstance(default, (list, tuple)) and isinstance(v, int):  # one per kind (ERNIE's text, vision experts)
            v = type(default)([v] * len(default))
        setattr(scaled, k, v)
    layers, scaled_layers = getattr(config, "num_hidden_layers", None), getattr(scaled, "num_hidden_layers", None)
    for k, v in vars(config).items():  # per-layer lists (`mlp_layer_types`) cut to the scaled layers
        if isinstance(v, list) and layers and len(v) == layers != scaled_layers and k not in sizes:
            setattr(scaled, k, v[:scaled_layers])
    for key in getattr(config, "sub_configs", None) or {}:  # nested (T5Gemma 2's encoder holds text and vision)
        sub = getattr(config, key, None)
        if isinstance(sub, PretrainedConfig):
            setattr(scaled, key, _scaled_sub(sub, vision="vision" in key))
    rope = getattr(scaled, "rope_parameters", None)
    if isinstance(rope, dict) and "mrope_section" in rope:  # the rotary width over (t, h, w), scaled as the head
        width = sum(rope["mrope_section"]) * _head_dim(scaled) // _head_dim(config)
        scaled.rope_parameters = {**rope, "mrope_section": [width - 2 * (width // 4), width // 4, width // 4]}
    return scaled


def _head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _candidates(config: PretrainedConfig, takes: Container[str], g: torch.Generator, side: int) -> list[Images]:
    """One image's inputs in each layout transformers' towers take (`takes`: what `get_image_features` names), for
    it to pick from; each with the sizes its image processor returns beside the pixels."""
    v = config.vision_config
    size = getattr(v, "image_size", 16)
    size = size[0] if isinstance(size, (list, tuple)) else size
    channels = getattr(v, "num_channels", 3) or 3
    patch = getattr(v, "patch_size", 4)
    patch = patch[0] if isinstance(patch, (list, tuple)) else patch
    temporal = getattr(v, "temporal_patch_size", None) or 1
    n, grid_hw = (side // patch) ** 2, torch.tensor([[side // patch, side // patch]])
    out: list[Images] = []
    if "image_grid_thw" in takes:  # patches with their (t, h, w) grid: flattened (Qwen-VL) or as small pictures
        grid = torch.tensor([[1, side // patch, side // patch]])
        merge = {"image_merge_sizes": torch.tensor([1])} if "image_merge_sizes" in takes else {}  # VideoLLaMA3's images
        out += [{"pixel_values": torch.randn(n, *shape, generator=g), "image_grid_thw": grid, **merge}
                for shape in ((channels * temporal * patch * patch,), (channels, patch, patch))]
    if "spatial_shapes" in takes:  # NaFlex (LFM2-VL): a row of flattened patches, their grid, which of them are real
        out.append({"pixel_values": torch.randn(1, n, channels * patch * patch, generator=g), "spatial_shapes": grid_hw,
                    "pixel_attention_mask": torch.ones(1, n, dtype=torch.long)})
    if "image_position_ids" in takes:  # Gemma 4: a row of flattened patches, their (x, y), padded as its processor pads
        out.append(_positioned_patches(v, side, channels, g))
    picture = torch.randn(1, channels, size, size, generator=g)
    sizes = torch.tensor([[size, size]])
    if "target_sizes" in takes:  # MiniCPM-V 4.6: the picture's patch grid
        out.append({"pixel_values": picture, "target_sizes": torch.tensor([[size // patch, size // patch]])})
    if "pixel_mask" in takes:  # Aria: which pixels are the picture's (all: it fills its square)
        out.append({"pixel_values": picture, "pixel_mask": torch.ones(1, size, size, dtype=torch.bool)})
    out += [{"pixel_values": picture}, {"pixel_values": picture, "image_sizes": sizes},
            {"pixel_values": picture[:, None]},  # one tile of one image (Idefics)
            {"pixel_values": picture[None].expand(1, 2, -1, -1, -1).clone(), "image_sizes": sizes},  # LLaVA-NeXT
            # Inkling: channels-last (t, p, p) patches, one token each
            {"pixel_values": torch.randn(n, temporal, patch, patch, channels, generator=g)}]
    return out


def _positioned_patches(v: PretrainedConfig, side: int, channels: int, g: torch.Generator) -> Images:
    """One picture as Gemma 4's processor gives it: its patches (of the merged size where the family merges them
    before its embedding) in rows, each one's (x, y), and a pooled token's worth of padding patches at (-1, -1)."""
    patch = getattr(v, "model_patch_size", v.patch_size)
    n, pad = (side // patch) ** 2, getattr(v, "pooling_kernel_size", 1) ** 2
    xy = torch.stack(torch.meshgrid(torch.arange(side // patch), torch.arange(side // patch), indexing="xy"), -1)
    positions = torch.cat([xy.reshape(n, 2), torch.full((pad, 2), -1)])
    patches = torch.cat([torch.randn(n, channels * patch * patch, generator=g), torch.zeros(pad, channels * patch * patch)])
    return {"pixel_values": patches[None], "image_position_ids": positions[None]}


def image_inputs(model: torch.nn.Module, g: torch.Generator, side: int = 16) -> tuple[Images, int]:
    """One image's inputs the family's `get_image_features` takes, and how many image tokens it fills."""
    hidden = model.config.get_text_config().hidden_size
    errors = []
    body = model.base_model  # the composite body (Llama 4's is the model itself)
    takes = inspect.signature(body.get_image_features).parameters
    for inputs in _candidates(model.config, takes, g, side):
        try:
            with torch.no_grad():
                out = image_features_of(body)(**inputs)
        except Exception as e:  # noqa: BLE001 - a layout this tower does not take
            errors.append(_short(e))
            continue
        features = getattr(out, "pooler_output", out)
        if features is None and getattr(out, "deepstack_features", None) is not None:
            features = out.deepstack_features[0][1]  # every feature enters a later layer (Granite 4 Vision)
        elif features is None:  # the forward projects each row itself (Llama 4): a token per row
            return inputs, out.last_hidden_state[..., 0].numel()
        features = features if isinstance(features, (list, tuple)) else [features]
        return inputs, sum(f.numel() for f in features) // hidden
    raise ValueError(f"no image layout fits its get_image_features: {errors}")


def vlm_documents(model: torch.nn.Module, seed: int = 0) -> list[dict]:
    """One image, then text only, then two images: each image's tokens, opened by the vision-start token where the
    config names one (as Qwen-VL's processors write `<|vision_start|>`) and closed by a separator, then text; the
    images and the first two text tokens carry no loss."""
    g = torch.Generator().manual_seed(seed)
    token = model.config.image_token_id if hasattr(model.config, "image_token_id") else model.config.image_token_index
    start = [s] if (s := getattr(model.config, "vision_start_token_id", None)) is not None else []
    docs = []
    for images, text in ((1, 7), (0, 6), (2, 5)):
        made = [image_inputs(model, g) for _ in range(images)]
        ids = [t for _, n in made for t in start + [token] * n + [_SEPARATOR]]
        ids += torch.randint(3, 96, (text,), generator=g).tolist()
        labels = [-100] * (len(ids) - text + 2) + ids[len(ids) - text + 2:]
        docs.append({"input_ids": torch.tensor([ids]), "labels": torch.tensor([labels]),
                     "images": [inputs for inputs, _ in made]})
    return docs


def packed(docs: list[dict]) -> dict:
    """The documents in one row, positions restarting at each; each image's own tensors, in order."""
    return {"input_ids": torch.cat([d["input_ids"] for d in docs], 1),
            "labels": torch.cat([d["labels"] for d in docs], 1),
            "position_ids": torch.cat([torch.arange(d["input_ids"].shape[1]) for d in docs])[None],
            "images": [[image for d in docs for image in d["images"]]]}


def alone(doc: dict, model: torch.nn.Module, image_token: int) -> dict:
    """One document as transformers' `model` takes it: its images' tensors joined, token types where it reads them
    as its processor marks them (the image tokens; PaliGemma's prefix, before the first labelled token; ERNIE-VL's
    MoE types, by its processor's own code), and the attention mask a processor returns (the Omni thinkers number
    rotary positions only with one)."""
    out = {"input_ids": doc["input_ids"], "labels": doc["labels"], "attention_mask": torch.ones_like(doc["input_ids"])}
    if doc["images"]:
        out |= {k: torch.cat([image[k] for image in doc["images"]]) for k in doc["images"][0]}
    takes = inspect.signature(model.forward).parameters
    is_image = (doc["input_ids"] == image_token).long()
    if "mm_token_type_ids" in takes:
        out["mm_token_type_ids"] = is_image.int()
    if "token_type_ids" in takes:
        prefix = model.config.model_type in PREFIX_TYPES
        out["token_type_ids"] = (doc["labels"] != -100).long().cummax(1).values if prefix else is_image
    if "moe_mm_token_type_ids" in takes:
        out["moe_mm_token_type_ids"] = Ernie4_5_VLMoeProcessor.create_moe_mm_token_type_ids(
            model.config, doc["input_ids"])  # the config names the token ids the processor reads off its tokenizer
    return out


def _step(folder: Path, model_type: str, docs: list[dict], freeze: tuple[bool, bool], device: str = "cpu",
          tolerances: dict | None = None, **engine_kw) -> tuple[str | None, bool]:
    """One engine step on `device` and one reference step on the CPU, frozen alike: None where they agree, else the
    difference; and whether the engine ran each document alone."""
    spec = discover(str(folder), freeze_vision_tower=freeze[0], freeze_multi_modal_projector=freeze[1])
    frozen = {p.hf_name for u in spec.units if u.frozen for p in u.params}
    engine = StreamingEngine(spec, EngineConfig(device=device, **engine_kw), OPT, total_steps=1)
    try:
        _check_reloads(folder)  # after the engine's own refusals
        engine.load_pretrained(folder)
        before = {k: v.clone() for k, v in engine.state_dict().items()}
        loss = engine.train_step([packed(docs)]).loss.item()
        state = {k: v.clone() for k, v in engine.state_dict().items()}
    finally:
        engine.close()
    ref = AutoModelForImageTextToText.from_pretrained(folder, attn_implementation="eager").float()
    for name, p in ref.named_parameters():
        p.requires_grad_(p.requires_grad and name not in frozen)
    token = spec.vision.image_token_id
    [ref_loss] = reference_train(ref, [[alone(d, ref, token) for d in docs]], OPT)
    return (_difference(state, before, ref.state_dict(), loss, ref_loss, **(tolerances or {})),
            engine.context.isolate_documents)


def _check_reloads(folder: Path) -> None:
    """Raises `_NotReloaded` where transformers leaves out of its model what its `save_pretrained` wrote to `folder`
    (ShieldGemma 2's conversion mapping, written for its classifier, nests the language model a level deeper on save)."""
    try:
        _, info = AutoModelForImageTextToText.from_pretrained(folder, output_loading_info=True)
    except Exception as e:  # noqa: BLE001 - anything transformers raises loading its own checkpoint
        raise _NotReloaded(f"transformers does not load back what it saved: {_short(e)}") from None
    missing, unexpected = sorted(info["missing_keys"]), sorted(info["unexpected_keys"])
    if missing or unexpected:
        raise _NotReloaded(f"transformers does not load back what it saved: {len(missing)} tensors missing "
                           f"({', '.join(missing[:2])}), {len(unexpected)} unexpected")


def image_text_case(model_type: str, folder: Path, device: str = "cpu", tolerances: dict | None = None,
                    config: PretrainedConfig | None = None, **engine_kw) -> Outcome:
    """Build, save, train (tower frozen, then everything trained) and compare one image-text model type (`config`,
    else `tiny_vlm_config`'s); the engine on `device` with `engine_kw` (tests/gpu/test_families_cuda.py's),
    `tolerances` as `_difference`'s."""
    try:
        config = config or tiny_vlm_config(model_type)
    except Exception as e:  # noqa: BLE001 - anything transformers raises building its own config
        return Outcome(model_type, "skipped", f"transformers cannot build its config tiny: {_short(e)}")
    try:
        with init_empty_weights():
            AutoModelForImageTextToText.from_config(config)
    except Exception as e:  # noqa: BLE001 - anything transformers raises building its own model
        return Outcome(model_type, "skipped", f"transformers cannot build it tiny: {_short(e)}")
    try:
        spec = discover(config)
    except (ModelNotSupportedError, ConfigError) as e:
        if f"'{model_type}'" not in str(e) and f"'{config.model_type}'" not in str(e):
            return Outcome(model_type, "error", f"refused without naming the model type: {e}")
        return Outcome(model_type, "refused", str(e))
    except Exception as e:  # noqa: BLE001
        return Outcome(model_type, "error", _trace(e))
    if spec.num_params > MAX_PARAMS:
        return Outcome(model_type, "error", f"{spec.num_params} parameters: a sub-config is not scaled down")
    try:
        torch.manual_seed(0)
        model = AutoModelForImageTextToText.from_config(config)
        model.save_pretrained(folder)
        AutoConfig.from_pretrained(folder)  # transformers reads back the config it wrote
    except Exception as e:  # noqa: BLE001 - anything transformers raises building its own model
        return Outcome(model_type, "skipped", f"transformers cannot build it tiny: {_short(e)}")
    try:
        docs = vlm_documents(model)
    except ValueError as e:
        return Outcome(model_type, "error", f"no images made for it: {e}")
    for freeze in ((True, False), (False, False)):
        try:
            problem, alone = _step(folder, model_type, docs, freeze, device, tolerances, **engine_kw)
        except _NotReloaded as e:
            return Outcome(model_type, "skipped", str(e))
        except ModelNotSupportedError as e:
            if f"'{model_type}'" in str(e) or f"'{config.model_type}'" in str(e):
                return Outcome(model_type, "refused", str(e))  # by the engine, before any state is built
            return Outcome(model_type, "error", _trace(e))
        except Exception as e:  # noqa: BLE001
            return Outcome(model_type, "error", _trace(e))
        if problem is not None:
            return Outcome(model_type, "mismatch", f"tower {'frozen' if freeze[0] else 'trained'}: {problem}")
    return Outcome(model_type, "matched", ALONE if alone else "")


def image_text_outcome(model_type: str) -> Outcome:
    with tempfile.TemporaryDirectory() as folder:
        return image_text_case(model_type, Path(folder))
