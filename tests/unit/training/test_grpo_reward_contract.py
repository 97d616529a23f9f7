"""A reward function written for TRL's conversational data (`completion[0]["content"]`, the prompt's messages,
the row's columns, `trainer_state`, `log_metric`) scores the same completions in mt-ray as in TRL's `GRPOTrainer`:
the same arguments, the same rewards, the same advantages. TRL gets the completions through `rollout_func`."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import TrainerState

from mt_ray.data import DataConfig, load_tiny_tokenizer
from mt_ray.training.grpo.prompts import read_prompts
from mt_ray.training.grpo.rewards import RewardLogs, Rewards, advantages_and_metrics, trl_arguments
from tests.tiny_models import VOCAB, reference_model, tiny_config

trl = pytest.importorskip("trl")
os.environ.setdefault("TQDM_DISABLE", "1")
G = 4
ROWS = [{"prompt": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": f"What is {i}+{i}?"}],
         "answer": str(2 * i)} for i in range(2)]


class Recorded:
    """A TRL-style conversational reward that keeps what it was called with."""

    def __init__(self):
        self.calls: list[dict] = []
        self.__name__ = "conversational"

    def __call__(self, prompts, completions, answer, completion_ids, trainer_state, log_metric, **kwargs):
        self.calls.append({"prompts": prompts, "completions": completions, "answer": answer,
                           "completion_ids": [list(c) for c in completion_ids],
                           "keys": sorted({"prompts", "completions", "answer", "completion_ids", "trainer_state",
                                           "log_metric", *kwargs})})
        log_metric("conversational/length", sum(len(c[0]["content"]) for c in completions) / len(completions))
        return [len(c[0]["content"]) % 5 + float(a in p[-1]["content"]) + trainer_state.global_step
                for p, c, a in zip(prompts, completions, answer, strict=True)]


def completion_ids() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, VOCAB, (2 + k % 5,), generator=g).tolist() for k in range(len(ROWS) * G)]


def theirs(tmp_path, reward, ids):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    def rollout_func(prompts, trainer):
        return {"prompt_ids": [[5, 6, 7]] * len(prompts), "completion_ids": ids, "logprobs": None}

    args = GRPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False,
                      per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=G,
                      max_completion_length=8)
    rows = [r for r in ROWS for _ in range(G)]
    trainer = GRPOTrainer(model=reference_model(tiny_config("llama")), reward_funcs=[reward], args=args,
                          train_dataset=Dataset.from_list(rows), processing_class=load_tiny_tokenizer(),
                          rollout_func=rollout_func)
    trainer.current_gradient_accumulation_steps = 2
    return trainer._generate_and_score_completions(rows)["advantages"]


def ours(tmp_path, reward, ids):
    (tmp_path / "rows.json").write_text(json.dumps(ROWS))
    (tmp_path / "dataset_info.json").write_text(json.dumps({"conv": {
        "file_name": "rows.json", "formatting": "sharegpt", "columns": {"messages": "prompt"},
        "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant",
                 "system_tag": "system"}}}))
    tokenizer = load_tiny_tokenizer()
    data = DataConfig(registry=tmp_path, datasets=["conv"], template="chatml")
    grouped = [p for p in read_prompts(data, tokenizer, 64) for _ in range(G)]
    texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
    rewards = Rewards(["conversational"], [reward], torch.tensor([1.0]))
    logs = RewardLogs()
    per_func = rewards.score(*trl_arguments(grouped, texts, ids, TrainerState(global_step=0), logs))
    advantages, metrics = advantages_and_metrics(per_func, rewards, G, "group")
    return advantages, {**metrics, **logs.means()}


def test_a_trl_conversational_reward_scores_the_same_in_mt_ray(tmp_path):
    ids = completion_ids()
    trl_reward, our_reward = Recorded(), Recorded()
    trl_advantages = theirs(tmp_path, trl_reward, ids)
    advantages, metrics = ours(tmp_path, our_reward, ids)
    (trl_call,), (our_call,) = trl_reward.calls, our_reward.calls
    assert our_call == trl_call  # prompts as messages, completions as [{"role": "assistant", ...}], columns, kwargs
    assert our_call["prompts"][0] == ROWS[0]["prompt"] and our_call["completions"][0][0]["role"] == "assistant"
    torch.testing.assert_close(advantages, trl_advantages, rtol=1e-6, atol=1e-6)
    assert metrics["conversational/length"] > 0
