"""The preference demo: `mt-ray train --config jobs/configs/dpo_demo.yaml` trains the built-in tiny model on
LLaMA-Factory's dpo_en_demo on the CPU, and its reward accuracy on the training pairs rises above chance."""

from mt_ray.config.run import load_run_config
from mt_ray.training.callbacks import Callback
from mt_ray.training.launch import run


class Record(Callback):
    def __init__(self):
        self.logged = []

    def on_log(self, trainer, step, metrics):
        self.logged.append(metrics)


def test_dpo_demo_trains_and_its_reward_accuracy_rises(tmp_path):
    cfg = load_run_config("jobs/configs/dpo_demo.yaml", ["training.steps=40", "training.log_every=2",
                                                         f"training.storage={tmp_path}", "engine.device=cpu",
                                                         "tracking.enabled=false"])
    record = Record()
    summary = run(cfg, [record])
    accuracies = [m["rewards/accuracies"] for m in record.logged]
    assert sum(accuracies[-5:]) / 5 > 0.5  # the last 40 training pairs (8 a step)
    assert summary["final_loss"] < summary["first_loss"]
    assert summary["eval_examples"] == 16 and 0 <= summary["eval_rewards/accuracies"] <= 1
    assert {"rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"} <= set(summary)
