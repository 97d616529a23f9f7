"""Preference data: LLaMA-Factory's ranking (sharegpt, alpaca) and KTO entries, pairs kept in one row, bad rows."""

from __future__ import annotations

import json
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


def test_sharegpt_ranking_and_kto_bad_rows_are_named_or_skipped(tokenizer, tmp_path: Path) -> None:
    prompt = [{"from": "human", "value": "hi"}]
    pairs = [{"conversations": prompt, "chosen": {"from": "gpt", "value": "hello"},
              "rejected": {"from": "gpt", "value": "go away"}} for _ in range(4)]
    del pairs[1]["chosen"]
    feedback = [{"conversations": [*prompt, {"from": "gpt", "value": "hello"}], "label": i % 2 == 0} for i in range(4)]
    feedback[2]["label"] = "yes"
    write_jsonl(tmp_path / "pairs.jsonl", pairs)
    write_jsonl(tmp_path / "feedback.jsonl", feedback)
    registry = write_registry(tmp_path, {
        "pairs": {"file_name": "pairs.jsonl", "ranking": True, "formatting": "sharegpt",
                  "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"}},
        "feedback": {"file_name": "feedback.jsonl", "formatting": "sharegpt",
                     "columns": {"messages": "conversations", "kto_tag": "label"}}})
    for name, stage, problem in (("pairs", "dpo", r"pairs.jsonl row 2: no 'chosen' column"),
                                 ("feedback", "kto", r"feedback.jsonl row 3: column 'label' \(the KTO tag\) must "
                                                     "be true or false, got str 'yes'")):
        with pytest.raises(DatasetError, match=f"dataset '{name}': .*{problem}"):
            next(build_dataloader(config(registry, [name], shuffle=False), tokenizer, 4, stage=stage))
        loader = build_dataloader(config(registry, [name], on_bad_row="skip"), tokenizer, 1, stage=stage)
        next(loader)
        assert loader.stats()["bad_rows"] == {name: 1}


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
    load_run_config(None, ["training.stage=dpo", "cluster.num_workers=2"])  # the cluster trains preference stages
    with pytest.raises(ConfigError, match="cluster.num_workers: stage kto estimates its KL term over each whole "
                                          "micro-batch, .* at least 2"):
        load_run_config(None, ["training.stage=kto", "cluster.num_workers=2", "training.grad_accum_steps=1"])
    with pytest.raises(ConfigError, match="pref.loss: 'ipo' is not a loss stage kto runs; use one of sigmoid"):
        load_run_config(None, ["training.stage=kto", "pref.loss=ipo"])


def v1_text(message: dict) -> str:
    return "".join(part["value"] for part in message["content"])


def test_llamafactory_v1_pairs_are_read_as_they_are(tokenizer, llamafactory_dir: Path) -> None:
    path = llamafactory_dir / "v1_dpo_demo.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    loader = build_dataloader(config(None, [str(path)], max_seq_len=4096, packing=False, shuffle=False), tokenizer,
                              1, stage="dpo")
    for row in rows:  # unshuffled and unpacked: one pair a row, in file order
        batch = next(loader)
        assert batch["seq_role"][0, :2].tolist() == [ROLE_CHOSEN, ROLE_REJECTED]
        (c_ids, c_labels), (r_ids, r_labels) = segments(batch, 0)
        prompt = c_labels.index(next(t for t in c_labels if t != IGNORE_INDEX))
        assert c_ids[:prompt] == r_ids[:prompt] and r_labels[:prompt] == [IGNORE_INDEX] * prompt  # one prompt, masked
        shown = tokenizer.decode(c_ids[:prompt])
        assert all(v1_text(m) in shown for m in row["chosen_messages"][:-1])  # system and user turns, untrained
        for labels, messages in ((c_labels, "chosen_messages"), (r_labels, "rejected_messages")):
            trained = tokenizer.decode([t for t in labels if t != IGNORE_INDEX])
            assert trained == v1_text(row[messages][-1]) + "<|im_end|>"  # the last message alone carries loss


def test_llamafactory_v1_stages_and_bad_rows(tokenizer, llamafactory_dir: Path, tmp_path: Path) -> None:
    pair, sft = llamafactory_dir / "v1_dpo_demo.jsonl", llamafactory_dir / "v1_sft_demo.jsonl"
    assert next(build_dataloader(config(None, [str(sft)]), tokenizer, 2))["input_ids"].shape == (2, 128)
    with pytest.raises(DatasetError, match=f"dataset '{pair}' is a preference .* training.stage: dpo, not sft$"):
        build_dataloader(config(None, [str(pair)]), tokenizer, 1)
    with pytest.raises(DatasetError, match=f"dataset '{sft}' is an SFT dataset, .* training.stage: sft, not dpo$"):
        build_dataloader(config(None, [str(sft)]), tokenizer, 1, stage="dpo")

    good = json.loads(pair.read_text().splitlines()[0])
    other_prompt = json.loads(json.dumps(good))
    other_prompt["rejected_messages"][-2]["content"][0]["value"] += " Another question."
    bad = write_jsonl(tmp_path / "pairs.jsonl", [good, {"chosen_messages": good["chosen_messages"]}, other_prompt,
                                                 good])
    with pytest.raises(DatasetError, match=r"pairs.jsonl row 2: no 'rejected_messages' column"):
        next(build_dataloader(config(None, [str(bad)], shuffle=False), tokenizer, 2, stage="dpo"))
    loader = build_dataloader(config(None, [str(bad)], on_bad_row="skip"), tokenizer, 1, stage="dpo")
    assert next(loader)["seq_role"][0, :2].tolist() == [ROLE_CHOSEN, ROLE_REJECTED]
    assert loader.stats()["bad_rows"] == {str(bad): 2}
    with pytest.raises(DatasetError, match=r"row 1: 'chosen_messages' and 'rejected_messages' differ before"):
        next(build_dataloader(config(None, [str(write_jsonl(tmp_path / "p.jsonl", [other_prompt]))]), tokenizer, 1,
                              stage="dpo"))

    unweighted = json.loads(sft.read_text().splitlines()[0])
    unweighted["messages"][1]["loss_weight"] = 0.0
    with pytest.raises(DatasetError, match=r"s.jsonl row 1: 'messages' message 1: loss_weight 0 on an assistant "
                                           "message; mt-ray trains every assistant message at weight 1"):
        next(build_dataloader(config(None, [str(write_jsonl(tmp_path / "s.jsonl", [unweighted]))]), tokenizer, 1))
