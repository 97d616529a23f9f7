"""The language model's side of an image-text model: the composite body's own forward around the decoder body.

The layer context (`context.py`) records the decoder layers' arguments by running the composite body's forward,
so the image scatter and everything else it does before the language model run as transformers defines them.
Here that forward is given: the decoder body's recording copy where it calls the decoder body; a feed of what the
vision stage computed where it calls `get_image_features`; the projectors it applies itself (Llama 4's
`multi_modal_projector`, outside `get_image_features`), run with the projector unit's weights that the vision
stage hands over with the features, so their gradient flows back through the features' gradient; and, where its
language model is a whole causal LM (Llama 4's), a head that passes the decoder body's output through, since the
head unit computes the logits.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from mt_ray.models.discovery import ModelSpec, meta_free_buffers_to
from mt_ray.models.nesting import reads_device, with_submodules


class ImageFeatures:
    """Stands in for the composite body's `get_image_features`: returns what the vision stage computed.

    Where the body's forward applies projectors itself (`VisionSpec.forward_projectors`), the vision stage hands
    their weights over with the features, as `(features, {name: tensor})`: `weights` holds them for the stand-ins.
    """

    def __init__(self, forward_projectors: list[str]):
        self.handed = bool(forward_projectors)
        self.pending: Any = None
        self.weights: dict[str, torch.Tensor] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.pending

    def feed(self, features: Any) -> None:
        """What the next calls return (None: nothing, after a recording)."""
        self.pending, self.weights = features if self.handed and features is not None else (features, {})


class _ForwardProjector(nn.Module):
    """Stands in for a projector the body's forward applies itself: runs it with the handed-over weights (names under
    `path.`, relative to the composite body)."""

    def __init__(self, original: nn.Module, path: str, images: ImageFeatures):
        super().__init__()
        self.__dict__["_original"] = original  # not a submodule: its meta parameters must not show
        self.prefix = f"{path}."
        self.images = images

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        n = len(self.prefix)
        weights = {k[n:]: v for k, v in self.images.weights.items() if k.startswith(self.prefix)}
        return functional_call(self._original, weights, args, kwargs, tie_weights=False)


def language_side(spec: ModelSpec, body: nn.Module, images: ImageFeatures, device: torch.device) -> nn.Module:
    """A copy of the composite body that runs `body` (the decoder body's recording copy) in the decoder body's place,
    fed `images` (see the module docstring)."""
    vision = spec.vision
    outer = vision.outer
    paths = {id(m): n for n, m in outer.named_modules()}
    parts: dict[str, nn.Module] = {paths[id(spec.base)]: body}
    parts.update({p: _ForwardProjector(meta_free_buffers_to(outer.get_submodule(p), device), p, images)
                  for p in vision.forward_projectors})
    if vision.causal_lm_path is not None:  # the head unit computes the logits
        parts[paths[id(spec.skeleton.get_output_embeddings())]] = nn.Identity()
    module = reads_device(with_submodules(outer, parts), device)
    module.get_image_features = images
    return module
