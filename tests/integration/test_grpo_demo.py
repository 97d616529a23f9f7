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


def test_a_reward_module_in_the_working_folder_and_its_failure_in_one_line(tmp_path):
    """As the `mt-ray` script runs (`-P`: the working folder is not on sys.path), `grpo.rewards=[my_rewards:f]`
    imports `my_rewards.py` from the folder the run starts in; prompts that `grpo.max_prompt_length` cuts are said
    once before the banner; a reward that raises ends the command in one line naming it, exit status 2."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    (tmp_path / "my_rewards.py").write_text("def fails(prompts, completions, **kwargs):\n    raise ValueError('no score')\n")
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "mt_ray.cli.main", "train", "--config", f"{ROOT}/jobs/configs/grpo_demo.yaml",
         "grpo.rewards=[my_rewards:fails]", "data.template=qwen", "grpo.max_prompt_length=32", "training.steps=1",
         "tracking.enabled=false"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith("mt-ray train: error: reward 'fails' raised on completion 0 (prompt ")
    assert proc.stderr.strip().endswith("ValueError: no score")
    assert proc.stdout.splitlines()[:2] == ["mt-ray train: starting (loading torch and transformers)", (
        "grpo.max_prompt_length 32: 200 of 200 prompts are longer and keep only their last 32 tokens; raise "
        "grpo.max_prompt_length to keep them whole")]
