"""What a run prints when its output is not a terminal (a file, a Ray job's log): a banner, one line per
log_every steps and no progress-bar frames; the libraries' INFO chatter kept out unless MT_RAY_VERBOSE; GRPO's
last line gives the reward."""

import logging

from jobs.train import main
from mt_ray.config.run import load_run_config
from mt_ray.training.launch import done_line
from mt_ray.verbosity import VERBOSE_ENV, quiet_libraries


def test_a_run_into_a_file_prints_a_banner_and_one_line_per_log(tmp_path, capsys):
    assert main(["training.steps=4", "training.log_every=2", f"training.storage={tmp_path}", "training.run_name=r",
                 "engine.device=cpu", "tracking.enabled=false", "data.max_seq_len=64", "training.export=false"]) == 0
    captured = capsys.readouterr()
    starting, *lines = captured.out.splitlines()
    assert starting == "jobs.train: starting (loading torch and transformers)"
    assert lines[0] == "run r: sft of tiny (Qwen2ForCausalLM, 0.9 M parameters) on cpu, float32"
    assert lines[1].startswith("  data demo_alpaca, demo_sharegpt (template tokenizer, packed rows of 64 tokens); "
                               "4 steps of 4 x 2 rows")
    assert lines[2].startswith(f"  outputs {tmp_path}/r (checkpoints every 50 steps); tracking off")
    assert [line.split(":")[0] for line in lines[3:5]] == ["step 2/4", "step 4/4"]
    assert lines[5].startswith("done: 4 steps, loss ")
    assert "\r" not in captured.err and "train:" not in captured.err


def test_libraries_log_warnings_only_unless_verbose(monkeypatch):
    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    monkeypatch.delenv("MLFLOW_LOGGING_LEVEL", raising=False)
    quiet_libraries()
    assert logging.getLogger("mlflow").level == logging.WARNING and logging.getLogger("ray").level == logging.WARNING
    monkeypatch.setenv(VERBOSE_ENV, "1")
    quiet_libraries()
    assert logging.getLogger("mlflow").level == logging.INFO


def test_grpo_ends_with_its_reward():
    cfg = load_run_config("jobs/configs/grpo_demo.yaml")
    summary = {"steps": 8, "first_loss": 0.0, "final_loss": -0.0, "exported_model": "out"}
    assert done_line(cfg, summary, [{"loss": 0.0, "reward": 0.14}, {"loss": -0.0, "reward": 0.6}]) == (
        "done: 8 steps, reward 0.140 -> 0.600, model exported to out")
