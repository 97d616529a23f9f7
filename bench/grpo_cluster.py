"""Benchmark of a GRPO step on the Ray cluster against the single engine, measured in the same run.

A random-initialised model of `--shape` trains as `mt-ray train` would with `training.stage: grpo` (the run
config, backend and step source `GrpoSteps` are the trainer's own), first on one engine in this process, then on
`--workers` engine workers, a rollout replica beside each on its GPU generating its share of the prompt groups
(`DataParallelTrainer`). Both sample the same prompts from the same seed, each prompt group from its own stream,
so the completions agree wherever the GPU's kernels round a share's batch as they round the whole one; the
cluster's rows say what share of its completions equal the engine's (`completions_equal`). `--engine-shares`
makes the engine generate in the cluster's shares, one after another: the same batches, so equal completions
and losses on any GPU, at the cost of the engine's generation time (a check, not a timing).
Each measured step reports:

  rollout tokens/s   new tokens / generate seconds (the cluster's: all replicas at once, as the driver sees it)
  refresh s          the copy's reload: the engine's from its host weights; the replicas' from the node's arena
                     (page-locked DMA, cast on the GPU; the slowest replica's)
  update s, TFLOPS   the engine step (all workers), 6 x params x its tokens / its seconds per GPU
  step s             rollout + update; loss and reward, which match between the two while the completions do
                     (with --num-iterations 2, an iteration-2 row repeats its rollout's columns: it samples nothing)

    python bench/grpo_cluster.py --shape qwen2.5-7b --workers 2 --prompts 16 --generations 8 --new-tokens 128 \
        --warmup 1 --steps 1 --out bench/results/grpo_cluster_x2.json

The summary: the cluster's step over the engine's (target at most 0.6 with 2 GPUs), the largest loss difference,
whether the losses are equal (to 1e-3, relative) and the share of equal completions.

CPU smoke test: `python bench/grpo_cluster.py --shape tiny --device cpu --workers 2 --prompts 2 --generations 4
--new-tokens 8 --micro 4 --steps 1 --out /tmp/grpo_cluster_tiny.json`.
"""

from __future__ import annotations

import argparse
import gc
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
           "update_tflops_per_gpu", "step_s", "loss", "reward", "completions_equal", "host_bytes_per_param"]
TARGET = 0.6  # the cluster's step over one engine's, two GPUs (issue 36)
LOSS_RTOL = 1e-3  # equal losses: the same completions, summed over workers in another order


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


def measure(args, workers: int, shares: int = 1) -> tuple[list[dict], list[list[list[int]]]]:
    """Each measured step's row, and each step's completions (token ids); the engine (workers 0) generating in
    `shares` consecutive batches."""
    cfg, spec, tokenizer, backend = build(args, workers)
    steps = GrpoSteps(cfg, backend, spec, tokenizer)
    if workers == 0:
        steps.sampler.shares = shares
    gpus = max(workers, 1) if args.device != "cpu" else 0
    rows, completions = [], []
    try:
        for i, rollout_s, update_s, result in timed_grpo_steps(steps, backend, args.warmup, args.steps):
            m = steps.metrics
            completions.append(steps.scored.rollout.completion_ids)
            rows.append({
                "system": "cluster" if workers else "engine", "workers": workers, "gpus": gpus,
                "engine_shares": shares if workers == 0 else None,
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
    return rows, completions


def summarize(engine: list[dict], cluster: list[dict], ours: list, theirs: list) -> dict:
    """The cluster against the engine, step by step: step time, losses, completions."""
    for row, a, b in zip(cluster, ours, theirs, strict=True):
        row["completions_equal"] = sum(x == y for x, y in zip(a, b, strict=True)) / len(b)
    ratio = sum(r["step_s"] for r in cluster) / sum(r["step_s"] for r in engine)
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(cluster, engine, strict=True)]
    equal = all(d <= LOSS_RTOL * max(1.0, abs(b["loss"])) for d, b in zip(diffs, engine, strict=True))
    return {"cluster_over_engine_step_s": ratio, "max_loss_diff": max(diffs), "losses_equal": equal,
            "completions_equal": min(r["completions_equal"] for r in cluster),
            "target_step_ratio": TARGET, "meets_target": ratio <= TARGET and equal,
            "engine": {k: sum(r[k] for r in engine) / len(engine) for k in ("step_s", "refresh_s", "generate_s",
                                                                           "update_s")},
            "cluster": {k: sum(r[k] for r in cluster) / len(cluster) for k in ("step_s", "refresh_s", "generate_s",
                                                                             "update_s")}}


def release_cached_memory() -> None:
    """The engine row's GPU memory, which this process's caching allocator keeps reserved once freed, handed back:
    the cluster's worker and replica on the same GPU plan with the whole of it (as bench/multi_gpu.py does)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


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
    p.add_argument("--engine-shares", action="store_true",
                   help="the engine generates in the cluster's shares (equal batches: a check, not a timing)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--out", default="bench/results/grpo_cluster.json")
    args = p.parse_args()
    workers = args.workers or max(1, torch.cuda.device_count())
    # the engine first: its state is freed before the cluster's
    engine, theirs = measure(args, 0, workers if args.engine_shares else 1)
    write_json(args.out, {"args": vars(args), "summary": None, "rows": engine})  # kept if the cluster's run is cut
    release_cached_memory()
    cluster, ours = measure(args, workers)
    summary = {"device": device_name(), **summarize(engine, cluster, ours, theirs)}
    print_table(engine + cluster, COLUMNS)
    print(summary)
    write_json(args.out, {"args": vars(args), "summary": summary, "rows": engine + cluster})


if __name__ == "__main__":
    main()
