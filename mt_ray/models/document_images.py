"""Which of a packed row's images each document holds, and what follows from it.

A micro-batch's images come in token order, row after row (`prepare_micro_batch`), and a processor writes each
image's tokens as one run of image tokens: a document holds as many images as it has runs, in order (PaliGemma's
writes a document's images as one run, each image a fixed number of its tokens). Two things
need that split. Multi-dimensional rotary positions: the family's `get_rope_index` numbers one unpacked document
from its own image grids. And documents that run through the layers alone (`LayerContextBuilder.isolate_documents`:
linear attention, convolutions): each takes its own images to the body, and the vision stage computes each
document's image features by a `get_image_features` call of its own, as transformers computes them for the
document alone, so that no family's feature layout has to be cut apart afterwards.

A body that reads `token_type_ids` takes them as its family's processor marks one document. Image marks (Gemma 3's
image tokens, which attend to each other both ways) follow from the ids alone, and the layer context makes them. A
prefix does not: PaliGemma's mark each document's prefix 0 (its image, the bos token and the prompt, which attend to
each other both ways) and its suffix 1 (the answer, causal). Its processor tokenizes the prompt and the suffix as a
text pair and labels the suffix alone, so the prefix is what comes before the document's first labelled token, and
the engine marks it per document on the host (`DocumentImages.token_types`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mt_ray.errors import DatasetError
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
    prefix: bool = False
    """The body reads token type 0 as a prefix that attends both ways (PaliGemma), where Gemma 3's reads 1 as an
    image's tokens that do."""

    def token_types(self, input_ids_BT: torch.Tensor, labelled_BT: torch.Tensor | None,
                    spans: list[Span]) -> torch.Tensor | None:
        """[B, T] the `token_type_ids` of a prefix body (`prefix`; None for others, whose image marks the layer
        context makes from the ids): 0 before each document's first labelled token (`labelled_BT`: its label is not
        ignored) and 1 from it on. A document whose image lies past its prefix, or a micro-batch without labels, has
        no prefix as PaliGemma's processor marks it: refused, never trained on another mask."""
        if not self.prefix:
            return None
        is_image_BT = input_ids_BT == self.vision.image_token_id
        family = self.vision.outer.config.model_type
        if labelled_BT is None:
            raise DatasetError(f"'{family}' attends both ways over each document's prefix, which its labels mark (the "
                               "prompt's are -100), and this micro-batch has none; give its rows labels")
        types_N = suffix_mask(labelled_BT.reshape(-1), spans)
        late = (types_N & is_image_BT.reshape(-1)).nonzero()
        if late.numel():
            t = int(late[0])
            span = next(span for span in spans if span[0] <= t < span[1])
            raise DatasetError(
                f"'{family}': the document at tokens {span} has an image token at {t}, after its first labelled "
                "token: its images must lie in its prefix (the tokens before the answer, labelled -100), as its "
                "processor writes them")
        return types_N.long().view_as(input_ids_BT)

    def split(self, input_ids_BT: torch.Tensor, spans: list[Span], images: list[Image]) -> list[list[Image]] | None:
        """Each document's images, in span order; None where nothing reads the split (no images, or documents that
        run together without multi-dimensional rotary positions: a family may write an image as several runs)."""
        if not images or not (self.per_document or self.vision.rope_index):
            return None
        is_image = (input_ids_BT == self.vision.image_token_id).reshape(-1)
        out, taken = [], 0
        for s, e in spans:
            n = self.images_in(is_image[s:e])
            out.append(images[taken:taken + n])
            taken += n
        if taken != len(images):
            raise ValueError(f"the micro-batch holds {len(images)} images but its image tokens make {taken}: each "
                             "image's tokens must be one run (or, where the family fixes them, as many as it fixes), "
                             "in the images' order")
        return out

    def images_in(self, is_image_T: torch.Tensor) -> int:
        """How many images a document's [T] image-token mask holds: one per run, or its image tokens over what each
        image fills, where the family fixes that (`VisionSpec.tokens_per_image`)."""
        per = self.vision.tokens_per_image
        return int(is_image_T.sum()) // per if per else image_runs(is_image_T)

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


def suffix_mask(labelled_N: torch.Tensor, spans: list[Span]) -> torch.Tensor:
    """[N] True from each document's first labelled token on (its suffix), False before it (its prefix)."""
    seen_N = labelled_N.long().cumsum(0)
    before_N = torch.zeros_like(seen_N)  # labelled tokens before each token's document
    for s, e in spans:
        before_N[s:e] = seen_N[s - 1] if s else 0
    return seen_N > before_N
