"""The step loader: mixed examples -> tokenized -> packed -> one batch per optimizer step.

Examples are processed in windows of ``packing_window``: the window is tokenized, packed
first-fit-decreasing into rows (or kept one example per row when packing is off), and the
rows are shuffled with a seed fixed by the window's index. A window is a pure function of
the mixer state at its start, so ``state_dict()`` is that state plus how many rows of the
window were already used; ``load_state_dict()`` rebuilds the window and skips those rows,
giving exactly the batches an uninterrupted run would have seen.

A run has one loader, in the driver process, even when data-parallel: the driver cuts each step
batch across the workers (``mt_ray.cluster.shard_batch``), so the loader needs no rank/world-size
knob, its state is the whole run's data position, and a resume with another worker count sees
the same batches.
"""

from __future__ import annotations

import copy
import logging
import random
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from mt_ray.data.assets import demo_registry_path
from mt_ray.data.config import DataConfig
from mt_ray.data.mixing import Mixer
from mt_ray.data.mm_processor import ImageEncoder
from mt_ray.data.packing import collate, pack_first_fit_decreasing
from mt_ray.data.preference import Group, add_kl_twins, group_lengths
from mt_ray.data.processor import Processor
from mt_ray.data.registry import DatasetEntry, load_registry
from mt_ray.data.schema import FeedbackExample, PairExample, TokenizedExample
from mt_ray.data.sources import DatasetSource
from mt_ray.data.split import HeldOut, plan_held_out
from mt_ray.data.trained_counts import Origin, TrainedCounts
from mt_ray.errors import ConfigError, DatasetError

logger = logging.getLogger(__name__)
_STATE_VERSION = 1
_Row = list[TokenizedExample]


class StepLoader:
    """Endless iterator of step batches: one ``dict`` of CPU ``LongTensor[B, T]`` per optimizer step.

    * ``input_ids``: tokens; padding is ``pad_token_id`` (``eos`` if the tokenizer has no pad).
    * ``labels``: NOT shifted (Hugging Face convention: the model scores ``labels[t]`` with the
      logits at ``t - 1``); ``-100`` on every prompt/system/user/tool-result token, on the
      first token of every example and on padding.
    * ``position_ids``: ``0, 1, ...`` restarting at every example and at the padding; pass them
      with no ``attention_mask`` and ``use_cache=False`` and Hugging Face keeps attention
      inside each example.
    * ``segment_ids``: ``0, 1, ...`` per example within a row, padding last.

    ``B = micro_batch_size * grad_accum_steps``; rows ``[i * micro_batch_size, (i + 1) *
    micro_batch_size)`` form micro-batch ``i`` (see ``split_micro_batches``). ``T`` is
    ``max_seq_len`` when packing, else the step's longest example.
    """

    def __init__(self, config: DataConfig, mixer: Mixer, processor: Processor, rows_per_step: int, pad_id: int):
        self.config = config
        self.mixer = mixer
        self.processor = processor
        self.rows_per_step = rows_per_step
        self.pad_id = pad_id
        self.dropped_examples = 0
        self.counts = TrainedCounts()  # what the yielded rows trained, for the summary (`trained_counts`)
        self._window_start = self._snapshot()
        self._window_index = 0
        self._window: list[_Row] = []
        self._window_origins: list[list[Origin]] = []  # per row: the examples it counts (`TrainedCounts`)
        self._used = 0
        self._window_built = False

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        rows: list[_Row] = []
        while len(rows) < self.rows_per_step:
            if not self._window_built or self._used == len(self._window):
                self._next_window()
            take = min(self.rows_per_step - len(rows), len(self._window) - self._used)
            rows += self._window[self._used:self._used + take]
            for origins in self._window_origins[self._used:self._used + take]:
                for origin in origins:
                    self.counts.on_yielded(origin)
            self._used += take
        length = self.config.max_seq_len if self.config.packing else None
        return collate(rows, length, self.pad_id)

    @property
    def epoch(self) -> int:
        """Completed passes over the data (see ``Mixer.epoch``)."""
        return self.mixer.epoch

    @property
    def window_used_up(self) -> bool:
        """Every row of the current packing window has been yielded: once ``epoch`` is 1, the first pass's last
        examples are behind (the window that finished it holds them)."""
        return self._window_built and self._used == len(self._window)

    def stats(self) -> dict[str, Any]:
        """Counts to report. Of the data read (read ahead of the steps too): bad rows skipped per dataset, examples
        dropped as untrainable. Of the rows yielded: examples longer than ``max_seq_len`` (a text cut into chunks
        of it, a conversation truncated to it, as LLaMA-Factory does), and the passes over the data they make
        (``TrainedCounts.epochs``)."""
        return {
            "bad_rows": {s.entry.name: s.state.bad_rows for s in self.mixer.sources},
            "dropped_examples": self.dropped_examples,
            "cut_examples": self.counts.cut,
            "epoch": self.counts.epochs(),
        }

    def state_dict(self) -> dict[str, Any]:
        """Resumable position; ``load_state_dict`` of it reproduces all later batches exactly."""
        return {"version": _STATE_VERSION, "window_start": copy.deepcopy(self._window_start),
                "window_index": self._window_index, "used": self._used, "built": self._window_built,
                "trained": self.counts.trained_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != _STATE_VERSION:
            raise ConfigError(f"data loader state has version {state.get('version')}, expected {_STATE_VERSION}")
        self._restore(state["window_start"])
        self._window_index = state["window_index"]
        self._window_built = False
        if state["built"]:
            self._window_index -= 1
            self._next_window()
            self._used = state["used"]
        # Absent from checkpoints written before the counts followed the yielded rows: counted from here on.
        self.counts.load_trained_state(state.get("trained", {}))

    def _snapshot(self) -> dict[str, Any]:
        return {"mixer": self.mixer.state_dict(), "dropped": self.dropped_examples,
                "counts": self.counts.drawn_state()}

    def _restore(self, snapshot: dict[str, Any]) -> None:
        self.mixer.load_state_dict(copy.deepcopy(snapshot["mixer"]))
        self.dropped_examples = snapshot["dropped"]
        self.counts.load_drawn_state(snapshot.get("counts", {}))
        self._window_start = copy.deepcopy(snapshot)

    def _next_window(self) -> None:
        """Tokenize the next ``packing_window`` examples and arrange them into rows."""
        self._window_start = self._snapshot()
        groups: list[Group] = []  # the sequences of one example that stay in one row (a pair), or one piece
        origins: dict[int, Origin] = {}  # by id of an example's first sequence, which the rows hold as it is
        while len(groups) < self.config.packing_window:
            new = self._tokenize(self.mixer.next())
            if (origin := self.counts.on_drawn(self.mixer.epoch, bool(new), self.processor.cut)) is not None:
                origins[id(new[0][0])] = origin
            groups += new
        rows = self._arrange(groups)
        if self.config.packing:
            random.Random(f"pack/{self.config.seed}/{self._window_index}").shuffle(rows)
        self._window, self._used, self._window_built = rows, 0, True
        self._window_origins = [[origins[id(s)] for s in row if id(s) in origins] for row in rows]
        self._window_index += 1

    def count_epoch_rows(self) -> int:
        """Rows one pass over the data gives, tokenized and packed window by window as training does (what
        ``training.epochs`` counts in). It reads the whole pass: call it on a loader of its own."""
        rows, groups = 0, []
        while True:
            example = self.mixer.next()
            if self.mixer.epoch > 0:  # that example starts the second pass
                return rows + len(self._arrange(groups)) if groups else rows
            groups += self._tokenize(example)
            if len(groups) >= self.config.packing_window:
                rows, groups = rows + len(self._arrange(groups)), []

    def _tokenize(self, example) -> list[Group]:
        try:
            new = tokenize_groups(self.processor, example)
        except DatasetError as e:  # an image that does not decode, or does not fit
            if self.config.on_bad_row != "skip":
                raise
            logger.warning("skipping example: %s", e)
            new = []
        if not new:
            self.dropped_examples += 1
        return new

    def _arrange(self, groups: list[Group]) -> list[_Row]:
        """A window's groups as rows: packed first-fit-decreasing, or one group a row."""
        groups = add_kl_twins(groups, self.config.max_seq_len // 2)
        if not self.config.packing:
            return list(groups)
        bins = pack_first_fit_decreasing(group_lengths(groups), self.config.max_seq_len)
        return [[e for i in b for e in groups[i]] for b in bins]


def tokenize_groups(processor: Processor, example) -> list[Group]:
    """A preference example's sequences as one group; each piece of any other example as a group of its own."""
    if isinstance(example, PairExample | FeedbackExample):
        sequences = processor.preference(example)
        return [sequences] if sequences else []
    return [[piece] for piece in processor(example)]


def split_micro_batches(batch: dict[str, torch.Tensor], micro_batch_size: int) -> list[dict[str, torch.Tensor]]:
    """Cut a step batch into micro-batches of ``micro_batch_size`` rows (views, no copy)."""
    n = batch["input_ids"].shape[0]
    return [{k: v[i:i + micro_batch_size] for k, v in batch.items()} for i in range(0, n, micro_batch_size)]


def build_dataloader(data_config: DataConfig, tokenizer: PreTrainedTokenizerBase, micro_batch_size: int,
                     grad_accum_steps: int | None = None, *, global_batch_size: int | None = None,
                     seed: int | None = None, held_out: HeldOut | None = None,
                     images: ImageEncoder | None = None, stage: str = "sft") -> StepLoader:
    """Build the step loader: each batch holds ``micro_batch_size * grad_accum_steps`` rows.

    Give ``grad_accum_steps`` or ``global_batch_size`` (rows per optimizer step, a multiple
    of ``micro_batch_size``), not both; neither means one micro-batch per step. ``seed``
    overrides ``data_config.seed``. Rows of the ``data.val_size`` split are never yielded;
    pass ``held_out`` (from ``plan_split``) to reuse a split already drawn. ``images`` (the model's
    processor) turns the rows' images into pixel values; without it a row with images is refused.
    """
    rows = _rows_per_step(micro_batch_size, grad_accum_steps, global_batch_size)
    if seed is not None:
        data_config = data_config.model_copy(update={"seed": seed})
    entries = resolve_entries(data_config, data_config.datasets, stage)
    held_out = held_out or plan_split(data_config, entries)
    sources = [
        DatasetSource(entry, i, data_config.seed, data_config.shuffle, data_config.shuffle_buffer,
                      skip_bad_rows=data_config.on_bad_row == "skip",
                      held_out=held_out.rows[i] if held_out else frozenset())
        for i, entry in enumerate(entries)
    ]
    mixer = Mixer(sources, data_config.weights, data_config.mix_strategy, data_config.seed)
    processor = Processor(tokenizer, data_config.template, data_config.max_seq_len, images)
    return StepLoader(data_config, mixer, processor, rows, pad_token_id(tokenizer))


def resolve_entries(data_config: DataConfig, names: list[str], stage: str | None = None) -> list[DatasetEntry]:
    """The registry entries ``names`` of the configured registry (the built-in demo one by default), each
    checked to fit ``stage`` when given."""
    registry = load_registry(data_config.registry or demo_registry_path())
    entries = [replace(registry.resolve(name), max_rows=data_config.max_samples) for name in names]
    for entry in entries if stage is not None else ():
        entry.check_stage(stage)
    return entries


def plan_split(data_config: DataConfig, entries: list[DatasetEntry] | None = None) -> HeldOut | None:
    """The ``data.val_size`` rows held out of ``data.datasets`` with ``data_config.seed``; None without a split."""
    if not data_config.val_size:
        return None
    return plan_held_out(entries or resolve_entries(data_config, data_config.datasets), data_config.val_size,
                         data_config.seed)


def pad_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id padding is filled with: the pad token, else eos."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        raise ConfigError("the tokenizer has neither a pad token nor an eos token to pad with")
    return pad_id


def _rows_per_step(micro_batch_size: int, grad_accum_steps: int | None, global_batch_size: int | None) -> int:
    if micro_batch_size < 1:
        raise ConfigError("micro_batch_size must be at least 1")
    if grad_accum_steps is not None and global_batch_size is not None:
        raise ConfigError("give grad_accum_steps or global_batch_size, not both")
    if global_batch_size is not None:
        if global_batch_size < 1 or global_batch_size % micro_batch_size:
            raise ConfigError(f"global_batch_size {global_batch_size} is not a multiple of "
                              f"micro_batch_size {micro_batch_size}")
        return global_batch_size
    if grad_accum_steps is not None and grad_accum_steps < 1:
        raise ConfigError("grad_accum_steps must be at least 1")
    return micro_batch_size * (grad_accum_steps or 1)
