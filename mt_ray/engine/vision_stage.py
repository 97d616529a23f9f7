"""The vision tower and projector of an image-text model, streamed through the device like the decoder layers.

For the micro-batches of a step that hold images (streaming schedule; the resident one runs the
same passes one micro-batch at a time with every unit kept):
  record     `vision.embed` up: the family's `get_image_features` runs up to the last block with the
             tower's blocks standing in, recording block 0's input and every block's arguments
             (window or full attention lengths, rotary tables: `VisionRunner`).
  blocks     each block up once, every micro-batch through it without a graph; each output is kept
             (what follows the blocks may read any of them: a feature layer, deepstack mergers).
  features   `vision.embed` and `vision.projector` up: `get_image_features` again, the blocks handing
             back their outputs; the result is what the language model's body scatters over the
             image tokens (with the projector's weights, where the body's forward applies it itself:
             Llama 4, `vision_feed.py`).
  ...        the language model's forward and backward; its embedding's backward yields the
             gradient of the image features.
  backward   unless tower and projector are both frozen: `features` again with autograd, giving
             the projector's gradient and the gradients into the kept block outputs; with a
             trainable tower, each block from the last recomputed from its kept input and run
             backward, then the record pass with autograd for `vision.embed`.
Each pass runs `get_image_features` once per call: once per micro-batch, or, where documents run through the
layers alone, once per document with images (`MicroBatch.image_calls`), each with a tape of its own.
A frozen unit is uploaded for the forward only: it sends no gradient and is never updated.

Tensor shape key: N patches (or image tokens), D vision hidden.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from mt_ray.engine.batch import MicroBatch
from mt_ray.engine.templates import UnitTemplate, Weights
from mt_ray.models.context import layer_hidden
from mt_ray.models.discovery import ModelSpec
from mt_ray.models.document_images import Image
from mt_ray.models.vision import VISION_EMBED, VISION_PROJECTOR, block_unit, is_vision_unit
from mt_ray.models.vision_context import VisionRunner, VisionTape

WeightsOf = Callable[[str], torch.Tensor]
AddGrad = Callable[[str, Sequence[torch.Tensor], bool, int], None]


def feature_leaves(features: Any) -> tuple[Any, list[torch.Tensor]]:
    """`features` (what get_image_features returns) rebuilt around fresh leaves that take a gradient, and the leaves."""
    flat, structure = pytree.tree_flatten(features)
    leaves = [t.detach().requires_grad_() if _floating(t) else t for t in flat]
    return pytree.tree_unflatten(leaves, structure), [t for t in leaves if _floating(t)]


def _calls(mbs: list[MicroBatch]) -> list[tuple[Image, list[torch.Tensor | None]]]:
    """Each `get_image_features` call of the micro-batches, in the forward's order, with its features' gradient."""
    return [call for mb in mbs for call in zip(mb.image_calls, mb.feature_grads, strict=True)]


def _floating(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


class VisionStage:
    """Computes image features for the language model and sends the vision units' gradients.

    `weights(unit)` is the engine's next upload of a unit; `add_grad(unit, grads, final, frozen_numel)`
    adds one contribution to the unit's gradient (the final one ships it; a None gradient: that tensor got none).
    """

    def __init__(self, spec: ModelSpec, templates: dict[str, UnitTemplate], device: torch.device,
                 weights: WeightsOf, add_grad: AddGrad):
        self.runner = VisionRunner(spec, device)
        self.embed = UnitTemplate(self.runner.module, spec.unit(VISION_EMBED).params, device)
        self.projector = UnitTemplate(self.runner.module, spec.unit(VISION_PROJECTOR).params, device)
        self.blocks = [block_unit(i) for i in range(self.runner.num_blocks)]
        self.block_templates = [templates[spec.unit(b).kind] for b in self.blocks]
        self.tower_trains = not spec.unit(VISION_EMBED).frozen  # the blocks freeze with it
        self.projector_trains = not spec.unit(VISION_PROJECTOR).frozen
        self.trainable = [u.name for u in spec.trainable_units if is_vision_unit(u.name)]
        self.handed = tuple(f"{p}." for p in spec.vision.forward_projectors)
        self.weights = weights
        self.add_grad = add_grad

    def plan(self) -> tuple[list[str], list[str]]:
        """The units a step with images uploads, in order of use: before the language model, and after it."""
        forward = [VISION_EMBED, *self.blocks, VISION_EMBED, VISION_PROJECTOR]
        backward = [VISION_EMBED, VISION_PROJECTOR] if self.trainable else []
        if self.tower_trains:
            backward += [*reversed(self.blocks), VISION_EMBED]
        return forward, backward

    @torch.no_grad()
    def forward(self, mbs: list[MicroBatch]) -> list[VisionTape]:
        """Sets each micro-batch's `image_features`; returns the tapes the backward needs, one per call
        (`MicroBatch.image_calls`), micro-batch after micro-batch."""
        w = self.embed.bind(self.weights(VISION_EMBED))
        calls = [images for mb in mbs for images in mb.image_calls]
        tapes = [self.runner.record(lambda images=images: self.embed(w, **images)) for images in calls]
        for i, (unit, template) in enumerate(zip(self.blocks, self.block_templates, strict=True)):
            w = template.bind(self.weights(unit))
            for tape in tapes:
                tape.outputs.append(layer_hidden(template(w, tape.block_input(i), *tape.args[i], **tape.kwargs[i])))
        weights = self._bind_features(requires_grad=False)
        taped = iter(tapes)
        for mb in mbs:
            mb.image_features = [self._features(weights, images, next(taped).outputs) for images in mb.image_calls]
        return tapes

    def backward(self, mbs: list[MicroBatch], tapes: list[VisionTape], final: bool = True) -> None:
        """From each micro-batch's `feature_grads` (set by the embedding's backward), the vision units' gradients."""
        if not self.trainable:
            return
        weights = self._bind_features(requires_grad=True)
        p_leaves = self.projector.leaves(weights) if self.projector_trains else []
        e_leaves = self.embed.leaves(weights) if self.tower_trains else []
        calls = _calls(mbs)
        last = len(calls) - 1
        for j, ((images, feature_grads), tape) in enumerate(zip(calls, tapes, strict=True)):
            outs = [o.detach().requires_grad_(self.tower_trains) for o in tape.outputs]
            with torch.enable_grad():
                features = self._features(weights, images, outs)
                flat = [t for t in pytree.tree_flatten(features)[0] if _floating(t)]
                # A frozen tower's deepstack features have a gradient but nothing trainable beneath them.
                used = [(t, g) for t, g in zip(flat, feature_grads, strict=True) if g is not None and t.requires_grad]
                inputs = [*p_leaves, *e_leaves, *(outs if self.tower_trains else [])]
                gs = torch.autograd.grad([t for t, _ in used], inputs, [g for _, g in used], allow_unused=True)
            if self.projector_trains:
                self.add_grad(VISION_PROJECTOR, gs[:len(p_leaves)], final and j == last, self.projector.frozen_numel)
            if self.tower_trains:  # vision.embed's part after the blocks; its part before them comes last
                self.add_grad(VISION_EMBED, gs[len(p_leaves):len(p_leaves) + len(e_leaves)], False, self.embed.frozen_numel)
                tape.outputs = [o.detach() for o in tape.outputs]
                tape.grads = list(gs[len(p_leaves) + len(e_leaves):])
        if self.tower_trains:
            self._backward_tower([images for images, _ in calls], tapes, final)

    def _backward_tower(self, calls: list[Image], tapes: list[VisionTape], final: bool) -> None:
        """Each block from the last, recomputed from its kept input; then the tower's part before the blocks.

        A gradient stays None where autograd finds none (SigLIP's pooling head under Gemma 3, read by neither
        side of the blocks): the optimizer leaves such a tensor as torch's AdamW does (`grad_sums`).
        """
        last = len(tapes) - 1
        for i in reversed(range(len(self.blocks))):
            template = self.block_templates[i]
            w = template.bind(self.weights(self.blocks[i]), requires_grad=True)
            if all(tape.grads[i] is None for tape in tapes):
                continue  # nothing after this block reads it (LLaVA's last layer): like torch, it is not updated
            for j, tape in enumerate(tapes):
                x = tape.block_input(i).detach().requires_grad_()
                with torch.enable_grad():
                    out = layer_hidden(template(w, x, *tape.args[i], **tape.kwargs[i]))
                    gs = torch.autograd.grad(out, [x, *template.leaves(w)], tape.grads[i])
                self.add_grad(self.blocks[i], gs[1:], final and j == last, template.frozen_numel)
                if i:
                    tape.grads[i - 1] = gs[0] if tape.grads[i - 1] is None else tape.grads[i - 1] + gs[0]
                else:
                    tape.h0_grad = gs[0]
        w = self.embed.bind(self.weights(VISION_EMBED), requires_grad=True)
        leaves = self.embed.leaves(w)
        for j, (images, tape) in enumerate(zip(calls, tapes, strict=True)):
            with torch.enable_grad():
                h0 = self.runner.record(lambda images=images: self.embed(w, **images)).h0
                # Inkling's first block takes the pixels as they are: nothing before it to train.
                gs = torch.autograd.grad(h0, leaves, tape.h0_grad, allow_unused=True) if h0.requires_grad \
                    else [None] * len(leaves)
            self.add_grad(VISION_EMBED, gs, final and j == last, self.embed.frozen_numel)

    def _features(self, weights: Weights, images: dict[str, Any], outputs: list[torch.Tensor]) -> Any:
        """What `get_image_features` returns for one call's `images`; where the body's forward applies projectors
        itself, with their weights, copied (the unit's buffer takes the next upload; the copy keeps the gradient)."""
        features = self.runner.replay(lambda: self.embed(weights, **images), outputs)
        if not self.handed:
            return features
        return features, {k: w.clone() for k, w in weights.items() if k.startswith(self.handed)}

    def _bind_features(self, requires_grad: bool) -> Weights:
        """`vision.embed` and `vision.projector` bound together: get_image_features runs both."""
        embed = self.embed.bind(self.weights(VISION_EMBED), requires_grad=requires_grad and self.tower_trains)
        projector = self.projector.bind(self.weights(VISION_PROJECTOR),
                                        requires_grad=requires_grad and self.projector_trains)
        return {**embed, **projector}
