"""``MlflowTracker``: one MLflow run per training job (child runs for Ray Tune trials).

Everything goes through an explicit ``MlflowClient`` and run id, never MLflow's global "active
run", so a tracker, its child runs and the trials of a sweep do not step on each other. Params
are the flattened run config minus anything that looks like a credential or a URI; the same
redacted config is stored as ``config.json``. mlflow is imported when a run starts, so a job
with tracking off does not need it installed.

    tracker = MlflowTracker(TrackingConfig(experiment="sft"))
    tracker.start(run_config, model="Qwen/Qwen2.5-7B", dataset="alpaca")
    try:
        ... if tracker.config.should_log(step): tracker.log_metrics(step, {"loss": loss})
        ... tracker.log_checkpoint_uri(ckpt.save(step, tensors, meta))
        tracker.log_hf_model(export_dir)
    finally:
        tracker.close("FINISHED" or "FAILED")
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import platform
import re
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import psutil
import torch
from pydantic import BaseModel, ConfigDict, Field

from mt_ray.tracking.stores import allow_file_store

if TYPE_CHECKING:
    from mlflow import MlflowClient

logger = logging.getLogger(__name__)

RunStatus = Literal["FINISHED", "FAILED", "KILLED"]
ERROR_TAG = "mt_ray.error"  # on a FAILED run: the error that ended it (its type and first line)
# A key is secret when one of its words (split on . _ - and spaces) or adjacent word pairs is here;
# word-wise so that max_tokens, pad_token_id or security_level stay visible.
_SECRET_WORDS = {"secret", "password", "passwd", "credential", "credentials", "apikey", "token", "uri", "url",
                 "endpoint", "dsn"}
_SECRET_PAIRS = {("api", "key"), ("access", "key"), ("secret", "key"), ("key", "id"), ("hf", "token"),
                 ("api", "token"), ("access", "token"), ("auth", "token"), ("session", "token"),
                 ("refresh", "token"), ("bearer", "token")}
_NOT_SECRET_PAIRS = {("token", "id"), ("pad", "token"), ("bos", "token"), ("eos", "token"), ("unk", "token")}
_MAX_PARAM_CHARS = 6000  # MLflow's limit on a param value
_PARAMS_PER_BATCH = 100  # MLflow's limit on params in one log_batch call
# MLflow 3's UI opens an experiment with this tag in its model-training view rather than the GenAI one.
EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND = "mlflow.experimentKind", "custom_model_development"


class TrackingConfig(BaseModel):
    """MLflow run tracking. Unknown keys are rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    enabled: bool = True
    """Track the run in MLflow; off, every tracker call does nothing (and mlflow need not be installed)."""

    tracking_uri: str | None = None
    """``http://host:5000``, ``sqlite:///mlflow.db``, ``file:mlruns`` (MLflow's file store: ``stores``),
    ``databricks``...; ``None`` = ``MLFLOW_TRACKING_URI``,
    else (in an mt-ray run) the store in ``training.storage``. A run takes a relative local path from the
    directory its command was launched in, and refuses one under ``ray job submit``."""

    experiment: str = "mt-ray"
    """Experiment name; created if missing."""

    run_name: str | None = None
    """Run name shown in the UI; ``None`` lets MLflow pick one."""

    parent_run_id: str | None = None
    """Nest the run under this MLflow run (a sweep sets it: each trial is a child of the sweep's run)."""

    tags: dict[str, str] = Field(default_factory=dict)
    """Extra tags on the run (a sweep tags each trial with its trial id and sampled values)."""

    artifact_location: str | None = None
    """Where an experiment created by this tracker keeps its artifacts; ``None``: ``mlartifacts/`` beside a
    SQLite store's database, else the store's default."""

    log_every: int = Field(default=10, ge=1)
    """Log step metrics every this many optimizer steps (see ``should_log``)."""

    system_metrics: bool = True
    """Log host CPU, memory, disk and network (``system/*``), and GPU utilization and memory where
    ``nvidia-ml-py`` is installed (the ``gpu`` extra), every ``system_metrics_interval_s``."""

    system_metrics_interval_s: float = Field(default=10.0, gt=0)
    """Seconds between two system-metrics samples."""

    register_as: str | None = None
    """Also register the exported model in the MLflow model registry under this name (a new version each run)."""

    def should_log(self, step: int) -> bool:
        return self.enabled and step % self.log_every == 0


class MlflowTracker:
    """Logs one run; ``client`` is the seam for a pre-built ``MlflowClient``."""

    def __init__(self, config: TrackingConfig, client: MlflowClient | None = None):
        self.config = config
        self._client = client
        self.run_id: str | None = None
        self.logged_until = 0
        """The last step a reopened run has a `loss` for: a resume replays the steps after its checkpoint up to it,
        and their metrics (the same values: a resume is exact) are not logged twice."""
        self._system_metrics = None

    @property
    def active(self) -> bool:
        return self.run_id is not None

    def start(self, run_config: Mapping[str, Any], *, model: str | None = None, dataset: str | None = None,
              tags: Mapping[str, str] | None = None, parent_run_id: str | None = None,
              resume_run_id: str | None = None) -> str | None:
        """Open the run: params from ``run_config`` (flattened, redacted), tags for model, dataset,
        git commit and hardware. ``parent_run_id`` nests it (a Ray Tune trial in its own process).
        ``parent_run_id`` and ``tags`` default to the config's (a sweep's trial sets them there).
        ``resume_run_id`` continues that run (a resumed training run: one run, continuous curves)
        when the store still has it. Other runs of this ``run_name`` left ``RUNNING`` by a process
        that died are marked ``KILLED`` first. Returns the run id, or ``None`` with tracking off."""
        if not self.config.enabled:
            return None
        experiment_id = self.experiment_id()
        parent_run_id = parent_run_id or self.config.parent_run_id
        if self.config.run_name is not None and parent_run_id is None:
            self._end_abandoned(experiment_id, keep=resume_run_id)
        self.run_id = self._reopen(resume_run_id) if resume_run_id else None
        resumed = self.run_id is not None
        if not resumed:
            all_tags = {**run_tags(model, dataset), **self.config.tags, **(tags or {})}
            if parent_run_id is not None:
                all_tags["mlflow.parentRunId"] = parent_run_id
            run = self.client.create_run(experiment_id, run_name=self.config.run_name, tags=all_tags)
            self.run_id = run.info.run_id
            self._log_params(flatten_params(run_config))  # params are write-once: a resumed run keeps its own
            self._log_json(redact(run_config), "config.json")
        if self.config.system_metrics and parent_run_id is None:
            self._start_system_metrics(resumed)
        return self.run_id

    def log_resume(self, checkpoint: str, step: int) -> None:
        """Record a resume: the ``mt_ray.resumed_from`` tag, and a ``resumed_at_step`` point at that step."""
        if not self.active:
            return
        self.client.set_tag(self.run_id, "mt_ray.resumed_from", f"{checkpoint} (step {step})")
        self.log_metrics(step, {"resumed_at_step": step})

    @property
    def client(self) -> MlflowClient:
        if self._client is None:
            from mlflow import MlflowClient  # optional dependency, imported when tracking is on

            uri = self.config.tracking_uri
            if uri is not None and uri.startswith("sqlite:///"):  # SQLite creates the file, not its folder
                Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
            allow_file_store(uri)  # a file store the user named: MLflow's own opt-out of its maintenance error
            self._client = MlflowClient(tracking_uri=uri)
        return self._client

    def log_metrics(self, step: int, metrics: Mapping[str, float | int | torch.Tensor]) -> None:
        """Log scalar metrics at ``step``. A tracking-server failure is logged and training goes on."""
        if not self.active:
            return
        from mlflow.entities import Metric
        from mlflow.exceptions import MlflowException

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        try:
            self.client.log_batch(self.run_id, metrics=batch)
        except MlflowException as e:  # a tracking-server hiccup must not kill a multi-day run
            logger.warning("MLflow dropped metrics of step %d: %s", step, e)

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        """Store end-of-run results as ``summary.json`` (and numbers as ``summary.*`` metrics)."""
        if not self.active:
            return
        self._log_json(dict(summary), "summary.json")
        numbers = {f"summary.{k}": v for k, v in summary.items()
                   if isinstance(v, int | float) and not isinstance(v, bool)}
        if numbers:
            self.log_metrics(0, numbers)

    def log_loss_plot(self, steps: Sequence[int], losses: Sequence[float], name: str = "loss.png") -> None:
        """Plot loss against step (matplotlib, Agg canvas: no display needed) and store it as ``name``."""
        if not self.active:
            return
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(7, 4), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        ax.plot(list(steps), [float(x) for x in losses], linewidth=1.2)
        ax.set(xlabel="step", ylabel="loss", title=self.config.run_name or "training loss")
        ax.grid(alpha=0.3)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / name
            fig.savefig(path)
            self.client.log_artifact(self.run_id, str(path))

    def log_checkpoint_uri(self, uri: str) -> None:
        """Record the newest checkpoint as the ``checkpoint.latest`` tag (a tag: it changes during the run)."""
        if not self.active:
            return
        from mlflow.exceptions import MlflowException

        try:
            self.client.set_tag(self.run_id, "checkpoint.latest", uri)
        except MlflowException as e:  # as for metrics: keep training
            logger.warning("MLflow dropped the checkpoint tag %s: %s", uri, e)

    def log_hf_model(self, folder: str | os.PathLike, task: str = "text-generation", name: str = "model",
                     step: int = 0) -> str | None:
        """Log an exported Hugging Face folder (weights + tokenizer) as this run's ``mlflow.transformers`` model.

        From the folder's files, offline: the model is not loaded and the Hub is not asked (see
        ``mlflow_model``). Registered as ``register_as`` when set. Load it back with
        ``mlflow.transformers.load_model(uri)`` (a pipeline), or ``return_type="components"``.
        Returns ``models:/<model id>``.
        """
        if not self.active:
            return None
        from mt_ray.tracking.mlflow_model import log_transformers_model

        return log_transformers_model(self.client, self.run_id, folder, name=name, task=task, step=step,
                                      register_as=self.config.register_as)

    def start_child(self, name: str, run_config: Mapping[str, Any] | None = None,
                    tags: Mapping[str, str] | None = None) -> MlflowTracker:
        """Open a nested run (one Ray Tune trial) and return its tracker; the caller closes it.

        Inactive, like this tracker, when this run is not open.
        """
        child = MlflowTracker(self.config.model_copy(update={"run_name": name}), self._client)
        if self.active:
            child.start(run_config or {}, tags=tags, parent_run_id=self.run_id)
        return child

    @contextlib.contextmanager
    def child_run(self, name: str, run_config: Mapping[str, Any] | None = None) -> Iterator[MlflowTracker]:
        """A nested run (one Ray Tune trial), closed FINISHED, or FAILED if the block raises."""
        child = self.start_child(name, run_config)
        try:
            yield child
        except BaseException:
            child.close("FAILED")
            raise
        child.close("FINISHED")

    def close(self, status: RunStatus = "FINISHED", error: BaseException | None = None) -> None:
        """End the run with ``status`` (and the ``error`` that ended it, as the `mt_ray.error` tag); later calls do
        nothing."""
        if self._system_metrics is not None:
            self._stop_system_metrics()
        if self.active:
            if error is not None:
                self.client.set_tag(self.run_id, ERROR_TAG, error_line(error))
            self.client.set_terminated(self.run_id, status)
            self.run_id = None

    def _reopen(self, run_id: str) -> str | None:
        """Set run ``run_id`` back to RUNNING, without the error that ended it before, and note the last step it
        logged (`logged_until`); None (with a warning) when this store does not have it."""
        from mlflow.exceptions import MlflowException

        try:
            run = self.client.get_run(run_id)
        except MlflowException:
            logger.warning("MLflow run %s of the checkpoint is not in this store; starting a new run", run_id)
            return None
        if run.info.lifecycle_stage != "active":
            logger.warning("MLflow run %s of the checkpoint was deleted; starting a new run", run_id)
            return None
        self.client.update_run(run_id, status="RUNNING")
        if ERROR_TAG in run.data.tags:  # what ended it before; the run goes on, and a new end sets its own
            self.client.delete_tag(run_id, ERROR_TAG)
        self.logged_until = max((m.step for m in self.client.get_metric_history(run_id, "loss")), default=0)
        return run_id

    def _end_abandoned(self, experiment_id: str, keep: str | None) -> None:
        """Mark KILLED the runs of this name still RUNNING (their process died without closing them)."""
        found = self.client.search_runs(
            [experiment_id], f"attributes.run_name = '{self.config.run_name}' and attributes.status = 'RUNNING'")
        for run in found:
            if run.info.run_id != keep:
                logger.warning("MLflow run %s (%s) was left RUNNING by a process that ended; marking it KILLED",
                               run.info.run_id, self.config.run_name)
                self.client.set_terminated(run.info.run_id, "KILLED")

    def _start_system_metrics(self, resumed: bool) -> None:
        """MLflow's own sampler (psutil, and pynvml for GPUs when installed), in a daemon thread."""
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        self._system_metrics = SystemMetricsMonitor(
            self.run_id, sampling_interval=self.config.system_metrics_interval_s, resume_logging=resumed,
            tracking_uri=self.client.tracking_uri)  # the store this run is in, whichever client made it
        self._system_metrics.start()

    def _stop_system_metrics(self) -> None:
        """Stop the sampler and log one closing sample while the run is still open: MLflow's sampler drops
        its unfinished interval, so a run (or a resumed stretch) shorter than one interval would log none."""
        monitor, self._system_metrics = self._system_metrics, None
        monitor.finish()
        monitor.collect_metrics()
        monitor.publish_metrics(monitor.aggregate_metrics())
        monitor.mlflow_logger.flush()

    def experiment_id(self) -> str:
        """The configured experiment's id, the experiment created when missing."""
        from mlflow.exceptions import MlflowException

        client = self.client
        experiment = client.get_experiment_by_name(self.config.experiment)
        if experiment is not None:
            if EXPERIMENT_KIND_TAG not in experiment.tags:
                client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND)
            return experiment.experiment_id
        try:
            return client.create_experiment(self.config.experiment, artifact_location=self.config.artifact_location,
                                            tags={EXPERIMENT_KIND_TAG: MODEL_TRAINING_KIND})
        except MlflowException:  # another trial of a sweep may have created it first
            experiment = client.get_experiment_by_name(self.config.experiment)
            if experiment is None:
                raise
            return experiment.experiment_id

    def _log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), _PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=items[i:i + _PARAMS_PER_BATCH])

    def log_table(self, table: Mapping[str, Sequence[Any]], name: str) -> None:
        """Store ``table`` (columns of equal length) as the MLflow table artifact ``name`` (``.json``), which the
        UI shows as a table and ``mlflow.load_table`` reads back. A tracking-server failure is logged and training
        goes on."""
        if not self.active:
            return
        from mlflow.exceptions import MlflowException

        try:
            self.client.log_table(self.run_id, data=dict(table), artifact_file=name)
        except MlflowException as e:  # as for metrics: keep training
            logger.warning("MLflow dropped the table %s: %s", name, e)

    def log_text(self, text: str, name: str) -> None:
        """Store ``text`` as the artifact file ``name``."""
        if not self.active:
            return
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / name
            path.write_text(text)
            self.client.log_artifact(self.run_id, str(path))

    def _log_json(self, payload: Any, name: str) -> None:
        self.log_text(json.dumps(payload, indent=2, default=str), name)


def error_line(error: BaseException) -> str:
    """An error as one line: its type and the first line of its message (a run's `mt_ray.error` tag)."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:500]


def is_secret(key: str, value: Any) -> bool:
    """Keys that name credentials or locations, and values that are URIs, are never logged."""
    words = [w for w in re.split(r"[._\-\s]+", key.lower()) if w]
    pairs = set(zip(words, words[1:], strict=False))
    if pairs & _NOT_SECRET_PAIRS:
        return False
    return bool(set(words) & _SECRET_WORDS or pairs & _SECRET_PAIRS) or (isinstance(value, str) and "://" in value)


def redact(config: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``config`` with secret-looking entries replaced by ``"<redacted>"``."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            out[key] = redact(value)
        else:
            out[key] = "<redacted>" if is_secret(str(key), value) and value is not None else value
    return out


def flatten_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": "1"}``, dropping secrets; values cut to MLflow's length limit."""
    params: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            params.update(flatten_params(value, f"{name}."))
        elif not is_secret(str(key), value):
            text = value if isinstance(value, str) else json.dumps(value, default=str)
            params[name] = text[:_MAX_PARAM_CHARS]
    return params


def run_tags(model: str | None, dataset: str | None) -> dict[str, str]:
    """Tags every run carries: what was trained on what, from which commit, on which hardware."""
    tags = {"mt_ray.hardware": hardware_summary(), "mt_ray.host_ram_gib": str(host_ram_gib())}
    if model:
        tags["mt_ray.model"] = model
    if dataset:
        tags["mt_ray.dataset"] = dataset
    commit = git_commit()
    if commit:
        tags["mlflow.source.git.commit"] = commit[0]  # shown by the MLflow UI
        tags["mt_ray.git_commit"] = commit[0] + ("+dirty" if commit[1] else "")
    return tags


def hardware_summary() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return f"cpu ({os.cpu_count()} cores, {platform.processor() or platform.machine()})"


def host_ram_gib() -> float:
    return math.floor(psutil.virtual_memory().total / 2**30 * 10) / 10


def git_commit(cwd: str | os.PathLike | None = None) -> tuple[str, bool] | None:
    """HEAD of the git repository around ``cwd`` and whether tracked files changed, else ``None``."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip(), bool(dirty)
