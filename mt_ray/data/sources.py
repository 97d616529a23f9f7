"""One dataset as a resumable, block-shuffled stream of converted examples.

Rows are read in file order in blocks of ``shuffle_buffer`` rows; each block is emitted
in a permutation fixed by ``(seed, dataset index, epoch, block)``. Rows of the held-out split
(``split.py``) are skipped by their file-order index, so training never sees them. The position in an
epoch is a single row count, so resuming re-opens the files at the block's first row
(readers skip rows without decoding them) and re-derives the same permutation: exact,
and without holding more than one block in memory.
"""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass

from mt_ray.data.converters import convert_row
from mt_ray.data.readers import RawRow
from mt_ray.data.registry import DatasetEntry
from mt_ray.data.schema import Example
from mt_ray.errors import DatasetError

logger = logging.getLogger(__name__)
_LOGGED_BAD_ROWS = 5


@dataclass
class SourceState:
    """Where a source stands: rows consumed this epoch, valid ones among them, bad rows in the data (each once)."""

    epoch: int = 0
    position: int = 0
    valid_in_epoch: int = 0
    bad_rows: int = 0


class DatasetSource:
    """Converted examples of one registry entry, one epoch at a time."""

    def __init__(self, entry: DatasetEntry, index: int, seed: int, shuffle: bool, block_size: int,
                 skip_bad_rows: bool, held_out: frozenset[int] = frozenset()):
        self.entry = entry
        self.index = index
        self.seed = seed
        self.shuffle = shuffle
        self.block_size = block_size
        self.skip_bad_rows = skip_bad_rows
        self.held_out = held_out
        self.state = SourceState()
        self._rows: Iterator[RawRow] | None = None
        self._block: list[tuple[int, RawRow]] | None = None

    def next(self) -> Example | None:
        """The next valid example of this epoch, or ``None`` once the epoch is used up."""
        while True:
            indexed = self._next_raw()
            if indexed is None:
                if self.state.valid_in_epoch == 0:
                    raise DatasetError(f"dataset '{self.entry.name}' ({self.entry.path}) has no usable rows")
                return None
            index, raw = indexed
            if index in self.held_out:
                continue
            try:
                example = convert_row(self.entry, raw)
            except DatasetError as e:
                if not self.skip_bad_rows:
                    raise DatasetError(f"{e} (or set data.on_bad_row=skip to skip such rows and count them)") from None
                self._count_bad_row(e)
                continue
            self.state.valid_in_epoch += 1
            return example

    def new_epoch(self) -> None:
        """Start the next epoch from the first row (with a new permutation)."""
        self.state = SourceState(epoch=self.state.epoch + 1, bad_rows=self.state.bad_rows)
        self._rows = self._block = None

    def state_dict(self) -> dict[str, int]:
        return asdict(self.state)

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.state = SourceState(**state)
        self._rows = self._block = None

    def _next_raw(self) -> tuple[int, RawRow] | None:
        """The next row of this epoch's order and its index in file order."""
        block_index, offset = divmod(self.state.position, self.block_size)
        if self._block is None or offset == 0:
            self._block = self._read_block(block_index)
        if offset >= len(self._block):
            return None
        self.state.position += 1
        return self._block[offset]

    def _read_block(self, block_index: int) -> list[tuple[int, RawRow]]:
        first = block_index * self.block_size
        if self._rows is None:
            self._rows = self.entry.rows(skip=first)
        block = list(enumerate(itertools.islice(self._rows, self.block_size), start=first))
        if self.shuffle:
            random.Random(f"{self.seed}/{self.index}/{self.state.epoch}/{block_index}").shuffle(block)
        return block

    def _count_bad_row(self, error: DatasetError) -> None:
        if self.state.epoch > 0:
            return  # every epoch reads the same rows: each bad one was counted (and shown) in the first
        self.state.bad_rows += 1
        if self.state.bad_rows <= _LOGGED_BAD_ROWS:
            logger.warning("skipping bad row: %s", error)
        if self.state.bad_rows == _LOGGED_BAD_ROWS:
            logger.warning("dataset '%s': further bad rows are skipped and counted silently", self.entry.name)
