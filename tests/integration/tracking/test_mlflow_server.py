"""MlflowTracker against a real ``mlflow server`` (SQLite backend), read back through its REST API."""

from __future__ import annotations

import json
import logging
import sys
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import torch
from servers import free_port, running
from transformers import AutoModelForCausalLM

from mt_ray.data import load_tiny_tokenizer
from mt_ray.tracking.mlflow_tracker import MlflowTracker, TrackingConfig
from tests.tiny_models import reference_model, tiny_config


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
           "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination", str(root / "art")]
    url = f"http://127.0.0.1:{port}"
    with running(cmd, f"{url}/health", root / "server.log", timeout_s=120):  # first start migrates the DB
        yield url


def rest(url: str, path: str, **query) -> dict:
    with urllib.request.urlopen(f"{url}{path}?{urllib.parse.urlencode(query)}", timeout=30) as r:
        return json.loads(r.read())


def artifact(url: str, run_id: str, path: str) -> bytes:
    query = urllib.parse.urlencode({"run_uuid": run_id, "path": path})
    with urllib.request.urlopen(f"{url}/get-artifact?{query}", timeout=30) as r:
        return r.read()


RUN_CONFIG = {"model": {"name": "tiny-llama", "layers": 5}, "optimizer": {"lr": 0.001},
              "checkpoint": {"uri": "s3://bucket/run", "aws_secret_access_key": "very-secret"}}


def test_run_is_readable_through_rest(server):
    tracker = MlflowTracker(TrackingConfig(tracking_uri=server, experiment="it", run_name="sft-1"))
    run_id = tracker.start(RUN_CONFIG, model="tiny-llama", dataset="demo_alpaca")
    losses = [2.5, 2.0, 1.7, 1.5]
    for step, loss in enumerate(losses, start=1):
        tracker.log_metrics(step, {"loss": loss, "lr": 0.001 * step})
    tracker.log_loss_plot(range(1, 5), losses)
    tracker.log_summary({"final_loss": 1.5, "tokens": 4096, "note": "ok"})
    tracker.log_checkpoint_uri("s3://bucket/run/step-00000004")
    tracker.close()

    run = rest(server, "/api/2.0/mlflow/runs/get", run_id=run_id)["run"]
    params = {p["key"]: p["value"] for p in run["data"]["params"]}
    tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
    assert params == {"model.name": "tiny-llama", "model.layers": "5", "optimizer.lr": "0.001"}
    assert tags["mt_ray.model"] == "tiny-llama" and tags["mt_ray.dataset"] == "demo_alpaca"
    assert tags["checkpoint.latest"] == "s3://bucket/run/step-00000004" and tags["mt_ray.hardware"].startswith("cpu")
    assert run["info"]["status"] == "FINISHED" and run["info"]["run_name"] == "sft-1"
    history = rest(server, "/api/2.0/mlflow/metrics/get-history", run_id=run_id, metric_key="loss")["metrics"]
    assert [(m["step"], m["value"]) for m in history] == list(enumerate(losses, start=1))
    summary_metric = rest(server, "/api/2.0/mlflow/metrics/get-history", run_id=run_id, metric_key="summary.tokens")
    assert summary_metric["metrics"][0]["value"] == 4096

    files = {f["path"] for f in rest(server, "/api/2.0/mlflow/artifacts/list", run_id=run_id)["files"]}
    assert files == {"config.json", "loss.png", "summary.json"}
    assert artifact(server, run_id, "loss.png").startswith(b"\x89PNG")
    assert json.loads(artifact(server, run_id, "summary.json")) == {"final_loss": 1.5, "tokens": 4096, "note": "ok"}
    config = artifact(server, run_id, "config.json")
    assert b"very-secret" not in config and b"s3://" not in config and json.loads(config)["optimizer"] == {"lr": 0.001}


def test_child_runs_nest_under_parent(server):
    parent = MlflowTracker(TrackingConfig(tracking_uri=server, experiment="it-sweep", run_name="sweep"))
    parent_id = parent.start({"search": "lr"})
    child_ids = []
    for i, lr in enumerate((1e-3, 1e-4)):
        with parent.child_run(f"trial-{i}", {"lr": lr}) as trial:
            trial.log_metrics(1, {"loss": lr * 100})
            child_ids.append(trial.run_id)
    parent.close()
    for child_id, lr in zip(child_ids, (1e-3, 1e-4), strict=True):
        run = rest(server, "/api/2.0/mlflow/runs/get", run_id=child_id)["run"]
        tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
        assert tags["mlflow.parentRunId"] == parent_id and run["info"]["status"] == "FINISHED"
        assert run["data"]["metrics"][0]["value"] == pytest.approx(lr * 100)


def tiny_hf_folder(root: Path) -> Path:
    """A tiny random Llama over the tiny tokenizer's vocabulary, as a Hugging Face folder."""
    folder = root / "hf"
    tokenizer = load_tiny_tokenizer()
    reference_model(tiny_config("llama", vocab_size=len(tokenizer)), seed=3).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_hf_model_is_a_registered_mlflow_model_that_loads_back_and_generates(server, tmp_path, monkeypatch, caplog):
    import mlflow.transformers
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", server)  # load_model resolves models:/ URIs through it
    folder = tiny_hf_folder(tmp_path)
    tracker = MlflowTracker(TrackingConfig(tracking_uri=server, experiment="it-model", register_as="tiny-llama",
                                           system_metrics=False))
    run_id = tracker.start({})
    with caplog.at_level(logging.INFO):
        uri = tracker.log_hf_model(folder, step=3)
    tracker.close()
    assert "hub" not in caplog.text.lower() and "license" not in caplog.text.lower()  # no Hub lookup, no warning

    client = MlflowClient(server)
    [output] = client.get_run(run_id).outputs.model_outputs  # the run page's "Logged models"
    assert uri == f"models:/{output.model_id}" and output.step == 3
    model = client.get_logged_model(output.model_id)
    assert model.status == "READY" and model.source_run_id == run_id
    [version] = client.search_model_versions("name='tiny-llama'")
    assert version.run_id == run_id and version.version == "1"

    loaded = mlflow.transformers.load_model(uri, return_type="components")
    original = AutoModelForCausalLM.from_pretrained(folder)
    ids = torch.tensor([[1, 5, 17, 42, 9, 3]])
    with torch.no_grad():
        assert torch.equal(loaded["model"](ids).logits, original(ids).logits)
    assert loaded["tokenizer"]("hello world")["input_ids"] == load_tiny_tokenizer()("hello world")["input_ids"]

    generate = mlflow.transformers.load_model("models:/tiny-llama/1")  # the registered version, as a pipeline
    torch.manual_seed(0)
    [out] = generate("hello", max_new_tokens=6, do_sample=False)
    assert out["generated_text"].startswith("hello") and len(out["generated_text"]) > len("hello")
