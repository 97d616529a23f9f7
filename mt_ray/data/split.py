"""The held-out split: which rows of each training dataset are kept for evaluation.

``data.val_size`` holds out a fraction of all rows (below 1, rounded up, as ``datasets``'
``train_test_split`` rounds) or a row count (from 1 on). The rows are shared out over the
datasets in proportion to their sizes, so the eval mix is the data's own mix, and each
dataset's rows are drawn with a seed fixed by ``(seed, dataset index)``. The split depends on
the files, the dataset list and the seed only: every run with the same seed holds out the same
rows, and the training sources skip exactly these, so no row is in both splits.

A row is named by its 0-based index in file order (the order ``readers.iter_rows`` walks), which
no shuffle or resume changes.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from mt_ray.data.registry import DatasetEntry
from mt_ray.errors import ConfigError


@dataclass(frozen=True)
class HeldOut:
    """Row indices held out of each dataset of ``data.datasets``, in that order."""

    rows: tuple[frozenset[int], ...]

    @property
    def total(self) -> int:
        return sum(len(r) for r in self.rows)


def plan_held_out(entries: Sequence[DatasetEntry], val_size: float, seed: int) -> HeldOut:
    """Draw the held-out rows of ``entries``; ``ConfigError`` if the split leaves a dataset nothing to train on."""
    sizes = [e.num_rows() for e in entries]
    total = sum(sizes)
    wanted = math.ceil(round(val_size * total, 6)) if val_size < 1 else int(val_size)  # 0.1 * 700 is 70.000...01
    if wanted >= total:
        raise ConfigError(f"data.val_size: {val_size:g} holds out {wanted} rows, but data.datasets hold only {total}; "
                          f"use a count below {total} or a fraction such as 0.1")
    rows = []
    for i, (entry, size, share) in enumerate(zip(entries, sizes, _shares(wanted, sizes), strict=True)):
        if share >= size:
            raise ConfigError(f"data.val_size: {val_size:g} would hold out all {size} rows of '{entry.name}', "
                              "leaving it nothing to train on; use a smaller val_size")
        rows.append(frozenset(random.Random(f"val/{seed}/{i}").sample(range(size), share)))
    return HeldOut(tuple(rows))


def _shares(wanted: int, sizes: list[int]) -> list[int]:
    """``wanted`` split in proportion to ``sizes`` (largest remainders get the leftover rows)."""
    total = sum(sizes)
    exact = [wanted * s / total for s in sizes]
    shares = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(sizes)), key=lambda i: (shares[i] - exact[i], i))
    for i in by_remainder[: wanted - sum(shares)]:
        shares[i] += 1
    return shares
