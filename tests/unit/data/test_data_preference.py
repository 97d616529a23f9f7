"""Preference data: LLaMA-Factory's ranking (sharegpt, alpaca) and KTO entries, pairs kept in one row, bad rows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from data_test_utils import write_jsonl, write_registry

from mt_ray.config.run import load_run_config
from mt_ray.data import DataConfig, build_dataloader, build_eval_batches
from mt_ray.data.schema import IGNORE_INDEX, ROLE_CHOSEN, ROLE_KL, ROLE_REJECTED
from mt_ray.errors import ConfigError, DatasetError


def config(registry, datasets, **kw) -> DataConfig:
    return DataConfig(registry=registry, datasets=datasets, **{"max_seq_len": 128, "packing_window": 16, **kw})


def segments(batch: dict, row: int) -> list[tuple[list[int], list[int]]]:
    """(input ids, labels) of each sequence of a row (the padding after them left out)."""
    seg, ids, labels = batch["segment_ids"][row], batch["input_ids"][row], batch["labels"][row]
    n = int((batch["seq_role"][row] != 0).sum())
    return [(ids[seg == s].tolist(), labels[seg == s].tolist()) for s in range(n)]


@pytest.mark.parametrize("packing", [True, False])
def test_ranking_pairs_share_a_row_with_one_prompt(tokenizer, llamafactory_dir: Path, packing: bool) -> None:
    batch = next(build_dataloader(config(llamafactory_dir, ["dpo_en_demo"], packing=packing), tokenizer, 2, 2,
                                  stage="dpo"))
    for row in range(4):
        roles = [r for r in batch["seq_role"][row].tolist() if r]
        assert roles and roles == [ROLE_CHOSEN, ROLE_REJECTED] * (len(roles) // 2)
        seqs = segments(batch, row)
        for (c_ids, c_labels), (r_ids, r_labels) in zip(seqs[0::2], seqs[1::2], strict=True):
            prompt = c_labels.index(next(t for t in c_labels if t != IGNORE_INDEX))
            assert c_ids[:prompt] == r_ids[:prompt] and r_labels[:prompt] == [IGNORE_INDEX] * prompt
            assert len(c_ids) <= 64 and len(r_ids) <= 64  # each sequence of a pair gets half a row
        starts = int((batch["position_ids"][row] == 0).sum())
        assert starts in (len(seqs), len(seqs) + 1)  # every sequence its own document (and the padding)


def test_alpaca_ranking_and_bad_rows(tokenizer, tmp_path: Path) -> None:
    rows = [{"instruction": f"say {i}", "chosen": f"{i}", "rejected": f"{i + 1}"} for i in range(6)]
    rows[2] = {"instruction": "no rejected", "chosen": "x"}
    write_jsonl(tmp_path / "pairs.jsonl", rows)
    registry = write_registry(tmp_path, {"pairs": {"file_name": "pairs.jsonl", "ranking": True,
                                                   "columns": {"prompt": "instruction", "chosen": "chosen",
                                                               "rejected": "rejected"}}})
    with pytest.raises(DatasetError, match=r"dataset 'pairs': .*pairs.jsonl row 3: no 'rejected' column"):
        next(build_dataloader(config(registry, ["pairs"], shuffle=False), tokenizer, 1, stage="dpo"))
    loader = build_dataloader(config(registry, ["pairs"], on_bad_row="skip"), tokenizer, 1, stage="dpo")
    batch = next(loader)
    assert batch["seq_role"].tolist()[0][:2] == [ROLE_CHOSEN, ROLE_REJECTED]
    assert loader.stats()["bad_rows"] == {"pairs": 1}


def test_kto_sequences_travel_with_their_kl_twin(tokenizer, llamafactory_dir: Path) -> None:
    batch = next(build_dataloader(config(llamafactory_dir, ["kto_en_demo"], packing=False), tokenizer, 4,
                                  stage="kto"))
    for row in range(4):
        assert batch["seq_role"][row].tolist()[1] == ROLE_KL
        (own, _), (twin, twin_labels) = segments(batch, row)[:2]
        prompt = twin_labels.index(next(t for t in twin_labels if t != IGNORE_INDEX))
        assert twin[:prompt] == own[:prompt]  # its own prompt, another example's response


def test_eval_split_keeps_pairs_together(tokenizer, llamafactory_dir: Path) -> None:
    batches = build_eval_batches(config(llamafactory_dir, ["dpo_en_demo"], val_size=6), tokenizer, 2, stage="dpo")
    roles = torch.cat([b["seq_role"].reshape(-1) for b in batches])
    assert (roles == ROLE_CHOSEN).sum() == (roles == ROLE_REJECTED).sum() == 6


def test_config_refuses_what_a_stage_cannot_run() -> None:
    with pytest.raises(ConfigError, match="pref.loss: 'dpop' is not a loss stage dpo runs; use one of sigmoid, ipo, "
                                          "hinge, orpo, simpo"):
        load_run_config(None, ["training.stage=dpo", "pref.loss=dpop"])
    with pytest.raises(ConfigError, match="training.stage dpo does not run on the Ray cluster .*; run it on the "
                                          "single engine with `mt-ray train` and cluster.num_workers: 1"):
        load_run_config(None, ["training.stage=dpo", "cluster.num_workers=2"])
    with pytest.raises(ConfigError, match="pref.loss: 'ipo' is not a loss stage kto runs; use one of sigmoid"):
        load_run_config(None, ["training.stage=kto", "pref.loss=ipo"])
