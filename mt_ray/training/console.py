"""What a run prints: a start banner and progress (a bar on a terminal, one line per `log_every` steps otherwise);
the libraries' INFO chatter is kept out (`mt_ray.verbosity`)."""

from __future__ import annotations

import os
import sys

from mt_ray.config.run import RunConfig
from mt_ray.models.discovery import ModelSpec
from mt_ray.tracking import TrackingConfig
from mt_ray.training.run_dir import RunDir


def interactive() -> bool:
    """Whether progress goes to a terminal (a bar redrawn in place) rather than a file or pipe (lines)."""
    return sys.stderr.isatty()


def progress_line(step: int, steps: int, values: dict[str, str]) -> str:
    """`step 10/60: loss 2.345, tok_s 1034`: what the bar shows, as one line."""
    return f"step {step}/{steps}: " + ", ".join(f"{k} {v}" for k, v in values.items())


def banner(cfg: RunConfig, spec: ModelSpec, run: RunDir, step: int) -> str:
    """Three lines as the first step starts (`step`: where it starts): what trains on what, how, and where its
    outputs go."""
    t, d, e = cfg.training, cfg.data, cfg.engine
    model = cfg.model.path or cfg.model.preset
    params = spec.num_params
    size = f"{params / 1e9:.2f} B" if params >= 1e9 else f"{params / 1e6:.1f} M"
    # Workers resolve their own device; the driver may have none of theirs.
    device = e.device if cfg.cluster.num_workers > 1 else f"{e.resolve_device()}, {str(e.dtype).removeprefix('torch.')}"
    workers = (f", {cfg.cluster.num_workers} Ray engine workers on {cfg.cluster.num_nodes} node(s)"
               if cfg.cluster.num_workers > 1 else "")
    rows = f"packed rows of {d.max_seq_len} tokens" if d.packing else f"one example a row, at most {d.max_seq_len} tokens"
    start = f" from step {step}" if step else ""
    return (f"run {run.name}: {t.stage} of {model} ({type(spec.skeleton).__name__}, {size} parameters) on "
            f"{device}{workers}\n"
            f"  data {', '.join(d.datasets)} (template {d.template}, {rows}); {t.steps} steps of "
            f"{t.micro_batch_size} x {t.grad_accum_steps} rows{start}\n"
            f"  outputs {run.uri} (checkpoints every {cfg.checkpoint.every_steps} steps); tracking "
            f"{_tracking(run.tracking_config)}")


def _tracking(tracking: TrackingConfig) -> str:
    if not tracking.enabled:
        return "off"
    uri = tracking.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "MLflow's default store")
    return f"{uri} (experiment {tracking.experiment})"
