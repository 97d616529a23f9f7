"""Benchmark of a GRPO step on one GPU: rollout tokens/s, the rollout copy's refresh, and the update.

A random-initialised model of `--shape` trains as `mt-ray train` would with `training.stage: grpo`:
the run config, engine and step source (`GrpoSteps`: refresh the device copy from the host master,
sample `--generations` completions of each of `--prompts` arithmetic prompts with transformers'
`generate`, score them) are the trainer's own. Each measured step reports:

  rollout tokens/s   new tokens / generate seconds
  refresh s          the copy's reload from the host weights, landed
  update TFLOPS      6 x params x the update's tokens / the engine step's seconds (MegaTrain's formula)
  step s             rollout + update; peak GPU memory (the engine, the copy and its key/value cache) and
                     host bytes/param
  kept blocks        block graphs `keep_activations` kept (auto: as many as fit beside the rollout copy)

`--rollout-placement resident,streamed` measures each placement of the rollout copy in turn in the same process
(a row each, `placement`): streamed keeps the decoder layers in page-locked host memory and streams them through
two device buffers every token step, so its tokens/s is bound by the host link against resident's.

With `--num-iterations 2` each rollout trains twice (rows: iteration 1, 2); the second takes the first's
log-probs as the old policy's, so neither runs a forward pass of its own for them.

    python bench/grpo_gpu.py --shape qwen2.5-7b --prompts 64 --generations 8 --new-tokens 256 \
        --out bench/results/grpo_7b.json

The streamed copy against the resident one at the 1.5B shape (about 2 to 3 minutes on one H100; at 7B the
engine's ~16 B/param and the streamed copy's 2 B/param of layers come near a 128 GiB host):

    python bench/grpo_gpu.py --shape qwen2.5-1.5b --prompts 64 --generations 8 --new-tokens 256 --warmup 1 \
        --steps 1 --rollout-placement resident,streamed --out bench/results/grpo_streamed_1.5b.json

CPU smoke test of the same path: `python bench/grpo_gpu.py --shape tiny --device cpu --prompts 2 --generations 4
--new-tokens 8 --micro 4 --steps 1 --out /tmp/grpo_tiny.json`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table, timed_grpo_steps, write_json  # noqa: E402
from mt_ray.config.run import load_run_config  # noqa: E402
from mt_ray.training.backend import build_backend  # noqa: E402
from mt_ray.training.grpo.steps import GrpoSteps  # noqa: E402
from mt_ray.training.model_source import load_model_and_tokenizer  # noqa: E402


def run_config(args, placement: str):
    completions = args.prompts * args.generations
    if completions % args.micro:
        raise SystemExit(f"--micro {args.micro} must divide prompts x generations ({completions})")
    return load_run_config(None, [
        f"model.preset={args.shape}", "data.datasets=[demo_math_prompts]", "training.stage=grpo",
        f"training.micro_batch_size={args.micro}", f"training.grad_accum_steps={completions // args.micro}",
        f"training.steps={args.steps + args.warmup}", f"grpo.num_generations={args.generations}",
        f"grpo.max_completion_length={args.new_tokens}", "grpo.max_prompt_length=64",
        "grpo.rewards=[{name: format}, {name: 'jobs.rewards:digits'}]", f"engine.device={args.device}",
        f"engine.checkpoint_every={args.k}", f"engine.stream_master={args.stream_master}",
        f"engine.kernels={args.kernels}", f"engine.grad_dtype={args.grad_dtype}",
        f"engine.keep_activations={args.keep_activations}", f"grpo.num_iterations={args.num_iterations}",
        f"rollout.placement={placement}",
    ])


def measure(args, placement: str) -> list[dict]:
    cfg = run_config(args, placement)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()  # each placement's own peak (host RSS is the process's: list resident first)
    spec, tokenizer = load_model_and_tokenizer(cfg)
    engine = build_backend(cfg, spec)
    steps = GrpoSteps(cfg, engine, spec, tokenizer)
    rows = []
    try:
        for i, rollout_s, update_s, result in timed_grpo_steps(steps, engine, args.warmup, args.steps):
            m = steps.metrics
            rows.append({
                "shape": args.shape, "placement": steps.sampler.copy.placement, "prompts": args.prompts, "G": args.generations, "new_tokens": args.new_tokens,
                "rollout_tokens_per_s": m["rollout/tokens_per_s"], "generate_s": m["rollout/generate_s"],
                "refresh_s": m["rollout/refresh_s"], "rollout_s": rollout_s, "update_s": update_s,
                "update_tokens": result.num_tokens,
                "update_tflops": 6 * spec.text_params * result.num_tokens / update_s / 1e12,
                "step_s": rollout_s + update_s, "completion_mean_length": m["completions/mean_length"],
                "iteration": i % args.num_iterations + 1, "kept_blocks": engine.kept.last_count,
                "reward": m["reward"], **engine.memory_metrics(),
            })
    finally:
        steps.close()
        engine.close()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen2.5-7b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--micro", type=int, default=16, help="completions per micro-batch")
    p.add_argument("--k", type=int, default=4, help="checkpoint every K layers")
    p.add_argument("--stream-master", action="store_true", help="stream the fp32 master (no bf16 host copy)")
    p.add_argument("--kernels", default="torch", choices=["torch", "liger"])
    p.add_argument("--grad-dtype", default="compute", choices=["fp32", "compute"],
                   help="host gradient buffers (compute: bf16 on a GPU, as the other benchmarks' lean setting)")
    p.add_argument("--keep-activations", default="auto", help="engine.keep_activations (auto: as many as fit beside "
                   "the rollout copy)")
    p.add_argument("--num-iterations", type=int, default=1, help="grpo.num_iterations: updates per rollout")
    p.add_argument("--rollout-placement", default="auto", help="rollout.placement, or several comma-separated "
                   "(resident,streamed) measured one after the other")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--out", default="bench/results/grpo_gpu.json")
    args = p.parse_args()
    rows = [row for placement in args.rollout_placement.split(",") for row in measure(args, placement)]
    print_table(rows, ["shape", "placement", "G", "new_tokens", "iteration", "kept_blocks", "rollout_tokens_per_s", "refresh_s",
                       "update_tflops", "step_s", "gpu_mem_gib", "host_bytes_per_param"])
    write_json(args.out, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
