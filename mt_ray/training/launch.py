"""Run a config to the end: the run's callbacks, the trainer, and restarts after a lost cluster.

The entry points (`jobs.train`, `mt-ray train`) and a sweep's trials all run through `run`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from mt_ray.config.run import RunConfig
from mt_ray.training.callbacks import Callback
from mt_ray.training.run_dir import RunDir
from mt_ray.training.trainer import Trainer


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
    callbacks = build_callbacks(cfg, run) + list(extra_callbacks)
    trainer = Trainer(cfg, callbacks, run)
    try:
        summary = trainer.fit()
    except BaseException as e:
        for cb in callbacks:
            if hasattr(cb, "tracker"):
                cb.tracker.close("KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED", error=e)
        raise
    finally:
        trainer.close()
    print(f"done: {summary['steps']} steps, loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f}, "
          f"model exported to {summary.get('exported_model', '-')}")
    return summary
