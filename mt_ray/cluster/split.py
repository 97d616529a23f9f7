"""Cutting a global batch across the data-parallel workers, and what the driver counts on it.

A split is by rows of each micro-batch when the micro-batches do not divide evenly, else by whole
micro-batches; a loss that depends on a whole micro-batch (KTO's KL estimate, GRPO's per-micro-batch
normalisers and clip extremes) always goes whole. Every piece is a copy, so shipping it to a worker
never ships the loader's whole step batch behind a view.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from mt_ray.cluster.errors import ClusterError
from mt_ray.engine.batch import IGNORE_INDEX

Batch = list[dict[str, torch.Tensor]]


def count_loss_tokens(batch: Batch) -> int:
    """Tokens whose next-token label carries loss, counted as the engine counts them."""
    return sum(int((mb.get("labels", mb["input_ids"])[:, 1:] != IGNORE_INDEX).sum()) for mb in batch)


def shard_batch(batch: Batch, num_workers: int, whole: bool = False) -> list[Batch]:
    """Split a global batch: whole micro-batches when they divide evenly, else rows of each. `whole`: whole
    micro-batches always, as evenly as they go, in order (a loss that depends on the whole micro-batch: KTO's KL
    estimate, GRPO's per-micro-batch normalisers).

    Every piece is a copy: a view (of the loader's step batch, say) would ship its whole storage.
    """
    m = len(batch)
    if m % num_workers == 0 or whole:
        if m < num_workers:
            raise ClusterError(f"a global batch of {m} micro-batches cannot feed {num_workers} workers whole (stages "
                               "kto and grpo train on whole micro-batches); raise training.grad_accum_steps "
                               "to at least cluster.num_workers")
        bounds = even_bounds(m, num_workers)
        return [[_rows_of(mb, 0, rows([mb])) for mb in batch[bounds[r] : bounds[r + 1]]] for r in range(num_workers)]
    shards: list[Batch] = [[] for _ in range(num_workers)]
    for mb in batch:
        bounds = even_bounds(rows([mb]), num_workers)
        for r in range(num_workers):
            if bounds[r + 1] > bounds[r]:
                shards[r].append(_rows_of(mb, bounds[r], bounds[r + 1]))
    if any(not s for s in shards):
        raise ClusterError(f"a global batch of {rows(batch)} rows cannot feed {num_workers} workers; "
                           "lower cluster.num_workers or raise the batch (training.micro_batch_size x grad_accum_steps)")
    return shards


def even_bounds(n: int, parts: int) -> list[int]:
    """torch.tensor_split's cut of `n` items into `parts`: the first n % parts pieces have one item more."""
    return [r * (n // parts) + min(r, n % parts) for r in range(parts + 1)]


def rows(batch: Batch) -> int:
    """Rows of every micro-batch of `batch`."""
    return sum(mb["input_ids"].shape[0] for mb in batch)


def _rows_of(mb: dict, lo: int, hi: int) -> dict:
    """Rows [lo, hi) of a micro-batch, copied: its [B, ...] tensors, and each row's list of images.

    A value with no entry per row follows only a whole micro-batch; a part of one is refused,
    naming the split that needs none.
    """
    n = mb["input_ids"].shape[0]
    piece = {}
    for key, value in mb.items():
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == n:
            piece[key] = value[lo:hi].clone()
        elif isinstance(value, list) and len(value) == n:  # `images`: each row's, a dict of tensors per image
            piece[key] = pytree.tree_map_only(torch.Tensor, torch.clone, value[lo:hi])
        elif (lo, hi) == (0, n):
            piece[key] = pytree.tree_map_only(torch.Tensor, torch.clone, value)
        else:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ClusterError(f"micro-batch key {key!r} ({shape}) has no entry per row of its {n} rows, so its "
                               "rows cannot be split across workers; give each worker whole micro-batches: "
                               "training.grad_accum_steps a multiple of cluster.num_workers")
    return piece
