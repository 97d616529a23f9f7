"""Run the model's own body code around the layers, so every family gets its masks and rotary
tables exactly as transformers computes them.

Instead of re-implementing each family's forward (Gemma's embedding scale, Falcon-H1's
embedding multiplier, sliding-window masks, per-layer-type rotary tables, packed-sequence
masks, ...), we call the body's `forward` on the token ids with its embedding replaced by a
feed of the engine's embedding output and its decoder layers replaced by stubs that record
what each layer is called with and pass the hidden state through. The recorded arguments are
the layer context: the engine replays them into the weightless layer templates.

Packed rows: attention keeps documents apart through the masks transformers builds from the
position ids, or, for backends that take document bounds instead of a mask (varlen, flash), through
the micro-batch's `cu_seq_lens` given to every layer (built once per micro-batch, on the host, and
shared by all layers: `Documents`). Linear attention, short convolutions and Mamba mixers do not (their CPU and
reference paths ignore the `cu_seq_lens` / `seq_idx` boundaries of transformers'
padding-free path), nor do the masks of a body that builds them without the position ids
(GPT-OSS). For such models (`ModelSpec.isolate_documents`, or a probe of the masks at start)
each document gets its own context and runs through each layer alone: exactly what it
computes unpacked.

Image-text models: the body is the composite model (`Qwen2_5_VLModel`, ...), whose forward
embeds the tokens, asks its `get_image_features` for the image features (here: a feed of what
the engine's vision stage computed) and scatters them over the image tokens, exactly as
transformers does; multi-dimensional rotary positions come from the family's own
`get_rope_index`, document by document (`document_images`). Where documents run alone, each takes its own
images and the features of its own `get_image_features` call to the body. A body that adds to the hidden state
between its layers (deepstack: features of intermediate vision blocks added at the image tokens after each of
Qwen3-VL's first layers, before chosen layers of Granite 4 Vision) has that addition taken out of the recording and handed to the engine as the context's
`Injection`, which it runs with those layers (forward and recompute alike) and sends the injected tensors'
gradients back through. Any other change between layers is refused: the engine would not replay it.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from mt_ray.errors import ModelNotSupportedError
from mt_ray.models import nesting
from mt_ray.models.deepstack import Injection, deepstack_tap
from mt_ray.models.discovery import ModelSpec, embed_module, meta_free_buffers_to
from mt_ray.models.document_images import DocumentImages, Image, Span
from mt_ray.models.handoff import Handoff, hand_on, nested_handoff, plan_handoffs
from mt_ray.models.packing_probe import beyond_probe, packed_differs, reads_row_index, same_arguments
from mt_ray.models.side_channels import SideChannel, open_side_channels, side_channels
from mt_ray.models.stream_tail import Stream, TailReached, capture, measure
from mt_ray.models.tail_module import check_per_token
from mt_ray.models.varlen import takes_document_bounds
from mt_ray.models.vision import moe_token_types
from mt_ray.models.vision_feed import ImageFeatures, language_side

logger = logging.getLogger(__name__)

LayerKwargs = dict[str, Any]


@dataclass
class Documents:
    """Where the documents of a micro-batch lie in its flattened [B*T] tokens (position-id restarts)."""

    spans: list[Span]  # each document's [start, end), on the host
    cu_seq_lens: torch.Tensor  # int32 [documents + 1] on the device: each document's start, then B*T
    max_length: int  # the longest document
    images: list[Image | None] | None = None
    """Each document's own images (None: it has none), where documents run alone through an image-text model's
    layers (`DocumentImages.per_document`)."""
    token_types: torch.Tensor | None = None
    """[B, T] the `token_type_ids` of a body that reads a prefix from them (PaliGemma's), each document marked as its
    processor marks it alone (`DocumentImages.token_types`); None for others (image marks follow from the ids)."""

    def flash_kwargs(self) -> LayerKwargs:
        """The bounds as transformers' flash path (and the varlen backend) takes them from a layer's arguments."""
        return {"cu_seq_lens_q": self.cu_seq_lens, "cu_seq_lens_k": self.cu_seq_lens,
                "max_length_q": self.max_length, "max_length_k": self.max_length}


@dataclass
class LayerContext:
    """What the decoder layers of one micro-batch are called with.

    `whole[i]`: layer i's keyword arguments for the whole [B, T] batch; or, when documents run
    alone, `documents`: each document's span in the flattened batch and its per-layer arguments.
    `injection`: what the body adds between its layers (`deepstack`; None for most bodies).
    """

    whole: list[LayerKwargs] | None = None
    documents: list[tuple[Span, list[LayerKwargs]]] | None = None
    injection: Injection | None = None
    carried: list[tuple[str, ...]] = field(default_factory=list)
    """Each layer's arguments that carry a gradient back to the embedding (`LayerContextBuilder.carried`)."""
    input_grads: dict[tuple[int, int, str], torch.Tensor] = field(default_factory=dict)
    """The gradient each layer's backward found for its carried arguments, by (document, layer, name)."""
    model_type: str = ""
    stream: Stream = field(default_factory=Stream)
    """How the layers lay out the stream the engine keeps token-major ([B, T, ...])."""
    channels: list[SideChannel] = field(init=False)
    """What layers leave for later layers (Gemma 3n's shared keys and values: `side_channels`)."""

    def __post_init__(self) -> None:
        self.channels = side_channels(self.whole or [kw for _, kws in self.documents or () for kw in kws])
        self.handoffs = plan_handoffs(self.whole or self.documents[0][1])

    def run(self, layer: Callable[..., Any], i: int, x_BTD: torch.Tensor) -> torch.Tensor:
        """Layer i's output hidden state (with what the body adds after it), for the whole batch or document by document."""
        for channel in self.channels:
            channel.layer = i
        if self.documents is None:
            out = hand_on(self.handoffs, i, layer(self.stream.to_layers(x_BTD), **self.whole[i]), self.whole,
                          self.model_type)  # what it hands later layers goes into their arguments
            out = self.stream.to_tokens(layer_hidden(out))
            return self.injection.add(out, self.injection.mask_BT, self.injection.embeds[i]) if self.injects(i) else out
        x_1ND = x_BTD.flatten(0, 1)[None]  # [1, B*T, ...]: a widened stream keeps its per-token shape
        to_layer, to_tokens = self.stream.to_layers, self.stream.to_tokens
        outs = [to_tokens(layer_hidden(hand_on(self.handoffs, i, layer(to_layer(x_1ND[:, s:e]), **kw[i]), kw,
                                               self.model_type))) for (s, e), kw in self.documents]
        return torch.cat(outs, dim=1).view_as(x_BTD)

    def injects(self, i: int) -> bool:
        return self.injection is not None and i in self.injection.embeds

    def track_injection(self, i: int) -> torch.Tensor | None:
        """What is added after layer i, made a leaf that takes a gradient (for layer i's backward); None if nothing is."""
        if not self.injects(i):
            return None
        leaf = self.injection.embeds[i] = self.injection.embeds[i].detach().requires_grad_()
        return leaf

    def track_inputs(self, i: int) -> list[tuple[tuple[int, int, str], torch.Tensor]]:
        """Layer i's carried arguments (Zamba's `original_hidden_states`, the embedding's output again), each made a
        leaf that takes a gradient (for layer i's backward), with its key in `input_grads`."""
        if not self.carried or not self.carried[i]:
            return []
        leaves = []
        for d, kw in enumerate(self._kwargs_of(i)):
            for name in self.carried[i]:
                leaf = kw[name] = kw[name].detach().requires_grad_()
                leaves.append(((d, i, name), leaf))
        return leaves

    def _kwargs_of(self, i: int) -> list[LayerKwargs]:
        """Layer i's arguments: for the whole batch, or of each document."""
        return [self.whole[i]] if self.documents is None else [kw[i] for _, kw in self.documents]

    def injected_grads(self, done: LayerContext) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """What this context hands the layers beside the hidden state that takes a gradient (what it adds after
        them, recorded from image features; the carried arguments, from the embedding) and the gradients the
        layers' backward of `done` (the same micro-batch's context) found for them."""
        outputs, grads = [], []
        if self.injection is not None:
            outputs += [self.injection.embeds[i] for i in done.injection.grads]
            grads += list(done.injection.grads.values())
        for (d, i, name), g in done.input_grads.items():
            outputs.append(self._kwargs_of(i)[d][name])
            grads.append(g)
        return outputs, grads


def layer_hidden(out: Any) -> torch.Tensor:
    """Decoder layers return a tensor in most transformers 5 families, a tuple in others (a list in OpenAI GPT's)."""
    return out[0] if isinstance(out, (tuple, list)) else out


class _StandIn(nn.Module):
    """Base of the modules put into the body in place of its own: an attribute the stand-in lacks is read off
    the (weightless) module it replaces, so a body reading `block_type` (NemotronH), `attention_type` or an
    embedding's `.weight` (Llama 4) finds what it would find on the real module."""

    def __init__(self, original: nn.Module):
        super().__init__()
        self.__dict__["_original"] = original  # not a submodule: its meta parameters must not show

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_original"], name)


class _EmbeddingFeed(_StandIn):
    """Stands in for the input embedding: returns the output the engine computed with its weights."""

    def __init__(self, original: nn.Module, model_type: str):
        super().__init__(original)
        self.pending: torch.Tensor | None = None
        self.bound: torch.Tensor | None = None
        self.model_type = model_type

    @property
    def weight(self) -> torch.Tensor:
        """The embed unit's weight while recording, where the body reads rows off it (Gemma 4's pad embedding)."""
        return self.bound if self.bound is not None else self._original.weight

    def forward(self, input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if input_ids.shape != self.pending.shape[:-1]:
            raise ModelNotSupportedError(
                f"'{self.model_type}': its body embeds other tokens than the row's (CPM-Ant prepends prompt "
                "tokens), which mt-ray's embedding does not compute; this family cannot be trained yet")
        return self.pending


class _PreLayer(_StandIn):
    """Stands in for a module the body runs before its first layer (GPT-2's `wpe`, BLOOM's embedding norm): runs
    it with the embed unit's weights (`weights`, by the names under `attr.`), so gradients reach them through h0."""

    def __init__(self, original: nn.Module, attr: str, model_type: str, log: dict, device: torch.device):
        super().__init__(meta_free_buffers_to(original, device))
        self.attr, self.model_type, self.log = attr, model_type, log
        self.weights: dict[str, torch.Tensor] = {}

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.log:  # a layer has run: the engine would not replay this module there
            raise ModelNotSupportedError(
                f"'{self.model_type}': its body runs `{self.attr}` after its first decoder layer, where mt-ray "
                "streams it with the embedding; this family cannot be trained yet")
        if not self.weights:
            raise RuntimeError(f"`{self.attr}` runs before the first layer: the embed unit's weights must be given")
        return functional_call(self._original, self.weights, args, kwargs, tie_weights=False)

    def __getitem__(self, index: int) -> Callable[..., Any]:
        """An entry of a list the body runs before its layers (Gemma 3n's AltUp projections), with its weights."""
        prefix, entry = f"{index}.", self._original[index]
        weights = {k[len(prefix):]: v for k, v in self.weights.items() if k.startswith(prefix)}
        return lambda *args, **kwargs: functional_call(entry, weights, args, kwargs, tie_weights=False)

    def bind(self, weights: dict[str, torch.Tensor]) -> None:
        prefix = f"{self.attr}."
        self.weights = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}


class _HiddenChanged(ModelNotSupportedError):
    """The body changes the hidden state between two layers (or a stand-in returned what it does not take)."""


class _RecordingLayer(_StandIn):
    """Stands in for decoder layer `index`: records its call (every argument by name, positional ones
    too), returns the input unchanged in the shape the real layer returns (a tuple of as many values as
    its annotation names: Bamba unpacks two, GLM-MoE-DSA hands its second to the next layer)."""

    def __init__(self, index: int, log: dict[int, tuple[torch.Tensor, LayerKwargs]], template: nn.Module):
        super().__init__(template)
        self.index = index
        self.log = log
        self.arity = returned_values(template)
        self.annotated = inspect.signature(type(template).forward).return_annotation is not inspect.Signature.empty
        self.signature = inspect.signature(type(template).forward)
        self.after: Callable[[], None] | None = None

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor | tuple:
        named = self.signature.bind(self._original, *args, **kwargs).arguments
        named.pop(next(iter(self.signature.parameters)))  # self
        for name, p in self.signature.parameters.items():
            if name in named and p.kind is p.VAR_KEYWORD:
                named.update(named.pop(name))
            elif name in named and p.kind is p.VAR_POSITIONAL:
                raise TypeError("decoder layers are expected to take their context as named arguments")
        hidden_states = named.pop(next(iter(named)))
        self.log[self.index] = (hidden_states, named)
        if self.after is not None:  # the last layer of a body with code after its layers: stop there
            self.after()
        if self.arity is None:
            return hidden_states
        return (hidden_states, *(Handoff(self.index, k) for k in range(1, self.arity)))  # shows where it goes


def returns_tuple(layer: nn.Module) -> bool:
    return returned_values(layer) is not None


def returned_values(layer: nn.Module) -> int | None:
    """How many values the layer's forward returns by its annotation: None for a tensor, else the tuple's length
    (1 where it is open-ended, `tuple[torch.Tensor, ...]`: bodies then index its first)."""
    annotation = inspect.signature(type(layer).forward).return_annotation
    text = annotation if isinstance(annotation, str) else repr(annotation)
    found = re.match(r"(typing\.)?tuple\[(.*)\]$", text.strip(), re.IGNORECASE)
    if found is None:
        return 1 if re.match(r"(typing\.)?tuple\b", text, re.IGNORECASE) else None
    depth, parts = 0, 1
    for ch in found.group(2):
        depth += ch in "[(" and 1 or ch in "])" and -1 or 0
        parts += ch == "," and depth == 0
    return 1 if "..." in found.group(2) else parts


class LayerContextBuilder:
    """Turns the embedding output, token ids and position ids into (h0, the layers' `LayerContext`)."""

    def __init__(self, spec: ModelSpec, device: torch.device):
        self.log: dict[int, tuple[torch.Tensor, LayerKwargs]] = {}
        body = spec.base
        layers = body.get_submodule(spec.layers_attr)
        self.stubs = stubs = nn.ModuleList(_RecordingLayer(i, self.log, layer) for i, layer in enumerate(layers))
        embed = spec.skeleton.get_input_embeddings()
        # A copy of the body with a feed for the embedding, stubs in place of layers, the pre-layer modules run with
        # the embed unit's weights (BERT's `embeddings` around the feed) and an identity final norm (a parameterless
        # one, NanoChat's, also run before the layers, stays) and unread modules: the skeleton stays intact.
        self.feed = _EmbeddingFeed(embed, spec.config.model_type)
        embed_path = next(n for n, m in body.named_modules() if m is embed)
        self.body = nesting.with_submodules(body, {embed_path: self.feed, spec.layers_attr: stubs})
        self.pre_layer = [_PreLayer(self.body.get_submodule(a), a, spec.config.model_type, self.log, device)
                          for a in spec.embed_attrs]
        weighed = spec.norm_attr is not None and any(True for _ in body.get_submodule(spec.norm_attr).parameters())
        norm = [spec.norm_attr] if weighed else []
        passed = {a: nn.Identity() for a in (*norm, *spec.unread_attrs)}
        self.body = nesting.with_submodules(self.body, {**{p.attr: p for p in self.pre_layer}, **passed})
        self.probe_weights = _probe_weights(spec, device)
        self.stream = Stream()
        if spec.tail_code is not None:  # take what the tail reads from the forward, and leave the rest to the head
            stubs[-1].after = partial(capture, spec.tail_code, type(body).forward, self.stream.tail_values,
                                      spec.config.model_type)
        self.vision = spec.vision
        self.images = ImageFeatures(spec.vision.forward_projectors if spec.vision is not None else [])
        self.deepstack = deepstack_tap(body, len(layers))
        if self.deepstack is not None:  # the engine adds the deepstack features with the layers: record them instead
            self.body.forward = partial(self.deepstack, type(body).forward.__get__(self.body))
        if spec.vision is not None:  # the composite body around the language model runs the image scatter
            self.body = language_side(spec, self.body, self.images, device)
        self.token_types = spec.vision.image_marks if spec.vision is not None else ()
        meta_free_buffers_to(self.body, device)
        self.num_layers = len(layers)
        self.model_type = spec.config.model_type
        self.bounds_not_masks = takes_document_bounds(spec.config._attn_implementation)
        self.nested, self.own_positions = nesting.is_nested(spec.skeleton, spec.base, spec.layers_attr), False
        self._fit_stand_ins(spec, device)
        self.carried = self._carried_inputs(spec, device)
        if spec.tail_code is not None:
            check_per_token(spec, self.stream, device)
        self.own_positions = self.nested and nesting.numbers_own_positions(
            partial(self._record, self.probe_weights), embed.weight.shape[-1], device)
        self.rope_axes = self._rope_axes(embed.weight.shape[-1], device)
        # also runs the body around the stand-ins once; its rows carry no labels, so a prefix body (PaliGemma) reads
        # every token as prefix there, and one whose packed prefixes see each other runs each document alone
        exact = self._packed_rows_exact(spec, device, layers)
        self.prefix = "token_type_ids" in self.token_types and self._reads_prefix(spec, device)
        self.isolate_documents = spec.isolate_documents or not exact or self.own_positions
        if self.isolate_documents and self.deepstack is not None:
            raise ModelNotSupportedError(
                f"'{spec.config.model_type}': its documents must run through the layers one at a time and its body "
                "adds deepstack features between layers, which mt-ray replays for whole rows only; this image-text "
                "family cannot be trained yet"
            )
        self.document_images = None if spec.vision is None else DocumentImages(
            spec.vision, self.isolate_documents, text_row=self.rope_axes > spec.vision.rope_rows, prefix=self.prefix)

    def __call__(self, embeds_BTD: torch.Tensor, input_ids_BT: torch.Tensor, position_ids_BT: torch.Tensor,
                 documents: Documents, images: Image | None = None, features: list[Any] | None = None,
                 embed_weights: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, LayerContext]:
        """The hidden state that enters layer 0 and the layers' context.

        `embeds_BTD` is the input embedding's output, `embed_weights` the embed unit's bound weights (read by the
        modules the body runs before its first layer, `ModelSpec.embed_attrs`); `documents` says where the
        micro-batch's documents lie (`prepare_micro_batch` builds it). An image-text model takes [R, B, T] positions
        (`DocumentImages.rope_positions`) where it has multi-dimensional rotary positions, the micro-batch's image
        inputs (`pixel_values`, `image_grid_thw`, ...) and `features`, what each `get_image_features` call returned:
        one call for the micro-batch, or, where documents run alone, one per document with images
        (`Documents.images`, in order).
        """
        weights = embed_weights or {}
        if not self.isolate_documents:
            h0, per_layer = self._record(weights, embeds_BTD, input_ids_BT, position_ids_BT, images,
                                         features[0] if features else None, documents.token_types)
            if self.bounds_not_masks:  # one set of bounds for every layer: the body built no mask
                per_layer = [{**kw, **documents.flash_kwargs()} for kw in per_layer]
            return self.stream.to_tokens(h0), LayerContext(whole=per_layer, injection=self._take_injection(),
                                                            carried=self.carried, stream=self.stream,
                                                            model_type=self.model_type)
        B, T, D = embeds_BTD.shape
        embeds_1ND, ids_1N = embeds_BTD.reshape(1, B * T, D), input_ids_BT.reshape(1, B * T)
        positions = position_ids_BT.reshape(*position_ids_BT.shape[:-2], 1, B * T)  # [1, N] or [R, 1, N]
        own_images = documents.images or [None] * len(documents.spans)
        own_features = iter(features or ())  # one call per document with images, in order
        types_1N = documents.token_types.reshape(1, B * T) if documents.token_types is not None else None
        h0s, per_document = [], []
        for (s, e), own in zip(documents.spans, own_images, strict=True):
            h0, per_layer = self._record(weights, embeds_1ND[:, s:e], ids_1N[:, s:e], positions[..., s:e], own,
                                         next(own_features) if own is not None else None,
                                         types_1N[:, s:e] if types_1N is not None else None)
            h0s.append(self.stream.to_tokens(h0))
            per_document.append(((s, e), per_layer))
        return torch.cat(h0s, dim=1).view(B, T, *h0s[0].shape[2:]), LayerContext(
            documents=per_document, carried=self.carried, stream=self.stream, model_type=self.model_type)

    def _take_injection(self) -> Injection | None:
        return self.deepstack.take() if self.deepstack is not None else None

    def _fit_stand_ins(self, spec: ModelSpec, device: torch.device) -> None:
        """Stand-ins return what their layer's annotation says. Where a layer has none (Falcon's, RWKV's), or the
        body cannot take what it says (Zamba's hybrid layers are annotated a tuple and return a tensor), what the
        body takes is found by trying a tensor, then tuples of 1 to 4 values (the first the hidden state)."""
        unknown = [s for s in self.stubs if not s.annotated]
        hidden = spec.skeleton.get_input_embeddings().weight.shape[-1]
        row = (torch.zeros(1, 2, hidden, device=device), torch.zeros(1, 2, dtype=torch.long, device=device),
               torch.arange(2, device=device)[None])
        if not unknown:
            if self._records(row):
                return
            unknown = list(self.stubs)
        annotated = [s.arity for s in self.stubs]
        for arity in (None, 1, 2, 3, 4):
            for stub in unknown:
                stub.arity = arity
            if self._records(row):
                return
        for stub, arity in zip(self.stubs, annotated, strict=True):  # nothing fits: the annotation's refusal shows
            stub.arity = arity

    @contextlib.contextmanager
    def _stand_ins_run(self) -> Iterator[None]:
        """A body that cannot run around the stand-ins (a config value its own code needs and the layers do not
        read, a layer that takes unnamed arguments, a layer output read by field: Reformer's two streams) is refused
        by name."""
        try:
            yield
        except ModelNotSupportedError:
            raise
        except (TypeError, ValueError, AttributeError) as e:
            raise ModelNotSupportedError(
                f"'{self.model_type}': its body does not run with mt-ray's layer stand-ins ({type(e).__name__}: {e}); "
                "its decoder layers do not return what their annotation says, or take unnamed arguments; this "
                "family cannot be trained yet"
            ) from None

    def _carried_inputs(self, spec: ModelSpec, device: torch.device) -> list[tuple[str, ...]]:
        """Each layer's arguments computed from the embedding's output or the embed unit's weights (Zamba hands every
        layer the embedding's output beside the hidden state): the engine sends their gradients back to it. Found by
        recording once with an embedding output that takes a gradient."""
        hidden = spec.skeleton.get_input_embeddings().weight.shape[-1]
        # Not a leaf: a body may scale it in place (CTRL's).
        embeds = torch.zeros(1, 2, hidden, device=device, requires_grad=True).clone()
        weights = {k: v.detach().requires_grad_() if v.is_floating_point() else v for k, v in self.probe_weights.items()}
        with torch.enable_grad(), self._stand_ins_run():
            h0, per_layer = self._record(weights, embeds, torch.zeros(1, 2, dtype=torch.long, device=device),
                                        torch.arange(2, device=device)[None])
        measure(self.stream, h0, (1, 2), self.model_type)  # the stream between the layers (`stream_tail`)
        nested = [(i, k) for i, kw in enumerate(per_layer) for k, v in kw.items()
                  if isinstance(v, (tuple, list, dict)) and _takes_grad(v)]
        if nested:
            raise ModelNotSupportedError(
                f"'{self.model_type}': its body hands decoder layer {nested[0][0]} a structure holding tensors computed "
                f"from the embedding (`{nested[0][1]}`), whose gradient mt-ray does not send back; this family cannot "
                "be trained yet")
        return [tuple(k for k, v in kw.items() if _takes_grad(v)) for kw in per_layer]

    def _records(self, row: tuple[torch.Tensor, ...]) -> bool:
        """Whether the body runs around the stand-ins as they are (a refusal of the body's own counts as running:
        the probe repeats it)."""
        try:
            self._record(self.probe_weights, *row)
        except _HiddenChanged:
            return False
        except ModelNotSupportedError:
            return True
        except (TypeError, ValueError, IndexError, RuntimeError, AttributeError):  # RuntimeError: a tensor taken
            # for a tuple; AttributeError: a field read off what the layer returns
            return False
        return True

    def _rope_axes(self, hidden: int, device: torch.device) -> int:
        """The rows of positions the body takes (0: [B, T]): text positions, where it reads them (Qwen-VL: they keep
        packed documents apart; HunYuan-VL refuses them), then the rows of `get_rope_index`."""
        rows = self.vision.rope_rows if self.vision is not None else 0
        row = (torch.zeros(1, 2, hidden, device=device), torch.zeros(1, 2, dtype=torch.long, device=device),
               torch.arange(2, device=device).expand(rows + 1, 1, 2))
        return rows + 1 if rows and self._records(row) else rows

    def _packed_rows_exact(self, spec: ModelSpec, device: torch.device, layers: nn.ModuleList) -> bool:
        """Whether a packed row's documents reach the layers, and are computed there, as they would be alone
        (`packing_probe`): no layer computes from the row's own index, no threshold is past the probe's rows, and
        every layer's arguments for a packed document are its own."""
        hidden = spec.skeleton.get_input_embeddings().weight.shape[-1]
        with self._stand_ins_run():
            differs = packed_differs(lambda *row: self._record(self.probe_weights, *row), spec.config, hidden, device,
                                     self.rope_axes, masks=not self.bounds_not_masks,
                                     learned_positions=bool(self.pre_layer))
        row = (torch.zeros(1, 2, hidden, device=device), torch.zeros(1, 2, dtype=torch.long, device=device),
               torch.arange(2, device=device).expand(*([self.rope_axes, 1] if self.rope_axes else [1]), 2))
        given = {k for kw in self._record(self.probe_weights, *row)[1] for k in kw}  # what the layers are handed
        why = f"{differs} differs for a document packed with others" if differs is not None else \
            reads_row_index(layers, given) or beyond_probe(spec.config)
        if why is not None:
            logger.info("'%s': %s, so each document of a packed row runs alone", self.model_type, why)
        return why is None

    def _reads_prefix(self, spec: ModelSpec, device: torch.device) -> bool:
        """Whether the body reads token type 0 as a prefix that attends both ways (PaliGemma: the image and the
        prompt), where Gemma 3's reads 1 as an image's tokens that do: a text-only row, all 0, then changes the layers'
        arguments from those of the row with no types at all."""
        hidden = spec.skeleton.get_input_embeddings().weight.shape[-1]
        row = (torch.zeros(1, 4, hidden, device=device), torch.zeros(1, 4, dtype=torch.long, device=device),
               torch.arange(4, device=device).expand(*([self.rope_axes, 1] if self.rope_axes else [1]), 4))
        _, marked = self._record(self.probe_weights, *row)
        marks, self.token_types = self.token_types, ()
        try:
            _, plain = self._record(self.probe_weights, *row)
        finally:
            self.token_types = marks
        return not same_arguments(marked, plain, 4)

    def _record(self, weights: dict[str, torch.Tensor], embeds: torch.Tensor, input_ids: torch.Tensor,
                position_ids: torch.Tensor, images: Image | None = None, features: Any = None,
                token_types: torch.Tensor | None = None) -> tuple[torch.Tensor, list[LayerKwargs]]:
        """The hidden state entering layer 0 and each layer's arguments, recorded from one call of the body.
        `token_types`: the micro-batch's (`Documents.token_types`); probe rows, which have none, are marked as a
        processor marks text without images or labels (all 0: no image; for a prefix body, all prefix)."""
        self.log.clear()
        if self.deepstack is not None:
            self.deepstack.take()  # what an earlier recording left
        self.feed.pending, self.feed.bound = embeds, weights.get("weight")
        self.images.feed(features)
        for pre in self.pre_layer:
            pre.bind(weights)
        extra = {**(images or {}), **self._token_types(input_ids, token_types)}
        try:
            out = None
            with contextlib.suppress(TailReached):  # a body with code after its layers stops at the last (`stream_tail`)
                out = self.body(input_ids=input_ids, position_ids=None if self.own_positions else position_ids,
                                use_cache=False, **extra)
        finally:
            self.feed.pending = self.feed.bound = None
            self.images.feed(None)
            for pre in self.pre_layer:
                pre.weights = {}
        if len(self.log) != self.num_layers:
            raise RuntimeError(f"body called {len(self.log)} of {self.num_layers} layers")
        # The stubs hand their input on (in a tuple where the annotation says so, which some bodies pass on as
        # it is): a layer that receives anything else received what the body itself changed.
        changed = [i for i in range(1, self.num_layers) if layer_hidden(self.log[i][0]) is not self.log[i - 1][0]]
        if changed:
            raise _HiddenChanged(
                f"'{self.model_type}': its body changes the hidden state between decoder layers {changed[0] - 1} and "
                f"{changed[0]}, which mt-ray does not replay; this family cannot be trained yet"
            )
        handed = [(i, k) for i in range(self.num_layers) for k, v in self.log[i][1].items() if nested_handoff(v)]
        if handed:
            raise ModelNotSupportedError(
                f"'{self.model_type}': its body hands what a decoder layer returns beside the hidden state to layer "
                f"{handed[0][0]} inside a structure (`{handed[0][1]}`), which mt-ray does not replay; this family "
                "cannot be trained yet"
            )
        if self.nested and out is not None:
            nesting.check_hands_back(self.model_type, out, layer_hidden(self.log[self.num_layers - 1][0]))
        h0 = self.log[0][0]
        per_layer = [dict(self.log[i][1]) for i in range(self.num_layers)]
        open_side_channels(per_layer)
        for kw in per_layer:
            kw.pop("past_key_values", None)
            if "use_cache" in kw:
                kw["use_cache"] = False
        self.log.clear()
        return h0, per_layer

    def _token_types(self, input_ids: torch.Tensor, token_types: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """The per-token types the body reads beside the ids: each of `self.token_types` marked as a processor marks
        text without labels (1 at image tokens), `token_type_ids` the micro-batch's where it has them (PaliGemma's
        prefixes), and ERNIE-VL's `moe_mm_token_type_ids`."""
        types = dict.fromkeys(self.token_types, (input_ids == self.vision.image_token_id).long()) \
            if self.token_types else {}
        if token_types is not None:
            types["token_type_ids"] = token_types
        if self.vision is not None and self.vision.moe_types:
            types["moe_mm_token_type_ids"] = moe_token_types(self.vision, input_ids)
        return types


def _probe_weights(spec: ModelSpec, device: torch.device) -> dict[str, torch.Tensor]:
    """Weights for the pre-layer modules while probing: random, so that a position they add shows (saved buffers
    are the skeleton's own, real ones); the embedding's own weight as zeros that take no memory (a body may read a
    row of it: `_EmbeddingFeed.weight`)."""
    g = torch.Generator().manual_seed(0)
    module = embed_module(spec)
    saved = module.state_dict(keep_vars=True)
    table = spec.skeleton.get_input_embeddings().weight
    return {"weight": torch.zeros((), dtype=table.dtype, device=device).expand(table.shape)} | {
        p.local_name: (torch.randn(p.shape, generator=g) if saved[p.local_name].is_meta
                       else saved[p.local_name]).to(device)
        for p in spec.unit("embed").params if p.local_name.startswith(tuple(f"{a}." for a in spec.embed_attrs))}


def _takes_grad(value: Any) -> bool:
    if isinstance(value, dict):
        return any(_takes_grad(v) for v in value.values())
    if isinstance(value, (tuple, list)):
        return any(_takes_grad(v) for v in value)
    return isinstance(value, torch.Tensor) and value.requires_grad


def document_spans(position_ids_BT: torch.Tensor) -> list[Span]:
    """Spans of the documents in the flattened batch: one starts at each row's start and wherever the
    position does not follow on from the previous one (transformers' `find_packed_sequence_indices`
    rule). Call it on the host tensor: on a device tensor it would wait for the device."""
    B, T = position_ids_BT.shape
    starts_BT = torch.ones_like(position_ids_BT, dtype=torch.bool)
    starts_BT[:, 1:] = position_ids_BT[:, 1:] != position_ids_BT[:, :-1] + 1
    starts = [*starts_BT.reshape(-1).nonzero().squeeze(1).tolist(), B * T]
    return list(zip(starts[:-1], starts[1:], strict=True))
