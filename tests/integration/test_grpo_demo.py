"""The GRPO demo: `mt-ray train --config jobs/configs/grpo_demo.yaml` samples, scores and trains the built-in
tiny model on the CPU, its mean reward rises on its own logged metrics, and its summary carries TRL's names."""

from tests.conftest import train_demo


def test_grpo_demo_trains_and_its_reward_rises(tmp_path):
    logged, summary = train_demo("jobs/configs/grpo_demo.yaml", tmp_path)
    rewards = [m["reward"] for m in logged]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.1  # the share of digits the model writes
    assert {"reward_std", "frac_reward_zero_std", "rewards/digits/mean", "rewards/accuracy/mean",
            "rewards/format/std", "completions/mean_length", "completions/clipped_ratio", "clip_ratio/region_mean",
            "rollout/refresh_s", "rollout/tokens_per_s"} <= set(summary)
    assert summary["data"]["prompts"] == 40 * 4 and summary["checkpoint"].endswith("step-00000040")
