"""A run with a held-out split reports its eval loss (progress, MLflow, summary.json), and it is transformers' loss."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from mt_ray.config.run import load_run_config
from mt_ray.errors import ConfigError
from mt_ray.training import Trainer
from mt_ray.training.launch import build_callbacks
from mt_ray.training.run_dir import RunDir


def run_config(tmp_path, *overrides: str):
    return load_run_config(None, [
        "training.steps=4", "training.micro_batch_size=2", "training.grad_accum_steps=2", "training.log_every=1",
        "data.max_seq_len=64", "data.val_size=24", "engine.device=cpu", f"training.storage={tmp_path}",
        "training.run_name=run",  # the MLflow store: <storage>/mlflow.db
        "tracking.experiment=eval", *overrides])


def transformers_loss(folder, batches: list[dict[str, torch.Tensor]]) -> float:
    """Mean token loss of `batches` under the exported model, as transformers computes it."""
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for b in batches:
            n = int((b["labels"][:, 1:] != -100).sum())
            total += model(input_ids=b["input_ids"], labels=b["labels"], position_ids=b["position_ids"],
                           use_cache=False).loss.item() * n
            tokens += n
    return total / tokens


def test_eval_loss_is_logged_summarised_and_equals_transformers_loss(tmp_path):
    from mlflow import MlflowClient

    cfg = run_config(tmp_path, "training.eval_every=2")
    run = RunDir(cfg)
    trainer = Trainer(cfg, build_callbacks(cfg, run), run)
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
    assert [e["step"] for e in trainer.eval_history] == [2, 4]  # every 2 steps; the end (step 4) is not repeated
    assert summary["eval_perplexity"] == pytest.approx(math.exp(summary["eval_loss"]))
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["eval_loss"] == summary["eval_loss"]
    # The held-out rows under the trained weights, scored by transformers from the exported folder.
    assert summary["eval_loss"] == pytest.approx(transformers_loss(summary["exported_model"], trainer.eval_batches),
                                                 rel=1e-5)

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("eval").experiment_id])
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "eval_loss")}
    assert history == {e["step"]: pytest.approx(e["eval_loss"]) for e in trainer.eval_history}
    assert run.data.metrics["eval_perplexity"] == pytest.approx(summary["eval_perplexity"])


def test_a_run_with_a_split_is_evaluated_at_its_end_without_eval_every(tmp_path):
    cfg = run_config(tmp_path, "tracking.enabled=false", "training.export=false", "training.steps=3")
    trainer = Trainer(cfg)
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
    assert [e["step"] for e in trainer.eval_history] == [3] and summary["eval_tokens"] > 0


def test_eval_every_without_a_split_names_the_fix():
    with pytest.raises(ConfigError, match=r"training.eval_every: there is nothing to evaluate on; hold out rows "
                                          r"with data.val_size"):
        load_run_config(None, ["training.eval_every=10"])


def test_val_size_larger_than_the_data_is_refused_before_the_model_is_built(tmp_path):
    with pytest.raises(ConfigError, match=r"data.val_size: 5000 holds out 5000 rows, but data.datasets hold only 700"):
        Trainer(run_config(tmp_path, "data.val_size=5000", "tracking.enabled=false"))
