"""Benchmark of a GRPO step on the Ray cluster against the single engine, measured in the same run.

A random-initialised model of `--shape` trains as `mt-ray train` would with `training.stage: grpo` (the run
config, backend and step source `GrpoSteps` are the trainer's own), first on one engine in this process, then on
`--workers` engine workers with the rollout actor beside them (`DataParallelTrainer`; on one GPU: one worker and
the rollout actor sharing the GPU, half of it reserved each). Both sample the same prompts from the same seed.
Each measured step reports:

  rollout tokens/s   new tokens / generate seconds (the cluster's: the rollout actor's, as the driver sees it)
  refresh s          the copy's reload: the engine's from its host weights; the actor's from the node's arena
  update s, TFLOPS   the engine step (all workers), 6 x params x its tokens / its seconds per GPU
  step s             rollout + update; loss and reward, which match between the two while the completions do
                     (with --num-iterations 2, an iteration-2 row repeats its rollout's columns: it samples nothing)

    python bench/grpo_cluster.py --shape qwen2.5-1.5b --prompts 16 --generations 8 --new-tokens 128

CPU smoke test: `python bench/grpo_cluster.py --shape tiny --device cpu --workers 2 --prompts 2 --generations 4
--new-tokens 8 --micro 4 --steps 1 --out /tmp/grpo_cluster_tiny.json`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import device_name, print_table, timed_grpo_steps, write_json  # noqa: E402
from mt_ray.config.run import load_run_config  # noqa: E402
from mt_ray.training.backend import build_backend  # noqa: E402
from mt_ray.training.grpo.steps import GrpoSteps  # noqa: E402
from mt_ray.training.model_source import load_model_and_tokenizer  # noqa: E402

COLUMNS = ["system", "workers", "iteration", "rollout_tokens_per_s", "refresh_s", "generate_s", "update_s",
           "update_tflops_per_gpu", "step_s", "loss", "reward", "host_bytes_per_param"]


def run_config(args, workers: int):
    completions = args.prompts * args.generations
    if completions % args.micro or (completions // args.micro) < workers:
        raise SystemExit(f"--micro {args.micro} must divide prompts x generations ({completions}) into at least "
                         f"--workers ({workers}) micro-batches")
    return load_run_config(None, [
        f"model.preset={args.shape}", "data.datasets=[demo_math_prompts]", "training.stage=grpo",
        f"training.micro_batch_size={args.micro}", f"training.grad_accum_steps={completions // args.micro}",
        f"training.steps={args.steps + args.warmup}", f"grpo.num_generations={args.generations}",
        f"grpo.max_completion_length={args.new_tokens}", "grpo.max_prompt_length=64",
        "grpo.rewards=[{name: format}, {name: 'jobs.rewards:digits'}]", f"engine.device={args.device}",
        f"engine.checkpoint_every={args.k}", f"engine.grad_dtype={args.grad_dtype}",
        f"grpo.num_iterations={args.num_iterations}", f"cluster.num_workers={workers}",
    ])


def build(args, workers: int):
    """The run's spec, tokenizer and backend: one engine (workers 0), else the cluster with `workers` workers
    (one included: build_backend would give a single engine)."""
    cfg = run_config(args, max(workers, 1))
    spec, tokenizer = load_model_and_tokenizer(cfg)
    if workers == 0:
        return cfg, spec, tokenizer, build_backend(cfg, spec)
    from mt_ray.cluster import DataParallelTrainer

    backend = DataParallelTrainer(spec, cfg.engine, cfg.optimizer, workers, cfg.training.steps, cluster=cfg.cluster,
                                  weights=cfg.training.seed, stage="grpo", pref=cfg.pref, grpo=cfg.grpo)
    return cfg, spec, tokenizer, backend


def measure(args, workers: int) -> list[dict]:
    cfg, spec, tokenizer, backend = build(args, workers)
    steps = GrpoSteps(cfg, backend, spec, tokenizer)
    gpus = max(workers, 1) if args.device != "cpu" else 0
    rows = []
    try:
        for i, rollout_s, update_s, result in timed_grpo_steps(steps, backend, args.warmup, args.steps):
            m = steps.metrics
            rows.append({
                "system": "cluster" if workers else "engine", "workers": workers, "gpus": gpus,
                "iteration": i % args.num_iterations + 1, "rollout_tokens_per_s": m["rollout/tokens_per_s"],
                "refresh_s": m["rollout/refresh_s"], "generate_s": m["rollout/generate_s"], "update_s": update_s,
                "update_tokens": result.num_tokens,
                "update_tflops_per_gpu": 6 * spec.text_params * result.num_tokens / update_s / 1e12 / max(gpus, 1),
                "step_s": rollout_s + update_s, "loss": float(result.loss), "reward": m["reward"],
                **backend.memory_metrics(),
            })
    finally:
        steps.close()
        backend.close()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen2.5-1.5b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--workers", type=int, default=None, help="cluster workers (default: one per visible GPU)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--micro", type=int, default=16, help="completions per micro-batch")
    p.add_argument("--k", type=int, default=4, help="checkpoint every K layers")
    p.add_argument("--grad-dtype", default="compute", choices=["fp32", "compute"])
    p.add_argument("--num-iterations", type=int, default=1, help="grpo.num_iterations: updates per rollout")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--out", default="bench/results/grpo_cluster.json")
    args = p.parse_args()
    workers = args.workers or max(1, torch.cuda.device_count())
    rows = measure(args, 0) + measure(args, workers)  # the engine first: its state is freed before the cluster's
    engine, cluster = ([r for r in rows if r["system"] == s] for s in ("engine", "cluster"))
    summary = {"device": device_name(), "cluster_over_engine_step_s": sum(r["step_s"] for r in cluster)
               / sum(r["step_s"] for r in engine),
               "max_loss_diff": max(abs(a["loss"] - b["loss"]) for a, b in zip(engine, cluster, strict=True))}
    print_table(rows, COLUMNS)
    print(summary)
    write_json(args.out, {"args": vars(args), "summary": summary, "rows": rows})


if __name__ == "__main__":
    main()
