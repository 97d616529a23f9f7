"""Ray Tune sweeps of ordinary runs, judged on held-out eval loss (or a DPO run's eval reward accuracy) and cut
short by ASHA.

Each trial is `mt_ray.training.launch`'s run of the base config with the trial's sampled keys set: the same
data pipeline, checkpoints and MLflow logging as `mt-ray train`, as an MLflow child run of the
sweep's run. It reports to Tune at every evaluation (`training.eval_every`); ASHA compares trials
there and stops the worse ones, which then end like any run (summary, checkpoint, MLflow run) before Tune
ends their process (`trial_trainable`). A trial that errors, or whose run fails while it ends, counts among
the sweep's errors, named (`trial_errors`), and its MLflow run is FAILED with the error as its tag.

State is durable: Tune's experiment and every trial's checkpoints live under the sweep's storage
(`SweepStorage`), so `resume=True` keeps the finished trials and restarts the running ones, each
from its newest checkpoint. The best trial's run config is written as `best_config.yaml`.
"""

from __future__ import annotations

import contextlib
import copy
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from mt_ray.config.run import RunConfig, TrainingConfig, set_key, validate_run_config
from mt_ray.config.sweep import Dimension, SweepConfig
from mt_ray.errors import ConfigError, MtRayError
from mt_ray.tracking import MlflowTracker, TrackingConfig
from mt_ray.tracking.mlflow_tracker import error_line
from mt_ray.tracking.tune_runs import TrialRunsCallback, best_trial_run, failed_trials, open_sweep_run
from mt_ray.training.callbacks import Callback
from mt_ray.training.console import interactive
from mt_ray.training.run_dir import resolve_storage, run_tracking_config
from mt_ray.training.sweep_storage import BEST_CONFIG, SweepStorage
from mt_ray.verbosity import library_log_level

# Paths in a run config that a trial, running in a folder of its own, must see as the driver sees them.
_PATH_KEYS = ("model.path", "model.tokenizer", "data.registry")
# Set in a trial's process once the scheduler stopped it and its run is ending (`TuneReportCallback`), and once
# `run_trial`'s run has ended (its thread then still hands Tune its end, which a stopping trial never takes).
_ENDING = threading.Event()
_ENDED = threading.Event()
_WAKE_S = 5.0  # how long a stopped trial's thread may take to wake from its report and start ending its run
_END_S = 300.0  # how long Tune's stop waits for a stopped trial's run to end (summary, checkpoint, MLflow)


class SweepInterruptedError(MtRayError):
    """Tune returned before every trial ended (it was interrupted); the sweep's state is saved for --resume."""


class TuneReportCallback(Callback):
    """Reports each evaluation but the last to Tune; when the scheduler stops the trial, the run ends there.

    Tune ends a trial's process soon after stopping it (ASHA also stops every trial at its last
    step), so the final evaluation is reported by `run_trial` only once the run is complete.
    """

    def on_evaluate(self, trainer, step: int, metrics: dict[str, float]) -> None:
        if step >= trainer.cfg.training.steps:
            return
        loss = trainer.history[-1]["loss"] if trainer.history else float("nan")
        try:
            report({**metrics, "step": step, "loss": loss})
        except SystemExit:  # how Tune stops a function trial: its report raises once the scheduler decided
            _ENDING.set()
            trainer.request_stop("stopped early by the ASHA scheduler")


def report(metrics: dict[str, Any]) -> None:
    from ray import tune

    tune.report(metrics)


@dataclass(frozen=True)
class TrialPlan:
    """What every trial shares: the base run-config values, where trials write, the sweep's MLflow run."""

    base: dict[str, Any]
    storage: SweepStorage
    parent_run_id: str | None
    sweep_name: str
    callbacks: tuple[Callback, ...] = ()
    """Callbacks every trial's run adds to its own (picklable: they travel to the trials' processes)."""

    def trial_config(self, sampled: dict[str, Any], trial_id: str) -> RunConfig:
        """The base config with the sampled keys set: a run of its own under `<sweep>/trials/`, a child MLflow run."""
        sampled = plain(sampled)
        values = apply_sampled(self.base, sampled)
        tags = {"mt_ray.sweep": self.sweep_name, "mt_ray.sweep.trial_id": trial_id,
                "mt_ray.sweep.sampled": yaml.safe_dump(sampled, default_flow_style=True).strip()}
        for key, value in {"training.storage": self.storage.trials_uri, "training.run_name": trial_run_name(
                           self.sweep_name, trial_id), "training.resume": "auto",
                           "tracking.parent_run_id": self.parent_run_id, "tracking.tags": tags}.items():
            set_key(values, key, value)
        return validate_run_config(values)


def trial_run_name(sweep_name: str, trial_id: str) -> str:
    """A trial's run name (its folder under `<sweep>/trials/` and its MLflow run name)."""
    return f"{sweep_name}-{trial_id}"


def run_trial(sampled: dict[str, Any], plan: TrialPlan) -> None:
    """One Tune trial: an ordinary run of the trial's config, reporting its evaluations to Tune.

    The final evaluation is reported from the run's summary, once checkpoint, export and MLflow
    run are complete; also for a run that had finished before (a sweep killed before Tune
    recorded it), which trains nothing again.
    """
    from ray import tune

    from mt_ray.training.launch import run

    try:
        summary = run(plan.trial_config(sampled, tune.get_context().get_trial_id()),
                      extra_callbacks=[*plan.callbacks, TuneReportCallback()])
    finally:
        _ENDED.set()
    if "stopped_early" not in summary:  # every eval metric the run has (a preference stage's rewards among them)
        report({k: v for k, v in summary.items() if k.startswith("eval_")}
               | {"step": summary["steps"], "loss": summary["final_loss"]})


def trial_trainable(plan: TrialPlan):
    """`run_trial` as Tune's function trainable, whose stop waits for a trial the scheduler stopped to end its run.

    Tune stops a function trial by waking its thread from `tune.report` with SystemExit and returns at once; the
    process then ends, and the thread with it, maybe halfway through the run's summary, checkpoint or MLflow run
    (which then stayed open, or failed). Here the stop first lets that thread end the run (`end_stopped_run`).
    """
    from ray import tune
    from ray.tune.trainable.function_trainable import wrap_function

    class Trial(wrap_function(tune.with_parameters(run_trial, plan=plan))):
        def cleanup(self) -> None:
            end_stopped_run()
            super().cleanup()

    Trial.__name__ = "run_trial"  # the trials' folder names, as Tune names them after the function
    return Trial


def end_stopped_run() -> None:
    """In a trial's process, as Tune stops it: wake its thread from its report and, where the scheduler stopped it
    (`_ENDING`, set by `TuneReportCallback`), wait up to `_END_S` until its run has ended; a trial stopped while
    training (the sweep interrupted) is not waited for."""
    from ray.train._internal.session import get_session

    session = get_session()
    if session is None or not session.training_started:
        return
    session.finish(timeout=0)  # a thread waiting in its report raises SystemExit there
    thread = session.training_thread
    waited = 0.0
    while thread.is_alive() and not _ENDING.is_set() and waited < _WAKE_S:
        thread.join(timeout=0.05)
        waited += 0.05
    if _ENDING.is_set():  # the run's end, not the thread's: past it the thread waits on Tune, which is stopping
        _ENDED.wait(timeout=_END_S)


def plain(sampled: dict[str, Any]) -> dict[str, Any]:
    """Tune's sampled values with numpy scalars as plain Python numbers (for pydantic, YAML and JSON)."""
    return {key: value.item() if hasattr(value, "item") else value for key, value in sampled.items()}


def apply_sampled(base: dict[str, Any], sampled: dict[str, Any]) -> dict[str, Any]:
    """A copy of `base` with each sampled dotted key set."""
    values = copy.deepcopy(base)
    for key, value in plain(sampled).items():
        set_key(values, key, value)
    return values


def run_sweep(base: dict[str, Any], space: list[Dimension], sweep: SweepConfig, resume: bool = False,
              trial_callbacks: Sequence[Callback] = ()) -> dict[str, Any]:
    """Run (or with `resume`, continue) the sweep; returns the best trial, its config file and counts.

    `base` is a run config's raw values (as `load_run_values` reads them), `space` the checked
    dimensions (`load_space`). The sweep lives in `sweep.storage`, by default `<training.storage>/sweeps`;
    its MLflow run and the trials' runs go to the run config's MLflow store (by default the one in
    `training.storage`). Ray is joined at `cluster.address` or RAY_ADDRESS, else started here.
    `trial_callbacks` join every trial's run callbacks (picklable).
    """
    base = absolute_paths(base)
    cfg = validate_run_config(base)
    sweep = sweep.checked(cfg)
    tracking = run_tracking_config(cfg.tracking, sweep.name, cfg.training.storage)  # refused before anything is written
    storage = SweepStorage(sweep.storage or f"{cfg.training.storage}/sweeps", sweep.name, cfg.checkpoint)
    base = pin_tracking(base, tracking)
    record = check_resume(storage, resume, base, space)
    tracker = MlflowTracker(tracking)
    with _ray(cfg):
        open_sweep_run(tracker, record, sweep_params(cfg, space, sweep), storage.uri)
        try:
            storage.write_record({"base": base, "space": [d.describe() for d in space],
                                  "keys": [d.key for d in space], "run_id": tracker.run_id})
            plan = TrialPlan(base, storage, tracker.run_id, sweep.name, tuple(trial_callbacks))
            results = _tuner(plan, cfg, space, sweep, tracking, resume).fit()
            summary = summarize(results, base, cfg.training.steps, storage, tracker, sweep)
        except BaseException as e:
            tracker.close("KILLED" if isinstance(e, KeyboardInterrupt | SweepInterruptedError) else "FAILED")
            raise
    tracker.close("FINISHED")
    return summary


def absolute_paths(base: dict[str, Any]) -> dict[str, Any]:
    """`base` with local paths absolute (a trial runs in a folder of its own), `training.storage` resolved."""
    values = copy.deepcopy(base)
    for key in _PATH_KEYS:
        section, name = key.split(".")
        path = values.get(section, {}).get(name)
        if path and Path(path).exists():
            set_key(values, key, str(Path(path).resolve()))
    storage = values.get("training", {}).get("storage", TrainingConfig.model_fields["storage"].default)
    set_key(values, "training.storage", resolve_storage(storage))
    return values


def pin_tracking(base: dict[str, Any], tracking: TrackingConfig) -> dict[str, Any]:
    """`base` logging to the sweep's MLflow store, whatever storage root and working folder each trial gets.

    `tracking` comes from `run_tracking_config`: its local store and artifact paths are already absolute.
    """
    values = copy.deepcopy(base)
    if tracking.enabled:
        for key in ("tracking_uri", "artifact_location"):
            if getattr(tracking, key) is not None:
                set_key(values, f"tracking.{key}", getattr(tracking, key))
    return values


def check_resume(storage: SweepStorage, resume: bool, base: dict[str, Any], space: list[Dimension]) -> dict | None:
    """The record of the sweep to resume (same base config and space), or None for a new sweep; else ConfigError."""
    record = storage.read_record()
    if record is None and resume:
        raise ConfigError(f"there is no sweep to resume at {storage.uri}; run without --resume to start it")
    if record is not None and not resume:
        raise ConfigError(f"a sweep named '{storage.name}' already exists at {storage.uri}; pass --resume to continue "
                          "it, or --name to start another")
    if record is not None and (record["base"] != base or record["space"] != [d.describe() for d in space]):
        raise ConfigError(f"the sweep at {storage.uri} was started with another run config or space; resume it with "
                          "the same --config, overrides and --space, or start a new one with --name")
    return record


def sweep_params(cfg: RunConfig, space: list[Dimension], sweep: SweepConfig) -> dict[str, Any]:
    """The sweep's run params: its settings, the space readably (`space.optimizer.lr: loguniform(...)`), the base config."""
    config = cfg.model_dump(mode="json")
    for dim in space:  # the base value of a swept key is not what any trial trained with
        section, _, rest = dim.key.partition(".")
        _drop(config[section], rest)
    return {"sweep": sweep.model_dump(mode="json"), "space": {d.key: d.describe() for d in space}, **config}


def summarize(results, base: dict[str, Any], steps: int, storage: SweepStorage, tracker: MlflowTracker,
              sweep: SweepConfig) -> dict:
    """The best trial by its last `sweep.metric`, its config written as `best_config.yaml`, and the counts; logged on
    the sweep run."""
    unfinished = len(results) - results.num_terminated - results.num_errors
    if unfinished:
        raise SweepInterruptedError(f"the sweep stopped with {unfinished} trials unfinished; continue it with --resume "
                                    f"(--storage {storage.root} --name {storage.name})")
    errors = trial_errors(results, tracker)
    finished = [r for r in results if r.metrics and sweep.metric in r.metrics and _trial_id(r) not in errors]
    if not finished:
        raise ConfigError(f"no trial reported {sweep.metric}; see the trial errors above")
    best = results.get_best_result(metric=sweep.metric, mode=sweep.mode, scope="last")
    best_values = apply_sampled(base, best.config)
    path = storage.write(BEST_CONFIG, yaml.safe_dump(best_values, sort_keys=False))
    trial_id = best.metrics["trial_id"]
    summary = {
        "best_trial": trial_id, "metric": sweep.metric, "best_value": best.metrics[sweep.metric],
        "best_eval_loss": best.metrics["eval_loss"], "best_step": best.metrics["step"],
        "best_config": plain(best.config), "best_config_path": path,
        "trials": len(results), "errors": len(errors), "trial_errors": errors,
        "stopped_early": sum(r.metrics["step"] < steps for r in finished), "run_id": tracker.run_id,
    }
    summary.update(best_trial_run(tracker, trial_id, best_values))
    tracker.log_summary(summary)
    return summary


def trial_errors(results, tracker: MlflowTracker) -> dict[str, str]:
    """Each trial that errored in Tune, or whose MLflow run ended FAILED (it failed while ending its run), by its
    id, with its error."""
    errors = {_trial_id(r): error_line(r.error) for r in results if r.error is not None}
    return errors | failed_trials(tracker)


def _trial_id(result) -> str:
    """A Tune result's trial id (its metrics carry it once it reported; else its folder's name says it)."""
    return str(result.metrics.get("trial_id") or Path(result.path).name)


def _tuner(plan: TrialPlan, cfg: RunConfig, space: list[Dimension], sweep: SweepConfig, tracking: TrackingConfig,
           resume: bool):
    """A new Tuner for the sweep, or the stored one restored (finished trials kept, unfinished ones restarted)."""
    import ray
    from ray import tune

    storage = plan.storage
    resources = trial_resources(cfg, sweep, ray.cluster_resources().get("GPU", 0) >= 1)
    trainable = tune.with_resources(trial_trainable(plan), resources)
    if resume:
        return tune.Tuner.restore(f"{storage.tune_storage_path}/{storage.name}", trainable, resume_unfinished=True,
                                  storage_filesystem=storage.filesystem)
    from ray.tune.schedulers import ASHAScheduler

    # ASHA: every trial runs grace_steps, then only the best 1/reduction_factor go on at each rung.
    scheduler = ASHAScheduler(time_attr="step", max_t=cfg.training.steps, grace_period=sweep.grace_steps,
                              reduction_factor=sweep.reduction_factor)
    return tune.Tuner(
        trainable,
        param_space={d.key: d.to_tune() for d in space},
        # No reuse_actors: a stopped trial still finishes its run (summary, MLflow) in its thread, and
        # Tune fails the next trial when the reused process has not ended that thread within 2 s.
        tune_config=tune.TuneConfig(metric=sweep.metric, mode=sweep.mode, scheduler=scheduler, num_samples=sweep.samples,
                                    search_alg=build_search(sweep, space, cfg.training.seed), reuse_actors=False),
        run_config=tune.RunConfig(name=sweep.name, storage_path=storage.tune_storage_path,
                                  storage_filesystem=storage.filesystem, verbose=tune_verbosity(),
                                  callbacks=[TrialRunsCallback(tracking, plan.parent_run_id, cfg.training.steps)]),
    )


def tune_verbosity() -> int:
    """Tune's own progress (its box tables of trials and results) on a terminal, none of it in a file or a pipe
    (a Ray job's log, `> sweep.log`): there each trial's run prints its own lines, and the sweep its report at
    the end. Tune's `AirVerbosity`: 0 silent, 1 default."""
    return 1 if interactive() else 0


def build_search(sweep: SweepConfig, space: list[Dimension], seed: int):
    """The search algorithm, holding at most `max_concurrent` trials running."""
    if sweep.search == "random":
        from ray.tune.search.basic_variant import BasicVariantGenerator

        return BasicVariantGenerator(random_state=seed, max_concurrent=sweep.max_concurrent or 0)
    if any(d.sampler == "grid" for d in space):
        raise ConfigError("--search optuna cannot run a grid sampler; use choice instead, or --search random")
    try:
        from ray.tune.search import ConcurrencyLimiter
        from ray.tune.search.optuna import OptunaSearch

        searcher = OptunaSearch(seed=seed)
    except (ImportError, AssertionError):  # Tune asserts Optuna is importable when the searcher is built
        raise ConfigError("--search optuna needs Optuna: pip install 'mt-ray[sweep]' (or optuna), or use --search "
                          "random") from None
    return ConcurrencyLimiter(searcher, sweep.max_concurrent) if sweep.max_concurrent else searcher


def trial_resources(cfg: RunConfig, sweep: SweepConfig, cluster_has_gpus: bool):
    """What Tune reserves per trial: the trial's process, plus for data-parallel trials one bundle per worker.

    A data-parallel trial's coordinator and workers are Ray actors started from inside the trial;
    Tune places them in the trial's placement group, so a trial starts only when all of it fits.
    """
    from ray import tune

    gpus = sweep.gpus_per_trial
    has_gpus = cluster_has_gpus and cfg.engine.device != "cpu"
    if cfg.cluster.num_workers == 1:
        return {"cpu": sweep.cpus_per_trial, "gpu": (1 if has_gpus else 0) if gpus is None else gpus}
    if cfg.cluster.num_nodes > 1:
        raise ConfigError("a sweep keeps each trial's workers on one node: set cluster.num_nodes=1 (trials spread "
                          "over the cluster instead)")
    worker_gpus = cfg.cluster.gpus_per_worker if cfg.cluster.gpus_per_worker is not None else int(has_gpus)
    bundles = [{"CPU": sweep.cpus_per_trial}, {"CPU": cfg.cluster.coordinator_cpus},
               *[{"CPU": cfg.cluster.cpus_per_worker, "GPU": worker_gpus}] * cfg.cluster.num_workers]
    return tune.PlacementGroupFactory([b for b in ({k: v for k, v in b.items() if v} for b in bundles) if b])


@contextlib.contextmanager
def _ray(cfg: RunConfig) -> Iterator[None]:
    """Ray for the sweep (joined, or started here and stopped after), with Tune's settings (`tune_settings`)."""
    import ray

    started = not ray.is_initialized()
    if started:
        address = cfg.cluster.address or ("auto" if os.environ.get("RAY_ADDRESS") else None)
        ray.init(address=address, num_cpus=cfg.cluster.num_cpus if address is None else None,
                 logging_level=library_log_level())  # Ray's start-up INFO lines only with MT_RAY_VERBOSE
    unset = {k: v for k, v in tune_settings().items() if k not in os.environ}
    os.environ.update(unset)
    try:
        yield
    finally:
        for key in unset:
            os.environ.pop(key, None)
        if started:
            ray.shutdown()


def tune_settings() -> dict[str, str]:
    """Tune's environment for the sweep, where the user has not set it. Tune saves its state at most every 10 s by
    default: a sweep killed just after a trial ended would redo it, so every second. In a file or a pipe, Tune's
    legacy output engine (`RAY_AIR_NEW_OUTPUT=0`), which `tune_verbosity`'s 0 silences: the new one prints its
    box table of the experiment whatever the verbosity."""
    settings = {"TUNE_GLOBAL_CHECKPOINT_S": "1"}
    if not interactive():
        settings["RAY_AIR_NEW_OUTPUT"] = "0"
    return settings


def _drop(node: dict[str, Any], dotted: str) -> None:
    head, _, rest = dotted.partition(".")
    if rest and isinstance(node.get(head), dict):
        _drop(node[head], rest)
    else:
        node.pop(head, None)
