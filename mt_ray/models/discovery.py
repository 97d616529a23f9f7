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
import dataclasses
import inspect
import json
import re
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
from mt_ray.models import nesting
from mt_ray.models.body_source import first_use
from mt_ray.models.experts import active_fraction_by_param
from mt_ray.models.mask_modules import mask_only_children, selects_keys
from mt_ray.models.nesting import shallow_copy
from mt_ray.models.no_grad_paths import reached_with_encoder_only, runs_without_grad
from mt_ray.models.stream_tail import TailCode, split_tail
from mt_ray.models.vision import (
    VISION_EMBED,
    VISION_PROJECTOR,
    VisionSpec,
    block_unit,
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

    `tied_to` names the tensor this one is (Zamba's shared transformer block, used by several layers and
    stored once by `save_pretrained`): an earlier layer's parameter. This entry is a mirror, untrained in
    its own unit: it carries the owner's values to the device with its layer, its gradient is added to the
    owner's, and the owner's update is copied into it (`HostStore`), so the tensor trains as one.
    """

    hf_name: str
    local_name: str
    shape: tuple[int, ...]
    trainable: bool = True
    tied_to: str | None = None

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


@dataclass(frozen=True)
class Mirror:
    """Where a mirror (`ParamInfo.tied_to`) lies in its unit's flat buffer, and where its owner's tensor lies."""

    local_name: str
    offset: int
    owner: str
    owner_offset: int
    numel: int


def _offsets(params: list[ParamInfo]) -> list[int]:
    """Each entry's offset in its unit's flat buffer."""
    out, off = [], 0
    for p in params:
        out.append(off)
        off += p.numel
    return out


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
    norm_attr: str | None
    """The body's final norm, the head unit's first module (None: the body has none, as BART's decoder)."""
    tied: bool
    units: list[UnitSpec] = field(default_factory=list)
    layer_kinds: dict[str, nn.Module] = field(default_factory=dict)
    isolate_documents: bool = False
    """The layers carry state along the sequence outside attention (linear attention, short
    convolutions, Mamba): the documents of a packed row must run through them one at a time."""
    vision: VisionSpec | None = None
    """An image-text model's tower and projector (their units are named `vision.*`); None for a text model."""
    embed_attrs: tuple[str, ...] = ()
    """The body's modules it runs on the embedding's output before the first layer (GPT-2's learned positions,
    BLOOM's embedding norm; in a nested body, paths: BERT's `embeddings` container around the embedding, RemBERT's
    `encoder.embedding_hidden_mapping_in`): their parameters are the embed unit's, under `<path>.` names."""
    between_attrs: tuple[str, ...] = ()
    """The causal LM's modules run on the body's output before the LM head (BERT's `cls`): the head unit's, under
    `between.<path>` names (`nesting.between_modules`)."""
    unread_attrs: tuple[str, ...] = ()
    """Modules the body runs after its layers whose output the LM head never reads (BigBird's pooler): frozen entries of
    the head unit, under `unread.<path>` names."""
    tail_attrs: tuple[str, ...] = ()
    """The body's parameterised children its code after the layers uses (DeepSeek-V4's hyper-connection head and
    final norm, `stream_tail.py`): their parameters are the head unit's, under `<child>.` names."""
    tail_code: TailCode | None = None
    """That code (None where the body ends in its final norm alone, `norm_attr`, or in nothing)."""

    @property
    def num_layers(self) -> int:
        return len(self.layer_units)

    @property
    def layer_units(self) -> list[UnitSpec]:
        return [u for u in self.units if u.name.startswith("layers.")]

    def unit(self, name: str) -> UnitSpec:
        return self._by_name[name]

    @cached_property
    def mirrors(self) -> dict[str, list[Mirror]]:
        """Each unit's mirrors of weights another unit owns (`ParamInfo.tied_to`), by the mirroring unit's name."""
        at = {p.hf_name: (u.name, off) for u in self.units for p, off in zip(u.params, _offsets(u.params), strict=True)}
        out: dict[str, list[Mirror]] = {}
        for u in self.units:
            for p, off in zip(u.params, _offsets(u.params), strict=True):
                if p.tied_to is not None:
                    owner, owner_off = at[p.tied_to]
                    out.setdefault(u.name, []).append(Mirror(p.local_name, off, owner, owner_off, p.numel))
        return out

    @property
    def num_params(self) -> int:
        return sum(u.numel for u in self.units)

    @property
    def text_params(self) -> int:
        """The language model's parameters (all of them for a text model): what each token computes with."""
        return sum(u.numel for u in self.units if not is_vision_unit(u.name))

    @cached_property
    def routed_shares(self) -> dict[str, dict[str, float]]:
        """By layer kind, each routed expert parameter's share one token computes with (`experts.py`)."""
        return {kind: active_fraction_by_param(layer, self.text_config) for kind, layer in self.layer_kinds.items()}

    def active_numel(self, unit: UnitSpec) -> int:
        """`unit`'s parameters one token computes with: a MoE layer's routed banks count `top_k` of `num_experts`."""
        shares = self.routed_shares.get(unit.kind, {})
        return round(sum(p.numel * shares.get(p.local_name, 1.0) for p in unit.params)) if shares else unit.numel

    @cached_property
    def active_text_params(self) -> int:
        """The language model's parameters one token computes with (`text_params` for a dense model): what the
        FLOPs follow, while memory, the link and the optimizer follow every parameter."""
        return self.text_params - sum(u.numel - self.active_numel(u) for u in self.layer_units)

    @cached_property
    def routed_active_params(self) -> int:
        """Of `active_text_params`, the routed experts' (0 for a dense model): they compute as grouped GEMMs, at
        their own rate."""
        return round(sum(p.numel * self.routed_shares[u.kind].get(p.local_name, 0.0)
                         for u in self.layer_units if self.routed_shares.get(u.kind) for p in u.params))

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
    base, layers_attr, norm_attr, embed_attrs, unread, tail_attrs, tail = _body_layout(skeleton, embed, config)
    if head is None or not isinstance(head, nn.Linear):
        raise ModelNotSupportedError(f"'{config.model_type}' has no linear LM head; it is not a causal LM")
    names = {id(m): n for n, m in skeleton.named_modules()}
    tied = _head_tied(skeleton, embed, head, names)
    vision = find_vision(skeleton, config, base) if is_vision_config(config) else None
    between = nesting.between_modules(skeleton, base, head)
    body_parts = [base.get_submodule(a) for a in (layers_attr, norm_attr, *embed_attrs, *unread, *tail_attrs) if a is not None]
    _reject_unknown_parameters(skeleton, [embed, head, *body_parts, *map(skeleton.get_submodule, between)], vision)

    layers = base.get_submodule(layers_attr)
    ties = _layer_ties(skeleton, head, names, layers, nesting.shared_ties(skeleton, (names[id(head)], *between)))
    layer_kinds: dict[str, nn.Module] = {}
    units = _vision_units(vision, freeze_vision_tower, freeze_multi_modal_projector) if vision else []
    embed_params = _params(embed, names[id(embed)])
    for attr in embed_attrs:
        child = base.get_submodule(attr)
        embed_params += _params(child, names[id(child)], prefix=f"{attr}.")
    # BERT's `embeddings` container holds the embedding again: one entry, the embedding's own (`weight`).
    embed_params = nesting.one_entry_each(skeleton, embed_params, set())
    units.append(UnitSpec("embed", _decayed_first(embed_params), "embed"))
    layer_params = [_params(layer, names[id(layer)], ties=ties) for layer in layers]
    # A layer holding mirrors lays out its flat buffer apart from its owner's: a kind of its own.
    kinds = _kinds(layers, layer_kinds, [tuple(p.local_name for p in ps if p.tied_to) for ps in layer_params])
    units += [UnitSpec(f"layers.{i}", ps, kinds[i]) for i, ps in enumerate(layer_params)]
    norm = base.get_submodule(norm_attr) if norm_attr is not None else None
    head_params = _params(norm, names[id(norm)], prefix="norm.") if norm is not None else []
    for attr in tail_attrs:
        head_params += _params(getattr(base, attr), names[id(getattr(base, attr))], prefix=f"{attr}.")
    # A tied head's matrix is the embedding's; anything else it has (CTRL's bias) is the head unit's own.
    head_params += [p for p in _params(head, names[id(head)], prefix="lm_head.")
                    if not (tied and p.local_name == "lm_head.weight")]
    for a in between:  # BERT's prediction head (`cls`), run on the body's output before the LM head
        head_params += _params(skeleton.get_submodule(a), a, prefix=f"{nesting.BETWEEN}.{a}.")
    for a in unread:  # a pooler the LM head never reads (BigBird's): it loads and exports, untrained
        module = base.get_submodule(a)
        head_params += [dataclasses.replace(p, trainable=False)
                        for p in _params(module, names[id(module)], prefix=f"{nesting.UNREAD}.{a}.")]
    head_params = nesting.one_entry_each(skeleton, head_params, {p.hf_name for p in embed_params})
    # A tied head after a body without a final norm (BART's decoder) has no weights of its own: nothing to train.
    units.append(UnitSpec("head", _decayed_first(head_params), "head", frozen=not head_params))
    _refuse_integer_buffers(skeleton, units)
    isolate = _carries_sequence_state(skeleton, layers)
    return ModelSpec(config, skeleton, base, layers_attr, norm_attr, tied, units, layer_kinds, isolate, vision,
                     embed_attrs, between, unread, tail_attrs, tail)


def _body_layout(skeleton: nn.Module, embed: nn.Module, config: PretrainedConfig,
                 ) -> tuple[nn.Module, str, str | None, tuple[str, ...], tuple[str, ...], tuple[str, ...],
                            TailCode | None]:
    """The body, its layer list, final norm, pre-layer modules, unread modules (paths under the body) and the modules
    and code after its layers (`stream_tail`): read from a body holding its embedding and layer list as children, or
    nested in containers of it (`nesting`)."""
    nested = None if is_vision_config(config) else nesting.find_nested(skeleton, embed, config)
    if nested is not None:
        return nested.base, nested.layers_path, nested.norm, nested.pre, nested.unread, (), None
    base = _find_base(skeleton, embed)
    layers_attr = _find_layers(base, config, skeleton)
    norm_attr, embed_attrs, tail_attrs, tail = _split_body(base, embed, layers_attr, config.model_type)
    return base, layers_attr, norm_attr, embed_attrs, (), tail_attrs, tail


def embed_module(spec: ModelSpec) -> nn.Module:
    """The embed unit's module: the input embedding, with the body's pre-layer children (`embed_attrs`) attached
    under their names, so that the unit's local names (`weight`, `wpe.weight`, ...) bind to it."""
    embed = spec.skeleton.get_input_embeddings()
    if not spec.embed_attrs:
        return embed
    module = shallow_copy(embed)
    for attr in spec.embed_attrs:
        nesting.attach(module, attr, spec.base.get_submodule(attr))
    return module


def _head_tied(skeleton: nn.Module, embed: nn.Module, head: nn.Module, names: dict[int, str]) -> bool:
    """Whether transformers ties the LM head to the embedding: its own tie list decides where it has one (BigBird-
    Pegasus' decoder says `tie_word_embeddings` yet keeps its head apart, and saves it); else the config's flag."""
    tied_keys = getattr(skeleton, "all_tied_weights_keys", None)
    if head.weight is embed.weight or tied_keys is None:
        return head.weight is embed.weight or bool(getattr(skeleton.config, "tie_word_embeddings", False))
    return f"{names[id(head)]}.weight" in tied_keys


def _kinds(layers: nn.ModuleList, kind_modules: dict[str, nn.Module], layouts: list[tuple] | None = None,
           prefix: str = "") -> list[str]:
    """Each layer's kind name (layers that compute the same function from the same flat layout, `layouts`, share
    one); fills `kind_modules`."""
    kinds: dict[tuple, str] = {}
    out = []
    for i, layer in enumerate(layers):
        fp = (_fingerprint(layer), layouts[i] if layouts else ())
        if fp not in kinds:
            kinds[fp] = f"{prefix}{type(layer).__name__}#{len(kinds)}"
            kind_modules[kinds[fp]] = layer
        out.append(kinds[fp])
    return out


def _vision_units(vision: VisionSpec, freeze_tower: bool, freeze_projector: bool) -> list[UnitSpec]:
    """The tower's non-block parameters (`vision.embed`), each block, then the projector.

    `vision.embed` and the projector are bound together to the composite body (names relative to it),
    which runs the family's own `get_image_features` around the blocks."""
    outer, path = vision.outer, f"{vision.outer_path}." if vision.outer_path else ""  # "": the body is the model
    saved = outer.state_dict(keep_vars=True)
    projector = tuple(f"{p}." for p in vision.projector_paths)
    blocks = f"{vision.blocks_path}."

    def entries(keep) -> list[ParamInfo]:
        return _decayed_first([ParamInfo(f"{path}{n}", n, tuple(t.shape), isinstance(t, nn.Parameter) and t.requires_grad)
                               for n, t in saved.items() if keep(n)])

    held = tuple(f"{p}." for p in vision.held_paths)
    tower = entries(lambda n: n.startswith(f"{vision.tower_path}.") and not n.startswith((*projector, blocks))
                    ) if vision.tower_path is not None else []
    tower += [dataclasses.replace(p, trainable=False) for p in entries(lambda n: n.startswith(held))] if held else []
    # Without a tower (Gemma 4 Unified's encoder-free embedder is the projector) nothing here trains.
    units = [UnitSpec(VISION_EMBED, tower, VISION_EMBED, frozen=freeze_tower or vision.tower_path is None)]
    names = _kinds(vision.blocks, vision.block_kinds, prefix="vision:")
    for i, block in enumerate(vision.blocks):
        units.append(UnitSpec(block_unit(i), _params(block, f"{path}{blocks}{i}"), names[i], frozen=freeze_tower))
    own = set(vision.own_tensors)
    # A tower whose output enters the language model as it is (Inkling's) has no projector: nothing to train.
    projected = entries(lambda n: n.startswith(projector) or n in own)
    units.append(UnitSpec(VISION_PROJECTOR, projected, VISION_PROJECTOR, frozen=freeze_projector or not projected))
    return units


def _params(module: nn.Module, path: str, prefix: str = "", ties: dict[str, str] | None = None) -> list[ParamInfo]:
    """The module's parameters, then the buffers a checkpoint stores (persistent ones) as frozen entries; a
    parameter `ties` names (Hugging Face name -> the earlier layer's it is) is a mirror of that one.

    A parameter the family declares with `requires_grad=False` (ERNIE-4.5-MoE's routing-correction bias) is a
    frozen entry too, as is one of a module whose forward runs under `torch.no_grad` (DeepSeek-V3.2's sparse-attention
    indexer), that is reached only with an encoder's hidden states (the cross-attention of BART's decoder layers,
    which a causal LM never has) or that only builds the attention mask (Qwen4-Exp's indexer, `mask_modules`):
    transformers never computes their gradient and torch's optimizer skips them."""
    no_grad = {id(p) for m in module.modules() if runs_without_grad(m) for p in m.parameters()}
    no_grad |= {id(p) for m in module.modules() for a in reached_with_encoder_only(type(m)) | mask_only_children(type(m))
                if isinstance(getattr(m, a, None), nn.Module) for p in getattr(m, a).parameters()}
    ties = ties or {}
    infos = []
    for n, p in module.named_parameters():
        name = f"{path}.{n}" if path else n
        tied_to = ties.get(name)
        infos.append(ParamInfo(name, prefix + n, tuple(p.shape),
                               trainable=p.requires_grad and id(p) not in no_grad and tied_to is None, tied_to=tied_to))
    saved = module.state_dict(keep_vars=True)
    infos += [
        ParamInfo(f"{path}.{n}" if path else n, prefix + n, tuple(b.shape), trainable=False)
        for n, b in module.named_buffers() if n in saved
    ]
    return _decayed_first(infos)


def _refuse_integer_buffers(skeleton: nn.Module, units: list[UnitSpec]) -> None:
    """A unit's tensors travel in one floating-point buffer: a saved integer table (DeepSeek-V4's hash routing,
    `tid2eid`) would reach the layer as floats, exact only up to the compute dtype's integers."""
    saved = skeleton.state_dict(keep_vars=True)
    found = [p.hf_name for u in units for p in u.params if p.hf_name in saved and not saved[p.hf_name].is_floating_point()]
    if found:
        raise ModelNotSupportedError(
            f"'{skeleton.config.model_type}' stores integer tables with its weights ({found[:3]}), which mt-ray would "
            "stream as floating-point values; this family cannot be trained yet")


def _decayed_first(infos: list[ParamInfo]) -> list[ParamInfo]:
    """Decayed parameters first, so each unit's flat buffer splits into two optimizer groups; frozen
    entries last, so a unit's gradient is its trainable prefix followed by zeros."""
    return sorted(infos, key=lambda p: (not p.decays, not p.trainable))


def _carries_sequence_state(skeleton: nn.Module, layers: nn.ModuleList) -> bool:
    """Whether tokens mix outside attention: transformers marks such models stateful (they keep a
    recurrent cache), and every linear-attention, short-convolution and Mamba mixer it has holds a
    causal Conv1d (LFM2's short convolution is not marked stateful). Or outside the masks: a sparse-attention
    indexer picks each query's keys inside the layer, over the whole row (`selects_keys`)."""
    has_conv = any(isinstance(m, nn.Conv1d) for m in layers.modules())
    return has_conv or bool(getattr(type(skeleton), "_is_stateful", False)) or selects_keys(layers, runs_without_grad)


def _find_base(skeleton: nn.Module, embed: nn.Module) -> nn.Module:
    """The decoder body: the module that directly owns the input embedding."""
    for module in skeleton.modules():
        if any(child is embed for child in module.children()):
            return module
    raise ModelNotSupportedError(f"'{skeleton.config.model_type}': cannot find the module that owns the embedding "
                                 f"in {type(skeleton).__name__}; this family cannot be trained yet")


def _find_layers(base: nn.Module, config: PretrainedConfig, skeleton: nn.Module) -> str:
    """The ModuleList of decoder layers: the direct child list with one entry per hidden layer."""
    n = getattr(config.get_text_config(), "num_hidden_layers", None)
    lists = [name for name, c in base.named_children() if isinstance(c, nn.ModuleList) and len(c) == n]
    nested = [name for name, c in skeleton.named_modules() if isinstance(c, nn.ModuleList) and len(c) == n]
    if not lists and len(nested) == 1:
        embed = next(name for name, m in skeleton.named_modules() if m is skeleton.get_input_embeddings())
        raise ModelNotSupportedError(
            f"'{config.model_type}': its decoder layers (`{nested[0]}`) and its input embedding (`{embed}`) are not "
            "both children of one body module; mt-ray streams a layer list or an embedding nested in a container of "
            "the body for text models only; this image-text family cannot be trained yet"
        )
    if len(lists) != 1:
        raise ModelNotSupportedError(
            f"'{config.model_type}' does not have a decoder-only layout: expected one list of {n} decoder layers "
            f"beside the input embedding (in {type(base).__name__}), found {lists or 'none'}"
        )
    return lists[0]


def _split_body(base: nn.Module, embed: nn.Module, layers_attr: str,
                model_type: str) -> tuple[str | None, tuple[str, ...], tuple[str, ...], TailCode | None]:
    """The body's final norm (None where it has none or ends in code of its own), the parameterised children it runs
    before its layers, and those its code after them uses, with that code.

    Which side of the layers a child runs on is read from the body's forward: where it is first named
    (`self.wpe`) against where the layer list is. Those before join the embed unit (the layer context checks
    that they run before the first layer); after the layers, the head unit streams the norm, or the body's own code
    there with the modules it uses (`stream_tail.split_tail`); refused where that code leaves one out."""
    rest = [name for name, c in base.named_children()
            if c is not embed and name != layers_attr and any(True for _ in c.parameters())]
    source = inspect.getsource(type(base).forward)
    layers_at = _named_at(source, layers_attr)
    before = [n for n in rest if layers_at is not None and (first_use(type(base), n) or len(source)) < layers_at]
    after = [n for n in rest if n not in before]
    if len(after) == 1 and _is_norm(getattr(base, after[0])):
        return after[0], tuple(before), (), None
    if after:
        return None, tuple(before), tuple(after), split_tail(base, layers_attr, after, model_type)
    norms = [name for name, c in base.named_children() if _is_norm(c) and name not in before]
    return (norms[0] if len(norms) == 1 else None), tuple(before), (), None


def _named_at(source: str, attr: str) -> int | None:
    """Where `source` first names `self.<attr>` (None where it never does)."""
    found = re.search(rf"self\.{re.escape(attr)}\b", source)
    return found.start() if found else None


def _layer_ties(skeleton: nn.Module, head: nn.Module, names: dict[int, str], layers: nn.ModuleList,
                shared: set[str]) -> dict[str, str]:
    """Weights transformers ties between decoder layers (Zamba's and Zamba2's shared transformer block: one set of
    weights inside several layers, stored once by `save_pretrained`): each tied name -> the name it is.

    The owner must sit in an earlier layer than every mirror of it, so its gradient is complete when the backward
    (last layer first) reaches it; a tie within the head unit (`shared`: BERT's decoder bias) is one entry of it; any
    other tie (between the embedding and a layer, ...) is refused."""
    head_weight = f"{names[id(head)]}.weight"
    tied = {t: s for t, s in (getattr(skeleton, "all_tied_weights_keys", None) or {}).items()
            if t != head_weight and t not in shared}
    prefix = f"{names[id(layers)]}."

    def layer_of(name: str) -> int | None:
        index = name[len(prefix):].split(".", 1)[0] if name.startswith(prefix) else ""
        return int(index) if index.isdigit() else None

    bad = [(t, s) for t, s in tied.items()
           if layer_of(t) is None or layer_of(s) is None or not layer_of(s) < layer_of(t) or s in tied]
    if bad:
        target, source = bad[0]
        raise ModelNotSupportedError(
            f"'{skeleton.config.model_type}' ties weights other than between an earlier and a later decoder layer "
            f"({len(bad)} tensors, e.g. {target} is {source}), which mt-ray does not stream as one tensor; this "
            "family cannot be trained yet"
        )
    return tied


def _is_norm(module: nn.Module) -> bool:
    """A norm by its class (`LayerNorm`, `Lfm2RMSNorm`, ...); a position embedding is not one."""
    return "norm" in type(module).__name__.lower() and not isinstance(module, nn.Embedding)


def _reject_unknown_parameters(skeleton: nn.Module, owners: list[nn.Module], vision: VisionSpec | None = None) -> None:
    """Parameters outside the units' modules (`owners`) would silently never train, and saved buffers outside
    them would never load: refuse such a model instead."""
    if vision is not None:
        owners += [vision.outer.get_submodule(p)
                   for p in (vision.tower_path, *vision.projector_paths, *vision.held_paths) if p is not None]
    known = {id(t) for m in owners for t in (*m.parameters(), *m.buffers())}
    if vision is not None:
        known |= {id(t) for t in (*vision.outer.parameters(recurse=False), *vision.outer.buffers(recurse=False))}
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
