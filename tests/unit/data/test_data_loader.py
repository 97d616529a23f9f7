"""The step loader: batch shapes and meaning, determinism, exact resume, mixing, bad-row
handling, and every local entry of LLaMA-Factory's own registry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from data_test_utils import write_jsonl, write_registry

from mt_ray.data import (
    DataConfig,
    build_dataloader,
    count_valid_tokens,
    demo_registry_path,
    load_data_config,
    split_micro_batches,
)
from mt_ray.data.registry import load_registry
from mt_ray.errors import ConfigError, DatasetError

KEYS = ("input_ids", "labels", "position_ids", "segment_ids")


def take(loader, n: int) -> list[dict[str, torch.Tensor]]:
    return [next(loader) for _ in range(n)]


def same(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> bool:
    return len(a) == len(b) and all(torch.equal(x[k], y[k]) for x, y in zip(a, b, strict=True) for k in KEYS)


def small_config(**overrides) -> DataConfig:
    values = {"max_seq_len": 64, "packing_window": 16, "shuffle_buffer": 50, **overrides}
    return DataConfig(**values)


@pytest.mark.parametrize("packing", [True, False])
def test_batches_have_the_documented_shape_and_meaning(tokenizer, packing: bool) -> None:
    loader = build_dataloader(small_config(packing=packing), tokenizer, micro_batch_size=2, grad_accum_steps=3)
    for batch in take(loader, 4):
        assert set(batch) == set(KEYS) and all(v.dtype == torch.long for v in batch.values())
        rows, length = batch["input_ids"].shape
        assert rows == 6 and (length == 64 if packing else length <= 64)
        starts = batch["position_ids"] == 0
        assert starts[:, 0].all()
        assert (batch["labels"][starts] == -100).all()  # no label is predicted across a boundary
        assert torch.equal(batch["segment_ids"], starts.long().cumsum(1) - 1)
        pad = batch["input_ids"] == tokenizer.pad_token_id
        assert (batch["labels"][pad] == -100).all()
        assert count_valid_tokens(batch) == int((batch["labels"] != -100).sum()) > 0
    micro = split_micro_batches(batch, 2)
    assert len(micro) == 3 and torch.equal(torch.cat([m["input_ids"] for m in micro]), batch["input_ids"])


def test_same_seed_same_batches_other_seed_other_batches(tokenizer) -> None:
    first = take(build_dataloader(small_config(), tokenizer, 2, 1), 5)
    assert same(first, take(build_dataloader(small_config(), tokenizer, 2, 1), 5))
    assert not same(first, take(build_dataloader(small_config(), tokenizer, 2, 1, seed=1), 5))


@pytest.mark.parametrize("strategy", ["concat", "interleave_under", "interleave_over"])
@pytest.mark.parametrize("packing", [True, False])
def test_resume_from_state_dict_gives_the_exact_same_batches(tokenizer, strategy: str, packing: bool) -> None:
    weights = None if strategy == "concat" else [3.0, 1.0]
    config = small_config(mix_strategy=strategy, weights=weights, packing=packing)
    reference = build_dataloader(config, tokenizer, 2, 2)
    # 60 steps cross several packing windows, shuffle blocks and (for concat) both datasets.
    expected = take(reference, 60)
    for cut in (0, 1, 7, 33):
        loader = build_dataloader(config, tokenizer, 2, 2)
        take(loader, cut)
        state = json.loads(json.dumps(loader.state_dict()))  # the state survives serialization
        resumed = build_dataloader(config, tokenizer, 2, 2)
        resumed.load_state_dict(state)
        assert same(take(resumed, 60 - cut), expected[cut:]), f"diverged after resuming at step {cut}"


def test_epochs_repeat_with_a_new_order(tokenizer, tmp_path: Path) -> None:
    write_jsonl(tmp_path / "d.jsonl", [{"instruction": f"q{i}", "output": f"answer {i}"} for i in range(8)])
    config = small_config(registry=write_registry(tmp_path, {"d": {"file_name": "d.jsonl"}}), datasets=["d"],
                          packing=False, packing_window=1)
    loader = build_dataloader(config, tokenizer, 8)
    epoch0, epoch1 = next(loader)["input_ids"], next(loader)["input_ids"]
    assert loader.epoch == 1
    assert sorted(map(tuple, epoch0.tolist())) == sorted(map(tuple, epoch1.tolist()))
    assert not torch.equal(epoch0, epoch1)


def test_interleave_weights_set_the_mix(tokenizer, tmp_path: Path) -> None:
    write_jsonl(tmp_path / "a.jsonl", [{"instruction": "a", "output": "A"}] * 50)
    write_jsonl(tmp_path / "b.jsonl", [{"instruction": "b", "output": "B"}] * 50)
    registry = write_registry(tmp_path, {"a": {"file_name": "a.jsonl"}, "b": {"file_name": "b.jsonl"}})
    config = small_config(registry=registry, datasets="a,b", mix_strategy="interleave_over", weights=[4, 1],
                          packing=False)
    ids = next(build_dataloader(config, tokenizer, 200))["input_ids"]
    a_token = tokenizer.encode("A", add_special_tokens=False)[0]
    share_a = (ids == a_token).any(1).float().mean().item()
    assert 0.7 < share_a < 0.9


def test_bad_rows_raise_or_are_skipped_and_counted(tokenizer, tmp_path: Path) -> None:
    rows = [{"instruction": "q", "output": "good"}] * 5 + [{"instruction": "q"}, {"output": "no prompt"}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with path.open("a") as f:
        f.write("{broken\n")
    registry = write_registry(tmp_path, {"d": {"file_name": "d.jsonl"}})
    config = small_config(registry=registry, datasets=["d"], shuffle=False)
    with pytest.raises(DatasetError, match=r"d.jsonl row 6: missing column 'output'"):
        next(build_dataloader(config, tokenizer, 2))
    # A window of 6 examples reads the 5 good rows, skips the 3 bad ones, and starts epoch 1; its 6 examples pack
    # into the batch's rows: 1.2 passes of 5 examples.
    skipping = config.model_copy(update={"on_bad_row": "skip", "packing_window": 6})
    loader = build_dataloader(skipping, tokenizer, 2)
    next(loader)
    assert loader.stats() == {"bad_rows": {"d": 3}, "dropped_examples": 0, "cut_examples": 0, "epoch": 1.2}
    for _ in range(6):  # later epochs read the same 3 bad rows again: they are not counted again
        next(loader)
    assert loader.stats()["epoch"] > 2 and loader.stats()["bad_rows"] == {"d": 3}


def test_examples_longer_than_max_seq_len_are_cut_and_counted(tokenizer, tmp_path: Path) -> None:
    """A conversation is truncated to max_seq_len and a text cut into chunks of it; the run's summary counts
    both (`stats`) as the rows holding them are yielded, not as the window is read, and a resumed loader counts on
    from the same number."""
    long = " ".join(["word"] * 200)
    rows = [{"instruction": "q", "output": "short"}, {"instruction": "q", "output": long},
            {"instruction": long, "output": "a"}, {"instruction": "q", "output": "fine"}]
    registry = write_registry(tmp_path, {"d": {"file_name": "d.jsonl"},
                                         "t": {"file_name": "t.jsonl", "columns": {"prompt": "text"}}})  # text
    write_jsonl(tmp_path / "d.jsonl", rows)
    write_jsonl(tmp_path / "t.jsonl", [{"text": long}])
    config = small_config(registry=registry, datasets=["d"], shuffle=False, packing_window=4)
    loader = build_dataloader(config, tokenizer, 1)
    batch = next(loader)
    assert loader.stats()["cut_examples"] == 1  # the window's first row holds one of its two cut examples
    assert batch["input_ids"].shape[1] == 64  # each cut example fills at most one row
    state = loader.state_dict()
    next(loader)
    resumed = build_dataloader(config, tokenizer, 1)
    resumed.load_state_dict(state)
    assert resumed.stats()["cut_examples"] == 1  # the window is rebuilt from its start: not counted twice
    next(resumed), next(resumed)  # the window's three rows
    assert resumed.stats() == {"bad_rows": {"d": 0}, "dropped_examples": 0, "cut_examples": 2, "epoch": None}
    text = build_dataloader(small_config(registry=registry, datasets=["t"], packing_window=1), tokenizer, 1)
    next(text)
    assert text.stats()["cut_examples"] == 1


def test_dataset_with_no_usable_row_is_an_error_even_when_skipping(tokenizer, tmp_path: Path) -> None:
    write_jsonl(tmp_path / "d.jsonl", [{"instruction": "q"}] * 3)
    config = small_config(registry=write_registry(tmp_path, {"d": {"file_name": "d.jsonl"}}), datasets=["d"],
                          on_bad_row="skip")
    with pytest.raises(DatasetError, match="dataset 'd' .* has no usable rows"):
        next(build_dataloader(config, tokenizer, 1))


def test_batch_size_arguments(tokenizer) -> None:
    assert next(build_dataloader(small_config(), tokenizer, 2, global_batch_size=8))["input_ids"].shape[0] == 8
    assert next(build_dataloader(small_config(), tokenizer, 3))["input_ids"].shape[0] == 3
    for kwargs, message in [({"grad_accum_steps": 2, "global_batch_size": 4}, "not both"),
                            ({"global_batch_size": 5}, "not a multiple"), ({"grad_accum_steps": 0}, "at least 1")]:
        with pytest.raises(ConfigError, match=message):
            build_dataloader(small_config(), tokenizer, 2, **kwargs)


def test_config_errors_name_the_dotted_key() -> None:
    with pytest.raises(ConfigError, match=r"data\.max_seq_len: .*; data\.packin: Extra inputs"):
        load_data_config({"max_seq_len": 1, "packin": True})
    with pytest.raises(ConfigError, match=r"data\.weights: .*interleave"):
        load_data_config({"weights": [1, 1]})
    with pytest.raises(ConfigError, match=r"data\.on_bad_row"):
        load_data_config({"on_bad_row": "ignore"})
    assert load_data_config({"datasets": "a, b"}).datasets == ["a", "b"]
    assert all(field.description for field in DataConfig.model_fields.values())


def test_demo_registry_is_the_default(tokenizer) -> None:
    assert DataConfig().registry is None
    assert set(load_registry(demo_registry_path()).entries) == {"demo_alpaca", "demo_sharegpt", "demo_mllm",
                                                                 "dpo_en_demo", "kto_en_demo", "demo_math_prompts"}


def local_entries(folder: Path) -> list[str]:
    entries = json.loads((folder / "dataset_info.json").read_text(encoding="utf-8"))
    return [name for name, info in entries.items() if "file_name" in info]


def test_every_llamafactory_local_entry_loads_or_says_why(tokenizer, llamafactory_dir: Path) -> None:
    usable, preference = [], []
    for name in local_entries(llamafactory_dir):
        info = json.loads((llamafactory_dir / "dataset_info.json").read_text())[name]
        config = small_config(registry=llamafactory_dir, datasets=[name], max_seq_len=256)
        if {"videos", "audios"} & set(info.get("columns", {})):
            with pytest.raises(DatasetError, match=f"dataset '{name}' uses columns"):
                build_dataloader(config, tokenizer, 2)
            continue
        if not (llamafactory_dir / info["file_name"]).exists():
            with pytest.raises(DatasetError, match=f"dataset '{name}': file_name .* not found"):
                build_dataloader(config, tokenizer, 2)
            continue
        if "images" in info.get("columns", {}):  # needs an image-text model's processor (tests/unit/data/test_data_images.py)
            with pytest.raises(DatasetError, match="not an image-text model"):
                next(build_dataloader(config, tokenizer, 2, 2))
            continue
        stage = "dpo" if info.get("ranking") else "kto" if "kto_tag" in info.get("columns", {}) else None
        if stage is not None:  # refused under sft in one line naming its stage; trains under that stage
            with pytest.raises(DatasetError, match=f"dataset '{name}' is .* trains under training.stage: {stage}, "
                                                   "not sft$"):
                build_dataloader(config, tokenizer, 2)
            other = {"dpo": "kto", "kto": "dpo"}[stage]
            with pytest.raises(DatasetError, match=f"dataset '{name}' is .* training.stage: {stage}, not {other}$"):
                build_dataloader(config, tokenizer, 2, stage=other)
            batch = next(build_dataloader(config, tokenizer, 2, 2, stage=stage))
            assert batch["input_ids"].shape == (4, 256) and batch["seq_role"].shape[0] == 4
            preference.append(name)
            continue
        for other in ("dpo", "kto"):  # an SFT dataset under a preference stage: one line naming the stage it fits
            with pytest.raises(DatasetError, match=f"dataset '{name}' is an SFT dataset, which trains under "
                                                   f"training.stage: sft, not {other}$"):
                build_dataloader(config, tokenizer, 2, stage=other)
        loader = build_dataloader(config, tokenizer, 2, 2)
        for batch in take(loader, 2):
            assert batch["input_ids"].shape == (4, 256) and count_valid_tokens(batch) > 0
        assert loader.stats()["bad_rows"] == {name: 0}
        usable.append(name)
    assert sorted(usable) == ["alpaca_en_demo", "c4_demo", "glaive_toolcall_en_demo", "identity", "wiki_demo"]
    assert sorted(preference) == ["dpo_en_demo", "kto_en_demo"]


def test_state_from_another_dataset_list_is_refused(tokenizer) -> None:
    state = build_dataloader(small_config(datasets=["demo_alpaca"]), tokenizer, 1).state_dict()
    with pytest.raises(ConfigError, match="holds 1 datasets"):
        build_dataloader(small_config(), tokenizer, 1).load_state_dict(state)
    with pytest.raises(ConfigError, match="version"):
        build_dataloader(small_config(), tokenizer, 1).load_state_dict({"version": 0})


def test_max_samples_keeps_the_first_rows_of_each_dataset(tokenizer, tmp_path: Path) -> None:
    """LLaMA-Factory's max_samples: the first N rows in file order of every dataset (then shuffled); an epoch is
    what is left, counted as training packs it."""
    for name in ("a", "b"):
        write_jsonl(tmp_path / f"{name}.jsonl", [{"instruction": f"{name}{i}", "output": f"x {i}"} for i in range(9)])
    registry = write_registry(tmp_path, {n: {"file_name": f"{n}.jsonl"} for n in ("a", "b")})
    config = small_config(registry=registry, datasets=["a", "b"], packing=False, max_samples=3)
    loader = build_dataloader(config, tokenizer, 6)
    rows = {tokenizer.decode(ids).split("user\n")[1].split("<")[0] for ids in next(loader)["input_ids"].tolist()}
    assert rows == {"a0", "a1", "a2", "b0", "b1", "b2"}
    assert build_dataloader(config, tokenizer, 6).count_epoch_rows() == 6
    packed = config.model_copy(update={"packing": True, "max_seq_len": 64})
    assert build_dataloader(packed, tokenizer, 1).count_epoch_rows() < 6  # short examples share rows
