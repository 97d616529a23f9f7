"""Discover the structure of a Hugging Face decoder-only or image-text model without materialising it.

The engine needs to know, for any causal LM, which module embeds tokens, which list holds the
decoder layers, which module is the final norm and which is the LM head, whether the head is
tied to the embedding, and which layers share one structure (so one template serves them).
We find all of this by walking a skeleton built on the meta device, never by a list of model
families, so a new family that follows the usual layout works without code changes. An
image-text model adds its vision tower and projector (`vision.py`) as units of their own.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch
import transformers
from accelerate import init_empty_weights
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from mt_ray.errors import ModelNotSupportedError
from mt_ray.models.vision import (
    VISION_EMBED,
    VISION_PROJECTOR,
    VisionSpec,
    block_unit,
    check_verified,
    find_vision,
    is_vision_config,
    is_vision_unit,
)

# Attributes that differ between layers but do not change what a layer computes when no
# KV cache is used; everything else that differs splits layers into separate kinds.
_LAYER_ATTRS_IGNORED = frozenset({"layer_idx", "training"})


@dataclass(frozen=True)
class ParamInfo:
    """One tensor of a unit: its Hugging Face name, its name inside the unit's module, shape.

    `trainable` is False for a buffer the checkpoint stores (DeepSeek-V3's per-layer
    `e_score_correction_bias`): it travels and is bound with its unit, so each layer computes
    with its own values, but no gradient reaches it and the optimizer leaves it unchanged.
    """

    hf_name: str
    local_name: str
    shape: tuple[int, ...]
    trainable: bool = True

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def decays(self) -> bool:
        """Matrices and embeddings get weight decay; norms and biases do not (nanoGPT's rule)."""
        return self.trainable and len(self.shape) >= 2


@dataclass
class UnitSpec:
    """A group of parameters that travels to the device together and is updated together."""

    name: str
    params: list[ParamInfo]
    kind: str
    frozen: bool = False
    """Never trained (a frozen vision tower): no moments, no gradient, no update."""

    @cached_property
    def numel(self) -> int:
        """Parameters in the unit (cached: the calculator asks thousands of times; params never change)."""
        return sum(p.numel for p in self.params)


@dataclass
class ModelSpec:
    """What the engine knows about a model: its skeleton, its units and its layer kinds."""

    config: PretrainedConfig
    skeleton: nn.Module
    base: nn.Module
    layers_attr: str
    norm_attr: str
    tied: bool
    units: list[UnitSpec] = field(default_factory=list)
    layer_kinds: dict[str, nn.Module] = field(default_factory=dict)
    isolate_documents: bool = False
    """The layers carry state along the sequence outside attention (linear attention, short
    convolutions, Mamba): the documents of a packed row must run through them one at a time."""
    vision: VisionSpec | None = None
    """An image-text model's tower and projector (their units are named `vision.*`); None for a text model."""

    @property
    def num_layers(self) -> int:
        return len(self.layer_units)

    @property
    def layer_units(self) -> list[UnitSpec]:
        return [u for u in self.units if u.name.startswith("layers.")]

    def unit(self, name: str) -> UnitSpec:
        return self._by_name[name]

    @property
    def num_params(self) -> int:
        return sum(u.numel for u in self.units)

    @property
    def text_params(self) -> int:
        """The language model's parameters (all of them for a text model): what each token computes with."""
        return sum(u.numel for u in self.units if not is_vision_unit(u.name))

    @property
    def trainable_units(self) -> list[UnitSpec]:
        return [u for u in self.units if not u.frozen]

    @property
    def text_config(self) -> PretrainedConfig:
        """The language model's config (the config itself for a text model)."""
        return self.config.get_text_config()

    def __post_init__(self) -> None:
        self._by_name = {u.name: u for u in self.units}


def load_config(model: str | PretrainedConfig | dict) -> PretrainedConfig:
    """Accept a config object, a dict with `model_type`, or a local folder holding config.json.

    A config object is copied: the spec owns its config, so what an engine sets on it (the attention
    backend) never reaches the caller's object, nor a process that object is later sent to.
    """
    if isinstance(model, PretrainedConfig):
        return copy.deepcopy(model)
    if isinstance(model, dict):
        kwargs = dict(model)
        model_type = kwargs.pop("model_type", None)
        if model_type is None:
            raise ModelNotSupportedError("a model config dict needs a 'model_type' key, e.g. 'llama' or 'qwen2'")
        _check_known_model_type(model_type, "the model config")
        return AutoConfig.for_model(model_type, **kwargs)
    config_json = Path(model) / "config.json"
    if config_json.is_file():
        _check_known_model_type(_read_model_type(config_json), str(config_json))
    try:
        return AutoConfig.from_pretrained(model, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelNotSupportedError(
            f"cannot read a model config from '{model}': {e}. Point model.path at a local folder "
            "with config.json (nothing is downloaded at run time)."
        ) from None


def _read_model_type(config_json: Path) -> str | None:
    try:
        return json.loads(config_json.read_text()).get("model_type")
    except ValueError:  # unreadable JSON: AutoConfig's own error says what is wrong with it
        return None


def _check_known_model_type(model_type: str | None, where: str) -> None:
    if model_type is not None and model_type not in CONFIG_MAPPING:
        raise ModelNotSupportedError(
            f"unknown model_type '{model_type}' in {where}: the installed transformers {transformers.__version__} "
            "does not know it. A newer family needs a newer transformers (pip install -U transformers); "
            "otherwise check the model_type spelling."
        )


def build_skeleton(config: PretrainedConfig) -> nn.Module:
    """Build the causal LM (or image-text model) with parameters on the meta device and real buffers
    (rotary tables)."""
    if getattr(config, "is_encoder_decoder", False):
        raise ModelNotSupportedError(
            f"'{config.model_type}' is an encoder-decoder model; mt-ray trains decoder-only causal LMs "
            "(Llama, Qwen, Mistral, Gemma, Phi, ...)."
        )
    if is_vision_config(config):
        check_verified(config)
    auto = AutoModelForImageTextToText if is_vision_config(config) else AutoModelForCausalLM
    try:
        with init_empty_weights(include_buffers=False):
            return auto.from_config(config)
    except ValueError as e:
        raise ModelNotSupportedError(
            f"'{config.model_type}' has no causal-LM or image-text class in transformers ({e}); mt-ray trains "
            "models that AutoModelForCausalLM or AutoModelForImageTextToText can build."
        ) from None


def discover(model: str | PretrainedConfig | dict, freeze_vision_tower: bool = True,
             freeze_multi_modal_projector: bool = False) -> ModelSpec:
    """Find embedding, decoder layers, final norm, LM head and layer kinds of a causal LM; of an
    image-text model also the vision tower's units and the projector's, frozen as asked (the
    defaults are LLaMA-Factory's: tower frozen, projector trained)."""
    config = load_config(model)
    skeleton = build_skeleton(config)
    embed = skeleton.get_input_embeddings()
    head = skeleton.get_output_embeddings()
    base = _find_base(skeleton, embed)
    layers_attr = _find_layers(base, config)
    norm_attr = _find_final_norm(base, embed, layers_attr, config.model_type)
    if head is None or not isinstance(head, nn.Linear):
        raise ModelNotSupportedError(f"'{config.model_type}' has no linear LM head; it is not a causal LM")
    tied = head.weight is embed.weight or bool(getattr(config, "tie_word_embeddings", False))
    vision = find_vision(skeleton, config, base) if is_vision_config(config) else None
    _reject_unknown_parameters(skeleton, base, embed, head, layers_attr, norm_attr, vision)

    names = {id(m): n for n, m in skeleton.named_modules()}
    layers = getattr(base, layers_attr)
    _reject_weights_tied_between_layers(skeleton, head, names)
    layer_kinds: dict[str, nn.Module] = {}
    units = _vision_units(vision, freeze_vision_tower, freeze_multi_modal_projector) if vision else []
    units.append(UnitSpec("embed", _params(embed, names[id(embed)]), "embed"))
    kinds = _kinds(layers, layer_kinds)
    units += [UnitSpec(f"layers.{i}", _params(layer, names[id(layer)]), kinds[i]) for i, layer in enumerate(layers)]
    norm = getattr(base, norm_attr)
    head_params = _params(norm, names[id(norm)], prefix="norm.")
    # A tied head's matrix is the embedding's; anything else it has (CTRL's bias) is the head unit's own.
    head_params += [p for p in _params(head, names[id(head)], prefix="lm_head.")
                    if not (tied and p.local_name == "lm_head.weight")]
    units.append(UnitSpec("head", _decayed_first(head_params), "head"))
    isolate = _carries_sequence_state(skeleton, layers)
    return ModelSpec(config, skeleton, base, layers_attr, norm_attr, tied, units, layer_kinds, isolate, vision)


def _kinds(layers: nn.ModuleList, kind_modules: dict[str, nn.Module], prefix: str = "") -> list[str]:
    """Each layer's kind name (layers that compute the same function share one); fills `kind_modules`."""
    kinds: dict[tuple, str] = {}
    out = []
    for layer in layers:
        fp = _fingerprint(layer)
        if fp not in kinds:
            kinds[fp] = f"{prefix}{type(layer).__name__}#{len(kinds)}"
            kind_modules[kinds[fp]] = layer
        out.append(kinds[fp])
    return out


def _vision_units(vision: VisionSpec, freeze_tower: bool, freeze_projector: bool) -> list[UnitSpec]:
    """The tower's non-block parameters (`vision.embed`), each block, then the projector.

    `vision.embed` and the projector are bound together to the composite body (names relative to it),
    which runs the family's own `get_image_features` around the blocks."""
    outer, path = vision.outer, vision.outer_path
    saved = outer.state_dict(keep_vars=True)
    projector = tuple(f"{p}." for p in vision.projector_paths)
    blocks = f"{vision.blocks_path}."

    def entries(keep) -> list[ParamInfo]:
        return _decayed_first([ParamInfo(f"{path}.{n}", n, tuple(t.shape), isinstance(t, nn.Parameter) and t.requires_grad)
                               for n, t in saved.items() if keep(n)])

    tower = entries(lambda n: n.startswith(f"{vision.tower_path}.") and not n.startswith((*projector, blocks)))
    units = [UnitSpec(VISION_EMBED, tower, VISION_EMBED, frozen=freeze_tower)]
    names = _kinds(vision.blocks, vision.block_kinds, prefix="vision:")
    for i, block in enumerate(vision.blocks):
        units.append(UnitSpec(block_unit(i), _params(block, f"{path}.{blocks}{i}"), names[i], frozen=freeze_tower))
    units.append(UnitSpec(VISION_PROJECTOR, entries(lambda n: n.startswith(projector)), VISION_PROJECTOR,
                          frozen=freeze_projector))
    return units


def _params(module: nn.Module, path: str, prefix: str = "") -> list[ParamInfo]:
    """The module's parameters, then the buffers a checkpoint stores (persistent ones) as frozen entries.

    A parameter the family declares with `requires_grad=False` (ERNIE-4.5-MoE's routing-correction bias) is a
    frozen entry too, as is one of a module whose forward runs under `torch.no_grad` (DeepSeek-V3.2's sparse-attention
    indexer): transformers never computes their gradient and torch's optimizer skips them."""
    no_grad = {id(p) for m in module.modules() if _runs_without_grad(m) for p in m.parameters()}
    infos = [
        ParamInfo(f"{path}.{n}" if path else n, prefix + n, tuple(p.shape),
                  trainable=p.requires_grad and id(p) not in no_grad)
        for n, p in module.named_parameters()
    ]
    saved = module.state_dict(keep_vars=True)
    infos += [
        ParamInfo(f"{path}.{n}" if path else n, prefix + n, tuple(b.shape), trainable=False)
        for n, b in module.named_buffers() if n in saved
    ]
    return _decayed_first(infos)


def _runs_without_grad(module: nn.Module) -> bool:
    """Whether the module's forward is decorated with `torch.no_grad` (or inference mode): no gradient reaches
    its parameters. The decorator keeps the context's factory in its wrapper's closure."""
    cells = getattr(type(module).forward, "__closure__", None) or ()
    return any(isinstance(getattr(_cell(c), "__self__", None), (torch.no_grad, torch.inference_mode)) for c in cells)


def _cell(cell) -> object:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _decayed_first(infos: list[ParamInfo]) -> list[ParamInfo]:
    """Decayed parameters first, so each unit's flat buffer splits into two optimizer groups; frozen
    entries last, so a unit's gradient is its trainable prefix followed by zeros."""
    return sorted(infos, key=lambda p: (not p.decays, not p.trainable))


def _carries_sequence_state(skeleton: nn.Module, layers: nn.ModuleList) -> bool:
    """Whether tokens mix outside attention: transformers marks such models stateful (they keep a
    recurrent cache), and every linear-attention, short-convolution and Mamba mixer it has holds a
    causal Conv1d (LFM2's short convolution is not marked stateful)."""
    has_conv = any(isinstance(m, nn.Conv1d) for m in layers.modules())
    return has_conv or bool(getattr(type(skeleton), "_is_stateful", False))


def _find_base(skeleton: nn.Module, embed: nn.Module) -> nn.Module:
    """The decoder body: the module that directly owns the input embedding."""
    for module in skeleton.modules():
        if any(child is embed for child in module.children()):
            return module
    raise ModelNotSupportedError(f"'{skeleton.config.model_type}': cannot find the module that owns the embedding "
                                 f"in {type(skeleton).__name__}; this family cannot be trained yet")


def _find_layers(base: nn.Module, config: PretrainedConfig) -> str:
    """The ModuleList of decoder layers: the direct child list with one entry per hidden layer."""
    n = getattr(config.get_text_config(), "num_hidden_layers", None)
    lists = [name for name, c in base.named_children() if isinstance(c, nn.ModuleList) and len(c) == n]
    if len(lists) != 1:
        raise ModelNotSupportedError(
            f"'{config.model_type}' does not have a decoder-only layout: expected one list of {n} decoder layers "
            f"beside the input embedding (in {type(base).__name__}), found {lists or 'none'}"
        )
    return lists[0]


def _find_final_norm(base: nn.Module, embed: nn.Module, layers_attr: str, model_type: str) -> str:
    """The final norm: the one parameterised direct child of the body beside embedding and layer list,
    or, where it has no parameters (OLMo's), the one parameterless child that is a norm.

    Any other parameterised child (learned or sinusoidal position embeddings, an embedding norm,
    a hyper-connection head) computes between the units the engine streams: refuse the family."""
    rest = {
        name: c for name, c in base.named_children()
        if c is not embed and name != layers_attr and any(True for _ in c.parameters())
    }
    if len(rest) == 1 and _is_norm(next(iter(rest.values()))):
        return next(iter(rest))
    if not rest:
        norms = [name for name, c in base.named_children() if _is_norm(c)]
        if len(norms) == 1:
            return norms[0]
    if not rest:
        raise ModelNotSupportedError(
            f"'{model_type}' has no final norm between its decoder layers and the LM head ({type(base).__name__}), "
            "where mt-ray's head unit starts; this family cannot be trained yet"
        )
    raise ModelNotSupportedError(
        f"'{model_type}' has parameterised modules beside its embedding, decoder layers and one final norm "
        f"({type(base).__name__}: {sorted(rest)}; learned position embeddings, an embedding "
        "norm or a head before the LM head), which mt-ray does not stream; this family cannot be trained yet"
    )


def _reject_weights_tied_between_layers(skeleton: nn.Module, head: nn.Module, names: dict[int, str]) -> None:
    """Zamba's and Zamba2's shared transformer block is one set of weights inside several layers (transformers
    ties them, `save_pretrained` stores them once): streamed per layer they would train as separate copies."""
    head_weight = f"{names[id(head)]}.weight"
    tied = {t: s for t, s in (getattr(skeleton, "all_tied_weights_keys", None) or {}).items() if t != head_weight}
    if tied:
        target, source = next(iter(tied.items()))
        raise ModelNotSupportedError(
            f"'{skeleton.config.model_type}' ties weights between decoder layers ({len(tied)} tensors, e.g. {target} "
            f"is {source}), which mt-ray would train as separate copies; this family cannot be trained yet"
        )


def _is_norm(module: nn.Module) -> bool:
    """A norm by its class (`LayerNorm`, `Lfm2RMSNorm`, ...); a position embedding is not one."""
    return "norm" in type(module).__name__.lower() and not isinstance(module, nn.Embedding)


def _reject_unknown_parameters(
    skeleton: nn.Module, base: nn.Module, embed: nn.Module, head: nn.Module, layers_attr: str, norm_attr: str,
    vision: VisionSpec | None = None,
) -> None:
    """Parameters outside the units would silently never train, and saved buffers outside them would
    never load: refuse such a model instead."""
    owners = [embed, head, getattr(base, layers_attr), getattr(base, norm_attr)]
    if vision is not None:
        owners += [vision.outer.get_submodule(p) for p in (vision.tower_path, *vision.projector_paths)]
    known = {id(t) for m in owners for t in (*m.parameters(), *m.buffers())}
    unknown = [n for n, t in skeleton.state_dict(keep_vars=True).items() if id(t) not in known]
    if unknown:
        raise ModelNotSupportedError(
            f"'{skeleton.config.model_type}' has parameters or saved buffers outside embedding, decoder layers, "
            f"final norm and LM head ({type(skeleton).__name__}: {unknown[:5]}), which mt-ray does not stream; "
            "this family cannot be trained yet"
        )


def _fingerprint(layer: nn.Module) -> tuple:
    """Layers with the same parameter shapes and the same plain attributes compute the same function."""
    shapes = tuple((n, tuple(p.shape)) for n, p in layer.named_parameters())
    attrs = []
    for mod_name, mod in layer.named_modules():
        for k, v in sorted(vars(mod).items()):
            if k.startswith("_") or k in _LAYER_ATTRS_IGNORED:
                continue
            if isinstance(v, (bool, int, float, str, type(None))):
                attrs.append((mod_name, k, v))
    return (type(layer).__qualname__, shapes, tuple(attrs))


def meta_free_buffers_to(module: nn.Module, device: torch.device) -> nn.Module:
    """Move a skeleton module's (real) buffers to `device`; its meta parameters stay unused."""
    for sub in module.modules():
        for name, buf in list(sub._buffers.items()):
            if buf is not None:
                sub._buffers[name] = buf.to(device)
    return module
