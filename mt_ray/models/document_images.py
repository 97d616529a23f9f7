"""Which of a packed row's images each document holds, and what follows from it.

A micro-batch's images come in token order, row after row (`prepare_micro_batch`), and a processor writes each
image's tokens as one run of image tokens: a document holds as many images as it has runs, in order. Two things
need that split. Multi-dimensional rotary positions: the family's `get_rope_index` numbers one unpacked document
from its own image grids. And documents that run through the layers alone (`LayerContextBuilder.isolate_documents`:
linear attention, convolutions): each takes its own images to the body, and the vision stage computes each
document's image features by a `get_image_features` call of its own, as transformers computes them for the
document alone, so that no family's feature layout has to be cut apart afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mt_ray.models.vision import VisionSpec, rope_index

Image = dict[str, torch.Tensor]  # one image's (or a call's joined) processor tensors: pixel_values, image_grid_thw, ...
Span = tuple[int, int]  # [start, end) of one document in the flattened [B*T] batch


def collate(images: list[Image]) -> Image | None:
    """The images' tensors joined key by key, as a processor returns several images (None without images)."""
    if not images:
        return None
    return {k: torch.cat([image[k] for image in images]) for k in images[0]}


def image_runs(is_image: torch.Tensor) -> int:
    """How many runs of image tokens a document's [T] mask holds: one per image."""
    if not is_image.numel():
        return 0
    return int(is_image[0]) + int((is_image[1:] & ~is_image[:-1]).sum())


@dataclass(frozen=True)
class DocumentImages:
    """How an image-text model's images meet the documents of a packed row (host tensors in and out)."""

    vision: VisionSpec
    per_document: bool
    """Documents run through the layers alone: each takes its own images (`Documents.images`)."""
    text_row: bool = True
    """The body takes the text positions as a row before the rotary rows (Qwen-VL: they keep packed documents apart);
    HunYuan-VL's language model takes the rotary rows alone."""

    def split(self, input_ids_BT: torch.Tensor, spans: list[Span], images: list[Image]) -> list[list[Image]] | None:
        """Each document's images, in span order; None where nothing reads the split (no images, or documents that
        run together without multi-dimensional rotary positions: a family may write an image as several runs)."""
        if not images or not (self.per_document or self.vision.rope_index):
            return None
        is_image = (input_ids_BT == self.vision.image_token_id).reshape(-1)
        out, taken = [], 0
        for s, e in spans:
            n = image_runs(is_image[s:e])
            out.append(images[taken:taken + n])
            taken += n
        if taken != len(images):
            raise ValueError(f"the micro-batch holds {len(images)} images but {taken} runs of image tokens: each "
                             "image's tokens must be one run, in the images' order")
        return out

    def rope_positions(self, input_ids_BT: torch.Tensor, position_ids_BT: torch.Tensor, spans: list[Span],
                       split: list[list[Image]] | None) -> torch.Tensor | None:
        """[R, B, T] positions for a body with multi-dimensional rotary positions (None for others): the text
        positions where it takes them as a row (`text_row`), then the family's own `get_rope_index` of each document
        with images, alone (`VisionSpec.rope_rows` rows)."""
        rows = self.vision.rope_rows
        if not rows:
            return None
        rope_RBT = position_ids_BT[None].repeat(rows, 1, 1)
        rope_RN, ids_N = rope_RBT.view(rows, -1), input_ids_BT.reshape(-1)
        for (s, e), images in zip(spans, split or [[]] * len(spans), strict=True):
            if images:
                rope = rope_index(self.vision.outer, ids_N[None, s:e], self.vision.image_token_id,
                                  collate(images)["image_grid_thw"])
                rope_RN[:, s:e] = rope[:, 0]
        return torch.cat([position_ids_BT[None], rope_RBT]) if self.text_row else rope_RBT
