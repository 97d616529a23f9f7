"""Packs tokenized examples into rows and collates rows into tensors.

A row is a run of segments: each example is one segment and the tail padding is one
more. ``position_ids`` restart at 0 at every segment, which is how Hugging Face's
``masking_utils`` finds the boundaries (when no ``attention_mask`` and no KV cache is
passed) and keeps attention inside each example. ``segment_ids`` number the segments
(0, 1, ...; the padding is the last); they equal what ``find_packed_sequence_indices``
derives from the position ids, for code that builds its own mask.

Labels are unshifted and the first label of every segment is -100 (so the last token of
one example is never trained to predict the first token of the next); padding labels
are -100.

Rows of preference sequences also carry ``seq_role``: ``LongTensor[B, S]``, the ``ROLE_*`` of each
segment of each row (S the most segments of any row; the padding segment and the columns past a row's
last sequence are ``ROLE_SFT``), so the loss knows which sequence is chosen, rejected or a KL twin.

Rows with images also carry ``images``: per row, the processor's tensors of each image, in
the order of their tokens (a list, not a tensor: images differ in size). Packing keeps them
correct: an image's tokens stay in its example, and multi-dimensional rotary positions are
computed document by document.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mt_ray.data.schema import IGNORE_INDEX, ROLE_SFT, TokenizedExample

BATCH_KEYS = ("input_ids", "labels", "position_ids", "segment_ids")


def pack_first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Group example indices into bins of at most ``capacity`` tokens, longest first.

    Within a bin, examples keep their original order. Deterministic for given lengths.
    """
    bins: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if lengths[i] > capacity:
            raise ValueError(f"example of {lengths[i]} tokens does not fit in {capacity}")
        for b, room in enumerate(free):
            if lengths[i] <= room:
                bins[b].append(i)
                free[b] -= lengths[i]
                break
        else:
            bins.append([i])
            free.append(capacity - lengths[i])
    return [sorted(b) for b in bins]


def build_row(examples: Sequence[TokenizedExample], length: int, pad_id: int) -> dict[str, list[int]]:
    """Concatenate ``examples`` into one row of ``length`` tokens, padding the tail."""
    row: dict[str, list[int]] = {key: [] for key in BATCH_KEYS}
    for segment, example in enumerate(examples):
        row["input_ids"] += example.input_ids
        row["labels"] += example.labels
        row["position_ids"] += range(len(example))
        row["segment_ids"] += [segment] * len(example)
    pad = length - len(row["input_ids"])
    if pad < 0:
        raise ValueError(f"examples hold {length - pad} tokens, more than the row length {length}")
    row["input_ids"] += [pad_id] * pad
    row["labels"] += [IGNORE_INDEX] * pad
    row["position_ids"] += range(pad)
    row["segment_ids"] += [len(examples)] * pad
    return row


def row_images(examples: Sequence[TokenizedExample]) -> list[dict]:
    """The images of a row's examples, in token order."""
    return [image for example in examples for image in example.images]


def collate(rows: Sequence[Sequence[TokenizedExample]], length: int | None, pad_id: int) -> dict[str, Any]:
    """Stack rows into ``LongTensor[B, T]``s; ``length=None`` pads to the longest row."""
    if length is None:
        length = max(sum(len(e) for e in row) for row in rows)
    built = [build_row(row, length, pad_id) for row in rows]
    batch = {key: torch.tensor([b[key] for b in built], dtype=torch.long) for key in BATCH_KEYS}
    if any(e.role != ROLE_SFT for row in rows for e in row):
        roles = [[e.role for e in row] for row in rows]
        width = max(len(r) for r in roles) + 1  # the padding segment has a column too
        batch["seq_role"] = torch.tensor([r + [ROLE_SFT] * (width - len(r)) for r in roles], dtype=torch.long)
    images = [row_images(row) for row in rows]
    if any(images):
        batch["images"] = images
    return batch


def count_valid_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Number of tokens that carry loss (labels != -100), to normalize the step's loss.

    Call it on the CPU batch the loader yields: on a GPU tensor it would wait for the GPU.
    """
    return int((batch["labels"] != IGNORE_INDEX).sum())
