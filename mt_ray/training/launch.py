"""Run a config to the end: the run's callbacks, the trainer, and restarts after a lost cluster.

The entry points (`jobs.train`, `mt-ray train`) and a sweep's trials all run through `run`.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence

from mt_ray.config.run import RunConfig
from mt_ray.training.callbacks import Callback
from mt_ray.training.preflight import check_outputs
from mt_ray.training.run_dir import RunDir
from mt_ray.training.trainer import Trainer
from mt_ray.verbosity import quiet_libraries


class RunInterrupted(Exception):
    """Ctrl-C or SIGTERM ended the run: at which step, and the newest checkpoint a rerun resumes from."""

    def __init__(self, signal_name: str, step: int, steps: int | None, checkpoint: str | None):
        super().__init__(signal_name)
        self.signal_name, self.step, self.steps, self.checkpoint = signal_name, step, steps, checkpoint

    def describe(self, command: str) -> str:
        """One line: what stopped the run, its last checkpoint, and the command that continues it."""
        saved = (f"last checkpoint {self.checkpoint}; resume: {command}" if self.checkpoint else
                 f"no checkpoint yet, so a rerun starts over: {command}")
        where = f"after step {self.step} of {self.steps}" if self.steps is not None else "before its first step"
        return f"interrupted ({self.signal_name}) {where}; {saved}"


def run_from_command_line(cfg: RunConfig, command: str) -> int:
    """`run` for an entry point: the libraries' chatter kept out (`console.quiet_libraries`), SIGTERM ending it as
    Ctrl-C does, and either one line, not a traceback (exit status 128 + the signal's number, as a shell reports it)."""
    quiet_libraries()
    resume = command if cfg.training.resume == "auto" else f"{command} training.resume=auto"
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        run(cfg)
    except RunInterrupted as e:
        print(e.describe(resume), file=sys.stderr, flush=True)
        return 128 + getattr(signal, e.signal_name, signal.SIGINT)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


def _interrupt(signum: int, frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _last_checkpoint(callbacks: list) -> str | None:
    """The newest checkpoint this run saved or resumed from."""
    return next((cb.last_uri for cb in callbacks if hasattr(cb, "last_uri") and cb.last_uri), None)


def build_callbacks(cfg: RunConfig, run: RunDir) -> list:
    """Checkpoints always (in the run's folder); MLflow when tracking is enabled."""
    from mt_ray.tracking import CheckpointManager, MlflowTracker
    from mt_ray.training.track_callbacks import CheckpointCallback, MlflowCallback

    callbacks = [CheckpointCallback(CheckpointManager(run.checkpoint_config))]
    if cfg.tracking.enabled:
        callbacks.append(MlflowCallback(MlflowTracker(run.tracking_config)))
    return callbacks


def run(cfg: RunConfig, extra_callbacks: Sequence[Callback] = ()) -> dict:
    """Train; after losing the cluster's state (coordinator or node), start again from the newest checkpoint.

    `extra_callbacks` join the run's own (a sweep's trial reports its evaluations to Tune through one).
    """
    from mt_ray.cluster import ClusterLostError

    restarts = 0
    while True:
        try:
            return run_once(cfg, extra_callbacks)
        except ClusterLostError as e:
            restarts += 1
            if restarts > cfg.cluster.job_restarts:
                raise
            print(f"warning: {e}; restart {restarts}/{cfg.cluster.job_restarts} from the newest checkpoint of run "
                  f"{RunDir(cfg).uri}", file=sys.stderr)
            cfg = cfg.model_copy(update={"training": cfg.training.model_copy(update={"resume": "auto"})})


def run_once(cfg: RunConfig, extra_callbacks: Sequence[Callback] = ()) -> dict:
    run = RunDir(cfg)
    check_outputs(cfg, run)  # seconds, before the model or the data is touched
    callbacks = build_callbacks(cfg, run) + list(extra_callbacks)
    trainer: Trainer | None = None
    try:
        trainer = Trainer(cfg, callbacks, run)
        summary = trainer.fit()
    except BaseException as e:
        for cb in callbacks:
            if hasattr(cb, "tracker"):
                cb.tracker.close("KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED", error=e)
        built = trainer is not None and trainer.finished is None
        if built and trainer.step == 0 and trainer.resumed_from is None:
            run.release()  # nothing trained, nothing saved: the name is free for the corrected config
        if isinstance(e, KeyboardInterrupt):  # the trainer's config has the steps `training.epochs` came to
            steps = trainer.cfg.training.steps if built else None if cfg.training.epochs else cfg.training.steps
            raise RunInterrupted(str(e) or "SIGINT", trainer.step if built else 0, steps,
                                 _last_checkpoint(callbacks)) from None
        raise
    finally:
        if trainer is not None:
            trainer.close()
    print(done_line(cfg, summary, trainer.history))
    return summary


def _moved(name: str, first: float, last: float, points: int) -> str:
    """`loss 2.914 -> 1.203` over two logged points or more; one point (a run no longer than `training.log_every`)
    is its value alone, not a change."""
    return f"{name} {first:.3f} -> {last:.3f}" if points > 1 else f"{name} {last:.3f}"


def done_line(cfg: RunConfig, summary: dict, history: list[dict[str, float]]) -> str:
    """The run's last line: steps, how its objective moved (GRPO: the reward; its loss is ~0 by construction),
    the held-out loss, and where the model went."""
    rewards = [m["reward"] for m in history if "reward" in m]
    if cfg.training.stage == "grpo" and rewards:
        moved = _moved("reward", rewards[0], rewards[-1], len(rewards))
    elif summary.get("first_loss") is not None:
        # A finished run read back has no history: more than `log_every` steps logged two points or more.
        points = len(history) or 1 + (summary["steps"] > cfg.training.log_every)
        moved = _moved("loss", summary["first_loss"], summary["final_loss"], points)
    else:
        moved = "nothing logged"
    evaluated = f", eval_loss {summary['eval_loss']:.3f}" if "eval_loss" in summary else ""
    workers = f" on {cfg.cluster.num_workers} workers" if cfg.cluster.num_workers > 1 else ""
    return (f"done: {summary['steps']} steps{workers}, {moved}{evaluated}, model exported to "
            f"{summary.get('exported_model', '-')}")
