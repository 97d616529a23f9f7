"""Find the vision side of an image-text model by structure: its tower, the tower's blocks, the projector.

An image-text model in transformers is a composite body (`Qwen2_5_VLModel`, `LlavaModel`, ...) that
owns a vision tower (a PreTrainedModel built from `config.vision_config`), a projector into the
language model's space and the language model itself; its forward embeds the tokens, asks its own
`get_image_features` for the image features and scatters them over the image placeholder tokens.

The split follows LLaMA-Factory, whose freeze options mt-ray takes over: the *tower* (patch
embedding, blocks, norms) is frozen by `freeze_vision_tower`, the *projector* by
`freeze_multi_modal_projector`. The projector is every parameterised child of the composite body
beside the tower and the language model (`multi_modal_projector`), and the tower's own `merger`
where the family keeps its projector inside the tower (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: LLaMA-Factory's
`visual.merger`; HunYuan-VL's `patch_merger`); Qwen3-VL's deepstack mergers stay with the tower, as LLaMA-Factory keeps them. Tensors the
composite body holds itself (LLaVA-NeXT's `image_newline`, appended to each image's projected rows) are the
projector's too.

Llama 4's composite body is the whole model: its language model is a causal LM with its own head
(`Llama4ForCausalLM`), which the body's forward calls on the merged embeddings. The decoder body inside it
streams as any other, its final norm and LM head are the head unit, and the head runs that causal LM's forward
(`VisionSpec.causal_lm_path`). Its forward also applies the projector itself, to what `get_image_features`
returns: such a projector runs there, with the projector unit's weights handed over with the image features
(`VisionSpec.forward_projectors`).

Gemma 4 Unified has no tower: its `get_image_features` runs each picture's patches through an embedder beside the
language model (norms, a projection, positions, a projection into the language model's width), with no blocks.
Such an encoder-free embedder is the projector (`VisionSpec.tower_path` is None): it maps the patches into the
language model's space, and trains unless `freeze_multi_modal_projector` says otherwise.

The Omni thinkers (Qwen2.5-Omni's, Qwen3-Omni's) are composite bodies that hold the LM head themselves
(`VisionSpec.holds_head`) and an audio tower beside the vision tower: image-text training gives no audio, so the
audio tower is held, loaded and exported untrained (`VisionSpec.held_paths`), as transformers leaves it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from mt_ray.errors import ModelNotSupportedError
from mt_ray.models.body_source import applied_beside, reached_by, read_apart

VISION_PREFIX = "vision."  # every vision unit's name starts so
VISION_EMBED = f"{VISION_PREFIX}embed"
VISION_PROJECTOR = f"{VISION_PREFIX}projector"
VISION_BLOCK_PREFIX = f"{VISION_PREFIX}blocks."

# Image-text families that follow the common layout but that no parity check covers yet, each with what stands in
# the way (tests/vlm_sweep.py checks every other one against transformers, tower frozen and trained).
NOT_YET: dict[str, str] = {
    "cosmos3_edge": "its language model takes three rows of rotary positions and builds its mask from the first "
                    "(temporal) row: a packed row's text positions have no row of their own, so its documents would "
                    "not be kept apart",
    "deepseek_vl_hybrid": "a second, high-resolution SAM tower runs beside its SigLIP tower",
    "janus": "a VQ image generator sits beside its understanding tower",
    "minicpmv4_6": "its processor joins several images into one row of patches (pixel_values [1, channels, patch, "
                   "every image's patches]), where mt-ray joins images along the first axis",
    "minimax_m3_vl": "its tower attends across every image of a call (one sequence, no per-image mask), so a packed "
                     "row's images would see other documents' images (mt-ray runs the tower once per micro-batch)",
    "muse_glimmer": "its tower has not been checked against transformers",
}

# Per-token types the engine fills itself. Image tokens marked 1, as the processors mark them (`_IMAGE_MARKS`):
# Gemma 3 (`token_type_ids`) and Gemma 4 (`mm_token_type_ids`) let an image's tokens attend to each other both ways,
# PaliGemma reads `token_type_ids` 0 as its prefix (`DocumentImages.token_types`), and Qwen-VL numbers rotary positions
# from `mm_token_type_ids`, which the engine does itself (`rope_index`). ERNIE-VL's `moe_mm_token_type_ids`
# (`moe_token_types`).
_IMAGE_MARKS = ("token_type_ids", "mm_token_type_ids")
_CARRIED_TOKEN_TYPES = (*_IMAGE_MARKS, "moe_mm_token_type_ids")
# The tokens ERNIE-VL's processor marks in `moe_mm_token_type_ids`, by type (1: an image's, 2: a video's): each
# image's (video's) tokens, its start and its end; the image's must be named.
_MOE_TYPE_TOKENS = {1: ("image_token_id", "image_start_token_id", "image_end_token_id"),
                    2: ("video_token_id", "video_start_token_id", "video_end_token_id")}

# A tower child that is the family's projector although the tower owns it (LLaMA-Factory's projector_key).
_PROJECTOR_IN_TOWER = ("merger", "patch_merger")


@dataclass
class VisionSpec:
    """Where the vision parts sit, relative to the composite body `outer` (the skeleton's base model)."""

    outer: nn.Module
    outer_path: str
    tower_path: str | None
    """None where the body has no tower (an encoder-free embedder, Gemma 4 Unified's: the projector, no blocks)."""
    blocks_path: str | None
    projector_paths: list[str]
    image_token_id: int
    rope_rows: int
    """The rows of multi-dimensional rotary positions the body's `get_rope_index` numbers (Qwen-VL's temporal, height
    and width; HunYuan-VL's four XD-RoPE axes); 0 for a body without. The body takes them after a row of text
    positions where it reads one (they keep packed documents apart: `LayerContextBuilder.rope_axes`)."""
    block_kinds: dict[str, nn.Module] = field(default_factory=dict)
    own_tensors: list[str] = field(default_factory=list)
    """Parameters and saved buffers of the composite body itself (not of a child): they join the projector."""
    causal_lm_path: str | None = None
    """The composite body's child that is a whole causal LM around the decoder body (Llama 4's `language_model`,
    with its own head): its forward is what the head runs; "" where the composite body holds the LM head itself (the
    Omni thinkers). None where the head lies outside the composite body."""
    held_paths: list[str] = field(default_factory=list)
    """Towers of another modality beside the vision tower and their embedders, which only that modality's inputs
    reach (the Omni thinkers' audio tower, Gemma 4's audio tower and `embed_audio`, read by `get_audio_features`
    alone): their tensors load and export with `vision.embed`, untrained, as transformers leaves them when no audio
    is given."""
    forward_projectors: list[str] = field(default_factory=list)
    """Projector children the body's forward applies itself to what `get_image_features` returns (Llama 4's
    `multi_modal_projector`): they run there, with the projector unit's weights handed over with the features."""
    moe_types: dict[int, int] = field(default_factory=dict)
    """Token id -> type, where the body routes tokens to experts by `moe_mm_token_type_ids` (ERNIE-VL: an image's
    tokens with its start and end 1, to the vision experts; `moe_token_types`); empty where it reads none."""
    tokens_per_image: int | None = None
    """The image tokens every image fills, where the family fixes them (PaliGemma's `num_image_tokens`, whose processor
    writes a document's images as one run); None where each image's tokens are a run of their own."""

    @property
    def rope_index(self) -> bool:
        """The body computes multi-dimensional rotary positions (`get_rope_index`)."""
        return self.rope_rows > 0

    @property
    def holds_head(self) -> bool:
        """The composite body is the causal LM: its forward embeds the tokens itself unless handed embeddings."""
        return self.causal_lm_path == ""

    @property
    def blocks(self) -> nn.ModuleList:
        """The tower's blocks (none without a tower)."""
        return nn.ModuleList() if self.blocks_path is None else self.outer.get_submodule(self.blocks_path)

    @property
    def image_tokens_attend_both_ways(self) -> bool:
        """Some tokens attend to each other both ways, as the body reads them off token_type_ids: Gemma 3's image
        tokens, PaliGemma's prefix (`DocumentImages.token_types`)."""
        return "token_type_ids" in inspect.signature(self.outer.forward).parameters

    @property
    def image_marks(self) -> tuple[str, ...]:
        """The per-token types the body's forward takes that the engine fills, image tokens marked 1."""
        takes = inspect.signature(self.outer.forward).parameters
        return tuple(n for n in _IMAGE_MARKS if n in takes)


def is_vision_unit(name: str) -> bool:
    """A unit of the vision side (tower, its blocks, projector): a step without images leaves it unread."""
    return name.startswith(VISION_PREFIX)


def block_unit(i: int) -> str:
    return f"{VISION_BLOCK_PREFIX}{i}"


_IMAGE_SUB_CONFIGS = ("vision_config", "vq_config")


def is_vision_config(config: PretrainedConfig) -> bool:
    """An image-text config: it has a vision sub-config (a tower's, or a VQ image tokenizer's: Chameleon, Emu3) beside
    its text one."""
    return any(k in (getattr(config, "sub_configs", None) or {}) for k in _IMAGE_SUB_CONFIGS)


def find_vision(skeleton: nn.Module, config: PretrainedConfig, language_model: nn.Module) -> VisionSpec:
    """The tower, its block list and the projector of an image-text skeleton."""
    family = config.model_type
    if family in NOT_YET:
        raise ModelNotSupportedError(f"image-text family '{family}' is not trained yet: {NOT_YET[family]}")
    if "vision_config" not in (getattr(config, "sub_configs", None) or {}):
        raise ModelNotSupportedError(
            f"image-text family '{family}': its images become discrete tokens of a VQ-VAE (vq_config) that its text "
            "embedding embeds, not features of a vision tower; mt-ray trains image-text models with a tower "
            "(vision_config) and cannot train this family yet"
        )
    outer = skeleton.base_model
    outer_path = next(n for n, m in skeleton.named_modules() if m is outer)
    children = dict(outer.named_children())
    towers = [n for n, c in children.items()
              if isinstance(c, PreTrainedModel) and isinstance(c.config, type(config.vision_config))]
    text = _language_model_child(skeleton, children, language_model)
    head = skeleton.get_output_embeddings()
    beside = {n: c for n, c in children.items() if n not in (*towers, text) and c is not head}
    encoder_free = not towers and any(_weighs(c) and reached_by(type(outer), n, "get_image_features")
                                      for n, c in beside.items())
    if len(towers) + encoder_free != 1 or text is None:
        raise ModelNotSupportedError(
            f"image-text family '{family}': expected its body {type(outer).__name__} to own one vision tower (or an "
            f"image embedder its get_image_features runs instead) and the language model, found children "
            f"{list(children)}; mt-ray cannot train this family yet"
        )
    _refuse_own_image_merge(children[text], language_model, family)
    _refuse_text_to_tower(outer, family)
    _refuse_images_required(outer, family)
    if not callable(getattr(outer, "get_image_features", None)):
        raise ModelNotSupportedError(
            f"image-text family '{family}': its body {type(outer).__name__} has no get_image_features, so its images "
            "do not become embeddings at image tokens (cross-attention to image states, as Mllama's); mt-ray cannot "
            "train this family yet"
        )
    _refuse_unread_token_types(outer, family)
    tower_path = towers[0] if towers else None
    blocks_path = f"{tower_path}.{_find_blocks(children[tower_path], config.vision_config, family)}" if towers else None
    held = [n for n, c in beside.items() if _weighs(c) and read_apart(type(outer), n, "get_image_features")]
    projectors = [n for n, c in beside.items() if n not in held and _weighs(c)]
    projectors += [f"{tower_path}.{n}" for n in _PROJECTOR_IN_TOWER if towers and hasattr(children[tower_path], n)]
    image_token_id = getattr(config, "image_token_id", None)
    if image_token_id is None:
        image_token_id = getattr(config, "image_token_index", None)
    own = [n for n, _ in outer.named_parameters(recurse=False)]
    own += [n for n, _ in outer.named_buffers(recurse=False) if n in outer.state_dict()]
    return VisionSpec(outer, outer_path, tower_path, blocks_path, projectors, image_token_id,
                      rope_rows=_rope_rows(outer, image_token_id), own_tensors=own,
                      causal_lm_path=_causal_lm_path(children, text, language_model, head), held_paths=held,
                      forward_projectors=[p for p in projectors
                                          if applied_beside(type(outer), p, "get_image_features")],
                      tokens_per_image=getattr(config.get_text_config(), "num_image_tokens", None),
                      moe_types=_moe_types(outer, config))


def _weighs(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _rope_rows(outer: nn.Module, image_token_id: int) -> int:
    """How many rows of rotary positions the body's own `get_rope_index` numbers a text-only row with (0 without)."""
    if not hasattr(outer, "get_rope_index"):
        return 0
    return rope_index(outer, torch.zeros(1, 2, dtype=torch.long), image_token_id).shape[0]


def rope_index(outer: nn.Module, ids_1T: torch.Tensor, image_token_id: int,
               image_grid_thw: torch.Tensor | None = None) -> torch.Tensor:
    """[R, 1, T] rotary positions of one unpadded document by the body's own `get_rope_index`. Qwen-VL reads the
    image tokens off `mm_token_type_ids`; the Omni thinkers find each image by the processor's vision-start token
    before it and number a row without images from its attention mask (audio stays absent: no audio lengths, and
    `use_audio_in_video` keeps its default, False)."""
    kw = {"attention_mask": torch.ones_like(ids_1T), "image_grid_thw": image_grid_thw}
    if "mm_token_type_ids" in inspect.signature(outer.get_rope_index).parameters:
        kw["mm_token_type_ids"] = (ids_1T == image_token_id).int()
    return outer.get_rope_index(ids_1T, **kw)[0]


def _causal_lm_path(children: dict[str, nn.Module], text: str, language_model: nn.Module, head: nn.Module) -> str | None:
    """`VisionSpec.causal_lm_path`: the language model child where it is a whole causal LM, "" where the composite
    body holds the head itself, else None."""
    if children[text] is not language_model:
        return text
    return "" if any(c is head for c in children.values()) else None


def _language_model_child(skeleton: nn.Module, children: dict[str, nn.Module], language_model: nn.Module) -> str | None:
    """The composite body's child that runs the language model: the decoder body itself, or a whole causal LM around
    it whose head is the model's (Llama 4's `language_model`); None where neither is a child."""
    for name, child in children.items():
        if child is language_model:
            return name
        head = getattr(child, "get_output_embeddings", lambda: None)()
        if head is not None and head is skeleton.get_output_embeddings() and any(m is language_model for m in child.modules()):
            return name
    return None


def _refuse_own_image_merge(text: nn.Module, language_model: nn.Module, family: str) -> None:
    """Kosmos-2's language model takes the image embeddings itself and places them where its processor marks
    `image_embeds_position_mask`: the placeholder tokens between `<image>` and `</image>`, whose ids are ordinary text
    ids (Kosmos-2's the ids after `<unk>`, Kosmos-2.5's `<s>`). Only the tokenizer's `<image>` and `</image>` set them
    apart, and the config names neither (nor an image token id), so the engine cannot mark them from a row."""
    takes = [m for m in (text, language_model) if "image_embeds" in inspect.signature(type(m).forward).parameters]
    if takes:
        raise ModelNotSupportedError(
            f"image-text family '{family}': its language model ({type(takes[0]).__name__}) places the image embeddings "
            "itself, where the processor's `image_embeds_position_mask` says: over placeholder tokens between "
            "`<image>` and `</image>` whose ids are ordinary text ids, told apart only by those two tokenizer tokens, "
            "which its config does not name, so mt-ray cannot mark them from a row; this family cannot be trained yet"
        )


def _refuse_text_to_tower(outer: nn.Module, family: str) -> None:
    """InstructBLIP's Q-Former reads the prompt too, tokenized for it apart (`qformer_input_ids`): a second row of
    tokens per document that mt-ray's rows do not carry."""
    for method in ("get_image_features", "get_video_features"):
        read = [n for n in inspect.signature(getattr(outer, method, lambda: None)).parameters if n.endswith("input_ids")]
        if read:
            raise ModelNotSupportedError(
                f"image-text family '{family}': its {method} reads text tokens of its own ({read}, the prompt "
                "tokenized for its Q-Former), which mt-ray's rows do not carry; this family cannot be trained yet"
            )


def _refuse_images_required(outer: nn.Module, family: str) -> None:
    """BLIP-2's forward requires `pixel_values`: transformers' model runs no document without an image, and mt-ray's
    rows and micro-batches may hold none."""
    pixels = inspect.signature(type(outer).forward).parameters.get("pixel_values")
    if pixels is not None and pixels.default is pixels.empty:
        raise ModelNotSupportedError(
            f"image-text family '{family}': its forward requires pixel_values, so it runs no document without an image, "
            "which mt-ray's rows may hold; this family cannot be trained yet"
        )


def _refuse_unread_token_types(outer: nn.Module, family: str) -> None:
    """The engine marks `token_type_ids` and `moe_mm_token_type_ids` (where the body reads them) and numbers rotary
    positions itself (`mm_token_type_ids`); a body that reads other per-token types from the processor would see none
    of them."""
    unread = [n for n in inspect.signature(outer.forward).parameters
              if n.endswith("token_type_ids") and n not in _CARRIED_TOKEN_TYPES]
    if unread:
        raise ModelNotSupportedError(
            f"image-text family '{family}': its body reads per-token types {unread} from the processor, which "
            "mt-ray's rows do not carry; this family cannot be trained yet"
        )


def _moe_types(outer: nn.Module, config: PretrainedConfig) -> dict[int, int]:
    """`VisionSpec.moe_types` from the config's token ids (as its processor marks them from the tokenizer's); a body
    that reads them from a config that names no image start or end token is refused."""
    if "moe_mm_token_type_ids" not in inspect.signature(outer.forward).parameters:
        return {}
    missing = [n for n in _MOE_TYPE_TOKENS[1] if getattr(config, n, None) is None]
    if missing:
        raise ModelNotSupportedError(
            f"image-text family '{config.model_type}': its body routes each image's tokens, start and end to vision "
            f"experts by `moe_mm_token_type_ids`, and its config names no {', '.join(missing)} to mark them by; this "
            "family cannot be trained yet"
        )
    return {getattr(config, n): t for t, names in _MOE_TYPE_TOKENS.items() for n in names
            if getattr(config, n, None) is not None}


def moe_token_types(vision: VisionSpec, ids: torch.Tensor) -> torch.Tensor:
    """The `moe_mm_token_type_ids` of `ids`, as ERNIE-VL's processor marks them (`VisionSpec.moe_types`; 0: text)."""
    types = torch.zeros_like(ids)
    for token, kind in vision.moe_types.items():
        types = types.masked_fill(ids == token, kind)
    return types


def _find_blocks(tower: nn.Module, vision_config: PretrainedConfig, family: str) -> str:
    """The one ModuleList in the tower with an entry per vision layer (`depth` or `num_hidden_layers`)."""
    n = getattr(vision_config, "depth", None) or getattr(vision_config, "num_hidden_layers", None)
    if n is None:
        inner = [k for k in getattr(vision_config, "sub_configs", None) or {}
                 if getattr(getattr(vision_config, k, None), "num_hidden_layers", None)]
        why = (f"{type(tower).__name__} runs towers of their own in turn ({', '.join(inner)}), each with its own list "
               "of blocks, and mt-ray streams one list of vision blocks" if inner
               else f"the blocks of {type(tower).__name__} are not found")
        raise ModelNotSupportedError(
            f"image-text family '{family}': its vision config names no layer count (depth or num_hidden_layers): "
            f"{why}; mt-ray cannot train this family yet"
        )
    lists = [name for name, m in tower.named_modules() if isinstance(m, nn.ModuleList) and len(m) == n]
    if len(lists) != 1:
        raise ModelNotSupportedError(
            f"image-text family '{family}': expected one list of {n} vision blocks in {type(tower).__name__}, "
            f"found {lists or 'none'}; mt-ray cannot train this family yet"
        )
    return lists[0]
