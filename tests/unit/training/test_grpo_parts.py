"""GRPO's parts apart from the loss (test_grpo_trl.py): its config, prompts, rewards and rollout rows, and the
refusals of bad input, each in one line naming the problem."""

from __future__ import annotations

import json

import pytest
import torch

from mt_ray.config.run import load_run_config
from mt_ray.data import DataConfig, load_tiny_tokenizer
from mt_ray.data.schema import IGNORE_INDEX
from mt_ray.engine.grpo import GrpoConfig, RewardConfig
from mt_ray.errors import ConfigError
from mt_ray.training.grpo.prompts import PromptStream, read_prompts
from mt_ray.training.grpo.rewards import RewardError, Rewards, accuracy, format_reward, load_rewards
from mt_ray.training.grpo.rollout import Rollout, completion_batches, cut_completions

GRPO = ["training.stage=grpo", "training.micro_batch_size=4", "training.grad_accum_steps=2",
        "grpo.num_generations=4", "data.datasets=[demo_math_prompts]"]


def test_defaults_are_trls():
    trl = pytest.importorskip("trl")
    theirs = trl.GRPOConfig(output_dir="/tmp/mt-ray-trl", report_to=[], use_cpu=True, bf16=False)
    ours = GrpoConfig()
    for key in ("num_generations", "max_completion_length", "temperature", "top_p", "beta", "epsilon",
                "epsilon_high", "num_iterations", "scale_rewards", "loss_type", "mask_truncated_completions",
                "use_bias_correction_kl"):
        assert getattr(ours, key) == getattr(theirs, key), key


@pytest.mark.parametrize("override, message", [
    ("grpo.num_generations=1", "grpo.num_generations: 1: a group of one completion has advantage 0"),
    ("training.micro_batch_size=3", "must be whole groups of grpo.num_generations (4)"),
    ("grpo.loss_type=cispo", "grpo.loss_type: Input should be 'grpo', 'bnpo', 'dr_grpo' or 'dapo'"),
    ("grpo.rewards=[{name: nope}]", "'nope' is neither a built-in reward (accuracy, format) nor a 'module:function'"),
    ("data.val_size=8", "training.stage grpo has no held-out evaluation yet"),
    ("rollout.engine=sglang", "rollout.engine: Input should be 'transformers' or 'vllm'"),
])
def test_bad_config_is_refused_in_one_line(override, message):
    with pytest.raises(ConfigError) as e:
        load_run_config(None, [*GRPO, override])
    assert message in str(e.value)


def test_trl_boolean_scale_rewards():
    assert load_run_config(None, [*GRPO, "grpo.scale_rewards=false"]).grpo.scale_rewards == "none"


def test_prompts_carry_their_columns_and_long_ones_are_cut(tmp_path):
    rows = [{"instruction": "What is 2 + 2?", "output": "#### 4", "answer": 4},
            {"instruction": "x " * 200, "answer": 1}]
    (tmp_path / "p.json").write_text(json.dumps(rows))
    (tmp_path / "dataset_info.json").write_text(json.dumps({"p": {"file_name": "p.json"}}))
    data = DataConfig(datasets=["p"], registry=tmp_path)
    prompts = read_prompts(data, load_tiny_tokenizer(), max_prompt_length=32)
    assert prompts[0].columns == {"answer": 4}  # the response column is the row's, not the prompt's
    assert "What is 2 + 2?" in prompts[0].text and "#### 4" not in prompts[0].text
    assert prompts[0].text.endswith("<|im_start|>assistant\n")  # the generation prompt
    assert not prompts[0].cut and prompts[1].cut and len(prompts[1].ids) == 32
    stream = PromptStream(prompts, seed=3)
    drawn = stream.take(3)  # an epoch and one more
    assert stream.state_dict() == {"epoch": 1, "index": 1, "drawn": 3, "cut": sum(p.cut for p in drawn)}
    again = PromptStream(prompts, seed=3)
    again.load_state_dict(stream.state_dict())
    assert again.take(1) == stream.take(1)  # a resumed run draws the same prompts


def test_demo_prompts_hold_answers():
    prompts = read_prompts(DataConfig(datasets=["demo_math_prompts"]), load_tiny_tokenizer(), 64)
    assert len(prompts) == 200 and all(isinstance(p.columns["answer"], int) for p in prompts)


def test_built_in_rewards():
    pytest.importorskip("math_verify")
    completions = ["so 3 + 4 = 7 #### 7", "#### 8", "seven"]
    assert accuracy(["p"] * 3, completions, answer=[7, 7, 7]) == [1.0, 0.0, 0.0]
    assert format_reward(["p"] * 3, completions) == [1.0, 1.0, 0.0]


def fails_on_second(prompts, completions, **_):
    if any(c == "b" for c in completions):
        raise KeyError("boom")
    return [1.0] * len(completions)


def too_few(prompts, completions, **_):
    return [1.0]


@pytest.mark.parametrize("func, message", [
    (fails_on_second, "reward 'f' raised on completion 1 (prompt 'q'): KeyError: 'boom'"),
    (too_few, "reward 'f' returned 1 rewards for 3 completions"),
])
def test_a_failing_reward_is_named_with_its_completion(func, message):
    rewards = Rewards(["f"], [func], torch.ones(1))
    with pytest.raises(RewardError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        rewards.score(["p", "q", "r"], ["a", "b", "c"], {})


def test_user_rewards_are_imported_by_path():
    rewards = load_rewards([RewardConfig(name="jobs.rewards:digits", weight=2.0)])
    assert rewards.names == ["digits"] and rewards.weights.tolist() == [2.0]
    assert rewards.score(["p"], ["a1 2"], {}).tolist() == [[pytest.approx(2 / 3)]]
    with pytest.raises(ConfigError, match="grpo.rewards: cannot import 'jobs.rewards:nothing'"):
        load_rewards([RewardConfig(name="jobs.rewards:nothing")])


def test_completion_rows_mask_truncated_ones_but_count_them():
    completions, truncated = cut_completions([[5, 6, 2, 1, 1], [7, 8, 9, 10, 11]], eos_ids={2}, pad_id=1)
    assert completions == [[5, 6, 2], [7, 8, 9, 10, 11]] and truncated == [False, True]
    rollout = Rollout([[3, 4], [3, 4]], completions, truncated)
    (batch,) = completion_batches(rollout, torch.tensor([0.5, -0.5]), mask_truncated=True, micro_batch_size=2,
                                  pad_id=1)
    assert batch["labels"][0].tolist() == [IGNORE_INDEX, IGNORE_INDEX, 5, 6, 2, IGNORE_INDEX, IGNORE_INDEX]
    assert (batch["labels"][1] == IGNORE_INDEX).all()
    assert batch["seq_role"][:, 0].tolist() == [6, 6] and batch["advantages"].tolist() == [[0.5, 0.0], [-0.5, 0.0]]


def test_a_grpo_step_without_advantages_is_refused():
    from mt_ray.engine import EngineConfig, OptimizerConfig, StreamingEngine
    from mt_ray.models.discovery import discover
    from tests.tiny_models import tiny_config

    rollout = Rollout([[3, 4]], [[5, 6, 2]], [False])
    (batch,) = completion_batches(rollout, torch.zeros(1), mask_truncated=False, micro_batch_size=1, pad_id=1)
    del batch["advantages"]
    engine = StreamingEngine(discover(tiny_config("llama")), EngineConfig(device="cpu", compute_dtype="fp32"),
                             OptimizerConfig(), total_steps=1, stage="grpo", grpo=GrpoConfig(num_generations=2))
    try:
        with pytest.raises(ValueError, match="a GRPO step needs each batch's advantages"):
            engine.train_step([batch])
    finally:
        engine.close()


def test_vllm_rollouts_are_refused_by_name():
    """Where vLLM is missing the refusal says how to install it; where it is present, that the push is not built."""
    import importlib.util

    expected = ("rollout.engine: vllm: mt-ray does not push its weights into vLLM yet" if importlib.util.find_spec("vllm")
                else "rollout.engine: vllm is not installed here: pip install vllm")
    with pytest.raises(ConfigError) as e:
        load_run_config(None, [*GRPO, "rollout.engine=vllm"])
    assert expected in str(e.value) and "rollout.engine: transformers" in str(e.value)


def test_grpo_on_the_cluster_needs_whole_micro_batches_per_worker():
    """Its loss is normalised per micro-batch (grpo, bnpo, dr_grpo) and its clip extremes are per micro-batch: each
    worker trains whole ones, so a step needs at least as many as there are workers, refused at load."""
    load_run_config(None, [*GRPO, "cluster.num_workers=2", "training.grad_accum_steps=2"])
    with pytest.raises(ConfigError, match="cluster.num_workers: stage grpo normalises its loss by each whole "
                                          "micro-batch, .* training.grad_accum_steps of at least 4"):
        load_run_config(None, [*GRPO, "cluster.num_workers=4", "training.grad_accum_steps=2"])
