"""Ray job / CLI entry point: `python -m jobs.train --config jobs/configs/demo.yaml [key=value ...]`.

With no arguments it trains the built-in tiny model on the demo data (CPU when no GPU).
`cluster.num_workers=N` (N > 1) runs the same loop on N Ray engine workers around a coordinator:
it joins `cluster.address` or RAY_ADDRESS (as under `ray job submit`), else starts Ray in-process.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from mt_ray.config.run import RunConfig, load_run_config
from mt_ray.errors import MtRayError
from mt_ray.training import Callback, Trainer
from mt_ray.training.run_dir import RunDir


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
                cb.tracker.close("KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED")
        raise
    finally:
        trainer.close()
    print(f"done: {summary['steps']} steps, loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f}, "
          f"model exported to {summary.get('exported_model', '-')}")
    return summary


def build_parser() -> argparse.ArgumentParser:
    """The command line; the infra tests parse cluster entrypoints with it too."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--config", default=None, help="YAML run config; default: the embedded demo")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        run(load_run_config(args.config, args.overrides))
    except MtRayError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
