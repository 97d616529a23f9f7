"""The held-out split: disjoint from training, stable for a seed, proportional, and refused when it cannot work."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from data_test_utils import write_jsonl, write_registry

from mt_ray.data import DataConfig, build_dataloader, build_eval_batches, load_data_config, plan_split
from mt_ray.errors import ConfigError

ROW = re.compile(r"([ab])(\d+) end")


def numbered(tmp_path: Path, sizes: dict[str, int]) -> Path:
    """One alpaca dataset per name, row i saying '<name><i> end' (so every row is findable in decoded tokens)."""
    for name, n in sizes.items():
        write_jsonl(tmp_path / f"{name}.jsonl", [{"instruction": "say", "output": f"{name}{i} end"} for i in range(n)])
    return write_registry(tmp_path, {name: {"file_name": f"{name}.jsonl"} for name in sizes})


def config(registry: Path, **overrides) -> DataConfig:
    values = {"registry": registry, "datasets": ["a", "b"], "max_seq_len": 64, "packing_window": 8,
              "shuffle_buffer": 16, **overrides}
    return DataConfig(**values)


def rows_in(batches: list[dict[str, torch.Tensor]], tokenizer) -> list[tuple[str, int]]:
    text = " ".join(tokenizer.decode(ids) for b in batches for ids in b["input_ids"])
    return [(name, int(i)) for name, i in ROW.findall(text)]


def test_training_never_sees_a_held_out_row_and_together_they_cover_the_data(tokenizer, tmp_path):
    cfg = config(numbered(tmp_path, {"a": 30, "b": 10}), val_size=0.25)
    held_out = rows_in(build_eval_batches(cfg, tokenizer, micro_batch_size=4), tokenizer)
    assert len(held_out) == len(set(held_out)) == 10
    assert sum(name == "a" for name, _ in held_out) == 8  # shared out in proportion: 30:10 -> 7.5:2.5 -> 8:2

    loader = build_dataloader(cfg, tokenizer, 2)
    trained: set[tuple[str, int]] = set()
    while loader.epoch < 2:  # past a full pass over the training rows (a packing window reads ahead)
        trained.update(rows_in([next(loader)], tokenizer))
    assert not trained & set(held_out)
    assert trained | set(held_out) == {("a", i) for i in range(30)} | {("b", i) for i in range(10)}


def test_same_seed_same_split_other_seed_other_split(tokenizer, tmp_path):
    registry = numbered(tmp_path, {"a": 40, "b": 40})
    first = plan_split(config(registry, val_size=8))
    assert first == plan_split(config(registry, val_size=8)) and first.total == 8
    assert first != plan_split(config(registry, val_size=8, seed=1))
    # The split does not depend on the batch shape or the shuffle, only on the files and the seed.
    assert first == plan_split(config(registry, val_size=8, shuffle=False, max_seq_len=32))
    batches = build_eval_batches(config(registry, val_size=8), tokenizer, 3)
    assert all(torch.equal(x[k], y[k]) for x, y in zip(batches, build_eval_batches(config(registry, val_size=8),
                                                                                   tokenizer, 3), strict=True)
               for k in x)


@pytest.mark.parametrize("packing", [True, False])
def test_eval_batches_are_micro_batches_of_the_loaders_kind(tokenizer, tmp_path, packing):
    cfg = config(numbered(tmp_path, {"a": 30, "b": 10}), val_size=12, packing=packing)
    batches = build_eval_batches(cfg, tokenizer, micro_batch_size=4)
    assert all(set(b) == {"input_ids", "labels", "position_ids", "segment_ids"} for b in batches)
    assert all(b["input_ids"].shape[0] <= 4 for b in batches)
    if packing:
        assert all(b["input_ids"].shape[1] == 64 for b in batches)
    else:
        assert sum(b["input_ids"].shape[0] for b in batches) == 12
    assert all((b["labels"] != -100).any() for b in batches)


def test_named_eval_datasets_are_evaluated_whole(tokenizer, tmp_path):
    cfg = config(numbered(tmp_path, {"a": 12, "b": 5}), datasets=["a"], eval_datasets="b")
    assert sorted(rows_in(build_eval_batches(cfg, tokenizer, 2), tokenizer)) == [("b", i) for i in range(5)]
    assert plan_split(cfg) is None  # the training dataset keeps all its rows


def test_no_split_means_no_eval_batches(tokenizer, tmp_path):
    assert build_eval_batches(config(numbered(tmp_path, {"a": 5, "b": 5})), tokenizer, 2) == []


@pytest.mark.parametrize(("val_size", "message"), [
    (33, r"data.val_size: 33 holds out 33 rows, but data.datasets hold only 33; use a count below 33"),
    (0.9, r"data.val_size: 0.9 would hold out all 3 rows of 'b', leaving it nothing to train on"),  # 30 of 33: 27 + 3
])
def test_a_split_that_leaves_nothing_to_train_on_is_refused(tmp_path, val_size, message):
    with pytest.raises(ConfigError, match=message):
        plan_split(config(numbered(tmp_path, {"a": 30, "b": 3}), val_size=val_size))


@pytest.mark.parametrize(("values", "message"), [
    ({"val_size": 2.5}, r"data.val_size: .*2.5 is neither a fraction below 1 nor a whole row count"),
    ({"val_size": -1}, r"data.val_size: Input should be greater than or equal to 0"),
    ({"eval_datasets": ["demo_alpaca"]}, r"data.eval_datasets: .*\['demo_alpaca'\] would be trained on and evaluated"),
    ({"val_size": 0.1, "eval_datasets": ["x"]}, r"give data.val_size or data.eval_datasets, not both"),
])
def test_bad_split_settings_name_the_key(values, message):
    with pytest.raises(ConfigError, match=message):
        load_data_config(values)
