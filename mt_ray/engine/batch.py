"""Turning a step's micro-batches into what the device needs, with all counting done on the host.

Everything that decides shapes or normalisation (how many tokens carry loss, where they are)
is computed here from CPU tensors, so the step never has to ask the device for a number.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mt_ray.engine.preference import Sequences, add_counts, chosen_continues, sequences_of
from mt_ray.models.context import Documents, document_spans
from mt_ray.models.document_images import DocumentImages, Image, collate

IGNORE_INDEX = -100


@dataclass
class MicroBatch:
    """One micro-batch on the device. Shape key: B batch, T tokens."""

    input_ids_BT: torch.Tensor
    position_ids_BT: torch.Tensor
    loss_index: torch.Tensor  # flat indices (into B*T) of the tokens the head computes: those whose next token
    # carries loss, and with `prompt_nll` the chosen sequences' prompt tokens (ORPO's NLL as TRL takes it)
    loss_target: torch.Tensor  # the label (a chosen prompt's token: the next token) each of those tokens predicts
    num_loss_tokens: int  # tokens whose next token carries loss
    num_tokens: int
    documents: Documents  # where each document lies in the flattened batch (position-id restarts)
    images: Image | None = None  # the image inputs (pixel_values, image_grid_thw, ...), in token order; None where
    # documents run alone (`documents.images`)
    rope_position_ids: torch.Tensor | None = None  # [R, B, T] (text then) multi-dimensional rotary positions (Qwen-VL)
    image_features: list[Any] | None = None  # what each of `image_calls` returned (set by the vision stage)
    feature_grads: list[list[torch.Tensor | None]] | None = None  # per call, its features' gradient (set by the
    # embedding's backward)
    seqs: Sequences | None = None  # preference rows: where each chosen, rejected or KTO sequence is
    ref_logps: torch.Tensor | None = None  # [S] the reference's log-prob sum of each sequence; GRPO: [N] per token
    advantages: torch.Tensor | None = None  # [S] GRPO: each sequence slot's advantage (0 where no completion)
    old_logps: torch.Tensor | None = None  # [N] GRPO: the sampling policy's log-prob of each loss token
    num_selected: int = -1  # entries of `loss_index` (the loss tokens unless `prompt_nll` added prompt tokens)

    def __post_init__(self) -> None:
        if self.num_selected < 0:
            self.num_selected = self.num_loss_tokens

    @property
    def positions(self) -> torch.Tensor:
        """The position ids the body takes: [R, B, T] where it has multi-dimensional rotary positions, else [B, T]."""
        return self.position_ids_BT if self.rope_position_ids is None else self.rope_position_ids

    @property
    def image_calls(self) -> list[Image]:
        """The inputs of each `get_image_features` call: each document's own images where documents run alone (as
        transformers computes them for the document alone), else the micro-batch's in one call."""
        if self.documents.images is not None:
            return [images for images in self.documents.images if images is not None]
        return [self.images] if self.images is not None else []


def prepare_micro_batch(batch: dict[str, Any], device: torch.device,
                        images_of: DocumentImages | None = None, prompt_nll: bool = False) -> MicroBatch:
    """Shift labels (token t predicts label t+1, as transformers does) and select the loss tokens.

    `batch["images"]`, where present, holds each row's images (a list per row of the processor's
    tensors for one image); they are concatenated in token order. Preference rows carry `seq_role` (and
    `segment_ids`; with a precomputed reference, `ref_logps`), from which each sequence is indexed; GRPO rows
    add `advantages` [B, W] and, when a rollout is trained on more than once, `old_logps` (each loss token's,
    in loss-token order, as `evaluate` collected them). An image-text model's `images_of` splits the images by
    document where it needs to (its documents run alone) and gives a model with multi-dimensional rotary
    positions its [R, B, T] positions (host tensors), and a body that reads a prefix from its token types
    (PaliGemma's) its `token_type_ids`, each document marked alone. `prompt_nll` (ORPO's NLL as TRL takes it) also
    selects each chosen sequence's tokens whose next token is its prompt's, targeting that token.
    """
    input_ids = batch["input_ids"]
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, tokens], got shape {tuple(input_ids.shape)}")
    labels = batch.get("labels", input_ids)
    B, T = input_ids.shape
    position_ids = batch.get("position_ids")
    if position_ids is None:
        position_ids = torch.arange(T).expand(B, T)
    flat, index = _loss_positions(labels)
    n_loss, prompt_N = int(index.numel()), None
    if prompt_nll and "seq_role" in batch:
        flat, index, prompt_N = _with_chosen_prompts(batch, flat, index)
    pin = device.type == "cuda"
    spans = document_spans(position_ids)
    cu_seq_lens = torch.tensor([s for s, _ in spans] + [B * T], dtype=torch.int32)
    listed = [image for row in batch.get("images") or [] for image in row]  # row after row, each in token order
    split = images_of.split(input_ids, spans, listed) if images_of is not None else None
    rope = images_of.rope_positions(input_ids, position_ids, spans, split) if images_of is not None else None
    labelled = (batch["labels"] != IGNORE_INDEX) if "labels" in batch else None
    types = images_of.token_types(input_ids, labelled, spans) if images_of is not None else None
    own = [collate(d) for d in split] if split is not None and images_of.per_document else None
    images = collate(listed) if own is None else None  # documents that run alone take only their own
    seqs = sequences_of(batch["seq_role"], batch["segment_ids"], index, lambda t: _to(t, device, pin), prompt_N) \
        if "seq_role" in batch else None
    ref, advantages, old = batch.get("ref_logps"), batch.get("advantages"), batch.get("old_logps")
    if old is not None and old.numel() != index.numel():
        raise ValueError(f"old_logps holds {old.numel()} log-probs for {index.numel()} loss tokens")
    return MicroBatch(
        input_ids_BT=_to(input_ids, device, pin),
        position_ids_BT=_to(position_ids.contiguous(), device, pin),
        loss_index=_to(index, device, pin),
        loss_target=_to(flat[index], device, pin),
        num_loss_tokens=n_loss,
        num_tokens=B * T,
        documents=Documents(spans, _to(cu_seq_lens, device, pin), max(e - s for s, e in spans),
                            [_images_to(d, device, pin) for d in own] if own is not None else None,
                            _to(types, device, pin) if types is not None else None),
        images=_images_to(images, device, pin),
        rope_position_ids=_to(rope, device, pin) if rope is not None else None,
        seqs=seqs,
        ref_logps=_to(ref.reshape(-1).float(), device, pin) if ref is not None else None,
        advantages=_to(advantages.reshape(-1).float(), device, pin) if advantages is not None else None,
        old_logps=_to(old.reshape(-1).float(), device, pin) if old is not None else None,
        num_selected=int(index.numel()),
    )


def preference_counts(micro_batches: list[dict[str, Any]]) -> dict[str, int]:
    """What a preference step over `micro_batches` is normalised by (pairs, KTO examples, chosen tokens, ...), as
    the engine counts them, from the host tensors: a data-parallel worker normalises its share by the global
    batch's."""
    counts: dict[str, int] = {}
    for b in micro_batches:
        index = _loss_positions(b.get("labels", b["input_ids"]))[1]
        counts = add_counts(counts, sequences_of(b["seq_role"], b["segment_ids"], index, lambda t: t).counts)
    counts["micro_batches"] = len(micro_batches)
    return counts


def _loss_positions(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The labels shifted as transformers shifts them (token t predicts label t+1), flat, and where they carry loss."""
    shifted = torch.full_like(labels, IGNORE_INDEX)
    shifted[:, :-1] = labels[:, 1:]
    flat = shifted.reshape(-1)
    return flat, (flat != IGNORE_INDEX).nonzero().squeeze(1)


def _with_chosen_prompts(batch: dict[str, Any], flat: torch.Tensor,
                         index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The shifted targets, selected positions (in order) and prompt marks with the chosen sequences' unlabelled
    tokens added: each targets its next token, so the chosen sequence's NLL runs over its prompt as well."""
    B, T = batch["input_ids"].shape
    continues = chosen_continues(batch["seq_role"], batch["segment_ids"]).reshape(-1)
    prompt = continues & (flat == IGNORE_INDEX)
    nxt = torch.zeros_like(batch["input_ids"])
    nxt[:, :-1] = batch["input_ids"][:, 1:]
    flat = torch.where(prompt, nxt.reshape(-1), flat)
    index = (prompt | (flat != IGNORE_INDEX)).nonzero().squeeze(1)
    return flat, index, prompt[index]


def _images_to(images: Image | None, device: torch.device, pin: bool) -> Image | None:
    return {k: _to(v, device, pin) for k, v in images.items()} if images else None


def _to(t: torch.Tensor, device: torch.device, pin: bool) -> torch.Tensor:
    if t.device.type != "cpu":
        return t.to(device)  # already on a device (log-probs an evaluation collected there)
    # Small pinned staging lets the upload run asynchronously with the previous step's work.
    if pin:
        t = t.pin_memory()
    return t.to(device, non_blocking=pin)
