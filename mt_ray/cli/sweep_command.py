"""`mt-ray sweep` and `python -m jobs.sweep`: their options, the sweep they run, and its one-paragraph report."""

from __future__ import annotations

import argparse
import json
from typing import Any

_SWEEP_OPTIONS = ("name", "storage", "samples", "max_concurrent", "grace_steps", "reduction_factor", "search",
                  "gpus_per_trial", "metric")


def add_sweep_arguments(p: argparse.ArgumentParser) -> None:
    """The sweep's options (shared by `mt-ray sweep`); unset ones take `SweepConfig`'s defaults."""
    p.add_argument("--config", default=None, help="YAML run config, as for mt-ray train; default: the embedded demo")
    p.add_argument("--space", required=True, help="YAML space: dotted run-config keys -> samplers, "
                   "e.g. 'optimizer.lr: {loguniform: [1.0e-5, 1.0e-3]}' (loguniform, uniform, choice, grid)")
    p.add_argument("--samples", type=int, help="trials to sample (default 4)")
    p.add_argument("--max-concurrent", type=int, help="trials at once (default: as many as fit)")
    p.add_argument("--grace-steps", type=int, help="steps before ASHA may stop a trial (default: training.eval_every)")
    p.add_argument("--reduction-factor", type=float, help="ASHA keeps the best 1/N of the trials at each rung "
                   "(default 2)")
    p.add_argument("--search", choices=["random", "optuna"], help="search algorithm (default random)")
    p.add_argument("--storage", help="folder or s3://bucket/prefix for the sweep's state and trials "
                   "(default <training.storage>/sweeps)")
    p.add_argument("--name", help="the sweep's name: its folder under --storage and its MLflow run (default sweep)")
    p.add_argument("--gpus-per-trial", type=float, help="GPUs per single-engine trial (default: 1 where the "
                   "cluster has GPUs)")
    p.add_argument("--metric", choices=["eval_loss", "eval_rewards/accuracies"], help="what trials are judged on "
                   "(default eval_loss, lowest best; eval_rewards/accuracies: training.stage dpo, highest best)")
    p.add_argument("--resume", action="store_true", help="continue the interrupted sweep of this --name")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides of the run config")


def sweep(args: argparse.Namespace) -> dict[str, Any]:
    """Load the run config, the space and the options; run the sweep; return its summary."""
    from mt_ray.config.run import load_run_values
    from mt_ray.config.sweep import load_space, load_sweep_config
    from mt_ray.training.sweep import run_sweep

    base = load_run_values(args.config, args.overrides)
    space = load_space(args.space, base)
    settings = load_sweep_config({k: getattr(args, k) for k in _SWEEP_OPTIONS})
    return run_sweep(base, space, settings, resume=args.resume)


def report(summary: dict[str, Any]) -> str:
    return (f"best trial {summary['best_trial']}: {summary['metric']} {summary['best_value']:.4f} at step "
            f"{summary['best_step']} with {json.dumps(summary['best_config'])}\n"
            f"{summary['trials']} trials, {summary['stopped_early']} stopped early by ASHA, {summary['errors']} failed\n"
            f"train it: mt-ray train --config {summary['best_config_path']}")
