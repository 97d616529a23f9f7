"""The evaluation set: the held-out rows (or ``data.eval_datasets``) as fixed micro-batches.

Built once per run, in file order, through the training pipeline's own converter, template,
truncation and packing, so the eval loss scores exactly what training would have seen. Packed
rows are filled first-fit-decreasing over the whole set; unpacked rows keep one example each.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from transformers import PreTrainedTokenizerBase

from mt_ray.data.config import DataConfig
from mt_ray.data.converters import convert_row
from mt_ray.data.loader import pad_token_id, plan_split, resolve_entries, tokenize_groups
from mt_ray.data.mm_processor import ImageEncoder
from mt_ray.data.packing import collate, pack_first_fit_decreasing
from mt_ray.data.preference import add_kl_twins, group_lengths
from mt_ray.data.processor import Processor
from mt_ray.data.registry import DatasetEntry
from mt_ray.data.schema import Example, TokenizedExample
from mt_ray.data.split import HeldOut
from mt_ray.errors import DatasetError


def build_eval_batches(data_config: DataConfig, tokenizer: PreTrainedTokenizerBase, micro_batch_size: int,
                       held_out: HeldOut | None = None, images: ImageEncoder | None = None,
                       stage: str = "sft") -> list[dict[str, torch.Tensor]]:
    """The eval split as micro-batches of at most ``micro_batch_size`` rows (the step loader's keys); [] with none.

    ``held_out`` reuses a ``plan_split`` already drawn (it must come from this ``data_config``). A preference
    example's sequences share a row, as in training.
    """
    if not data_config.has_eval_split:
        return []
    examples = list(_eval_examples(data_config, held_out, stage))
    processor = Processor(tokenizer, data_config.template, data_config.max_seq_len, images)
    groups = add_kl_twins([g for example in examples for g in tokenize_groups(processor, example)],
                          data_config.max_seq_len // 2)
    if not groups:
        raise DatasetError("the eval split holds no example with a token to score; hold out more rows "
                           "(data.val_size) or check data.eval_datasets")
    if data_config.packing:
        bins = pack_first_fit_decreasing(group_lengths(groups), data_config.max_seq_len)
        rows: list[list[TokenizedExample]] = [[t for i in b for t in groups[i]] for b in bins]
    else:
        rows = groups
    length = data_config.max_seq_len if data_config.packing else None
    pad_id = pad_token_id(tokenizer)
    return [collate(rows[i:i + micro_batch_size], length, pad_id) for i in range(0, len(rows), micro_batch_size)]


def _eval_examples(data_config: DataConfig, held_out: HeldOut | None, stage: str) -> Iterator[Example]:
    """The held-out rows of ``data.datasets``, or every row of ``data.eval_datasets``, converted."""
    if data_config.eval_datasets:
        for entry in resolve_entries(data_config, data_config.eval_datasets, stage):
            yield from _converted(entry, None, data_config.on_bad_row == "skip")
        return
    entries = resolve_entries(data_config, data_config.datasets)
    held_out = held_out or plan_split(data_config, entries)
    for entry, rows in zip(entries, held_out.rows, strict=True):
        yield from _converted(entry, rows, data_config.on_bad_row == "skip")


def _converted(entry: DatasetEntry, rows: frozenset[int] | None, skip_bad_rows: bool) -> Iterator[Example]:
    """Rows of ``entry`` (those indexed in ``rows``, or all) as examples; a bad one raises unless skipped."""
    for index, raw in enumerate(entry.rows()):
        if rows is not None and index not in rows:
            continue
        try:
            yield convert_row(entry, raw)
        except DatasetError:
            if not skip_bad_rows:
                raise
