"""The preference demo: `mt-ray train --config jobs/configs/dpo_demo.yaml` trains the built-in tiny model on
LLaMA-Factory's dpo_en_demo on the CPU, and its reward accuracy on the training pairs rises above chance."""

from tests.conftest import train_demo


def test_dpo_demo_trains_and_its_reward_accuracy_rises(tmp_path):
    logged, summary = train_demo("jobs/configs/dpo_demo.yaml", tmp_path)
    accuracies = [m["rewards/accuracies"] for m in logged]
    assert sum(accuracies[-5:]) / 5 > 0.5  # the last 40 training pairs (8 a step)
    assert summary["final_loss"] < summary["first_loss"]
    assert summary["eval_examples"] == 16 and 0 <= summary["eval_rewards/accuracies"] <= 1
    assert {"rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"} <= set(summary)
