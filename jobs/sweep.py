"""Ray Tune sweep over learning rate, warmup and batch size: short engine runs, ASHA early stopping.

Each trial is one streaming-engine run (one device, its own host store) that reports its loss
to Tune after every step; ASHA stops the trials that fall behind. The default model is a tiny
random Llama and the default data a synthetic copy task (the second half of each row repeats
the first), so the sweep runs anywhere in seconds; pass `model` and `make_batch` for real runs.
With tracking on, the sweep is one MLflow run and each trial a child run of it (params and
per-step loss), logged from this process; the best trial is recorded on the parent.

    python -m jobs.sweep --samples 4 --steps 8 [--tracking-uri sqlite:///mlflow.db | --no-tracking]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Callable

import torch

from mt_ray.tracking import MlflowTracker, TrackingConfig

Batch = list[dict[str, torch.Tensor]]

TINY_LLAMA = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64,
                  max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def copy_task_batch(step: int, batch_size: int, seq: int = 16, vocab: int = 64) -> Batch:
    """One micro-batch of `batch_size` rows whose second half repeats the first (loss on that half)."""
    g = torch.Generator().manual_seed(step)
    half = torch.randint(3, vocab, (batch_size, seq // 2), generator=g)
    ids = torch.cat([half, half], dim=1)
    labels = ids.clone()
    labels[:, : seq // 2] = -100
    return [{"input_ids": ids, "labels": labels}]


def default_space() -> dict:
    from ray import tune

    return {"lr": tune.loguniform(1e-3, 5e-2), "warmup": tune.choice([0, 2]), "batch": tune.choice([4, 8])}


def train_trial(config: dict, fixed: dict) -> None:
    """One Tune trial: a short engine run that reports `loss` after every step.

    `config` holds the sampled hyper-parameters, `fixed` what every trial shares (model, data).
    """
    from ray import tune

    from mt_ray.engine import EngineConfig, OptimizerConfig, StreamingEngine
    from mt_ray.models.discovery import discover

    steps = fixed["steps"]
    opt = OptimizerConfig(lr=config["lr"], warmup_steps=config["warmup"], max_grad_norm=1.0, schedule="cosine")
    engine = StreamingEngine(discover(fixed["model"]), EngineConfig(**fixed["engine"]), opt, total_steps=steps)
    make_batch = fixed["make_batch"]
    try:
        engine.load_random(seed=fixed["seed"])
        for step in range(steps):
            result = engine.train_step(make_batch(step, config["batch"]))
            tune.report({"loss": float(result.loss), "step": step + 1})  # float(): one sync per step, off the hot loop
    finally:
        engine.close()


def run_sweep(num_samples: int = 4, steps: int = 8, model: dict | str | None = None,
              make_batch: Callable[[int, int], Batch] = copy_task_batch, space: dict | None = None,
              engine: dict | None = None, cpus_per_trial: float = 1, gpus_per_trial: float = 0,
              storage_path: str | None = None, seed: int = 0, tracking: TrackingConfig | None = None) -> dict:
    """Run the sweep and return {"config": best hyper-parameters, "loss": its last loss, "trials": n, ...}.

    Ray is started in-process unless it is already running or RAY_ADDRESS is set. `tracking`
    (off when None) makes the sweep an MLflow run with one child run per trial; the result then
    carries "run_id" (the sweep's) and "best_run_id" (the best trial's).
    """
    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search.basic_variant import BasicVariantGenerator

    from mt_ray.tracking.tune_runs import TrialRunsCallback

    if not ray.is_initialized():
        ray.init(address="auto" if _has_address() else None)
    fixed = {"steps": steps, "model": model or TINY_LLAMA, "make_batch": make_batch, "seed": seed,
             "engine": engine or {"device": "auto", "compute_dtype": "fp32"}}
    space = space or default_space()
    parent = MlflowTracker(tracking or TrackingConfig(enabled=False))
    trial_runs = TrialRunsCallback(parent)
    # with_parameters: the shared values travel once through the object store, not in each config.
    trainable = tune.with_resources(tune.with_parameters(train_trial, fixed=fixed), {"cpu": cpus_per_trial, "gpu": gpus_per_trial})
    # ASHA: every trial runs `grace_period` steps, then only the best 1/reduction_factor go on at each rung.
    scheduler = ASHAScheduler(time_attr="step", max_t=steps, grace_period=max(1, steps // 4), reduction_factor=2)
    tuner = tune.Tuner(
        trainable,
        param_space=space,
        # reuse_actors: a trial starts in a process that has already imported torch and the engine
        # (and, on a GPU, made its CUDA context): half the wall time of a short sweep.
        tune_config=tune.TuneConfig(metric="loss", mode="min", scheduler=scheduler, num_samples=num_samples,
                                    search_alg=BasicVariantGenerator(random_state=seed), reuse_actors=True),
        run_config=tune.RunConfig(name="mt-ray-sweep", storage_path=storage_path or tempfile.mkdtemp(prefix="mt-ray-tune-"),
                                  verbose=0, callbacks=[trial_runs]),
    )
    parent.start({"sweep": {"num_samples": num_samples, "steps": steps, "seed": seed,
                            "space": {k: str(v) for k, v in space.items()}},
                  "model": fixed["model"], "engine": fixed["engine"]})
    try:
        results = tuner.fit()
        best = results.get_best_result(metric="loss", mode="min", scope="last")
        last = [r.metrics["loss"] for r in results if r.metrics and "loss" in r.metrics]
        summary = {"config": best.config, "loss": best.metrics["loss"], "trials": len(results),
                   "errors": len(results.errors), "last_losses": last, "run_id": parent.run_id,
                   "best_run_id": trial_runs.run_ids.get(best.metrics["trial_id"])}
        parent.log_summary({"best_loss": summary["loss"], "best_config": best.config,
                            "best_trial": best.metrics["trial_id"], "best_run_id": summary["best_run_id"]})
    except BaseException:
        parent.close("FAILED")
        raise
    parent.close("FINISHED")
    return summary


def _has_address() -> bool:
    import os

    return bool(os.environ.get("RAY_ADDRESS"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=4, help="trials to sample")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per trial")
    parser.add_argument("--gpus-per-trial", type=float, default=0)
    parser.add_argument("--tracking-uri", default=None, help="MLflow store; default: MLFLOW_TRACKING_URI, else "
                        "sqlite:///mlflow.db here")
    parser.add_argument("--no-tracking", action="store_true", help="report to Tune only")
    args = parser.parse_args(argv)
    tracking = TrackingConfig(enabled=not args.no_tracking, tracking_uri=args.tracking_uri, experiment="mt-ray-sweep")
    best = run_sweep(args.samples, args.steps, gpus_per_trial=args.gpus_per_trial, tracking=tracking)
    print(json.dumps(best))


if __name__ == "__main__":
    main()
