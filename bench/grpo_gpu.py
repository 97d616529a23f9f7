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

`--compare-decodes graph,static,generate` measures the rollout alone (no engine, no update: a copy of random
weights in `--dtype`), each decode path on the same prompts in one process, at each of `--rollout-shapes`
(prompts x G x new tokens), under the seeded sampler (`--temperature`, `--top-p`) and greedy; each row has its
tokens/s, the GPU memory its generation took against the device model's `rollout_bytes`, and how many completions
equal the reference path's (`generate`, today's) token for token:

    python bench/grpo_gpu.py --shape qwen2.5-7b --compare-decodes graph,graph_sdpa,static,generate \
        --rollout-shapes 16x8x128,64x8x256 --out bench/results/grpo_rollout_7b.json

CPU smoke test of the same path: `python bench/grpo_gpu.py --shape tiny --device cpu --prompts 2 --generations 4
--new-tokens 8 --micro 4 --steps 1 --out /tmp/grpo_tiny.json`; of the comparison: `python bench/grpo_gpu.py
--shape tiny --device cpu --dtype fp32 --compare-decodes static,generate --rollout-shapes 2x4x16 --out /tmp/r.json`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table, timed_grpo_steps, write_json  # noqa: E402
from mt_ray.config.run import load_run_config  # noqa: E402
from mt_ray.data.loader import pad_token_id  # noqa: E402
from mt_ray.engine.grpo import GrpoConfig  # noqa: E402
from mt_ray.engine.sizing import GIB, rollout_bytes  # noqa: E402
from mt_ray.training.backend import build_backend  # noqa: E402
from mt_ray.training.grpo.prompts import PromptStream, read_prompts  # noqa: E402
from mt_ray.training.grpo.rollout import build_copy, generation_eos  # noqa: E402
from mt_ray.training.grpo.steps import GrpoSteps  # noqa: E402
from mt_ray.training.model_source import load_model_and_tokenizer  # noqa: E402

PROMPT_TOKENS = 64  # grpo.max_prompt_length of every row


def run_config(args, placement: str):
    completions = args.prompts * args.generations
    if completions % args.micro:
        raise SystemExit(f"--micro {args.micro} must divide prompts x generations ({completions})")
    return load_run_config(None, [
        f"model.preset={args.shape}", "data.datasets=[demo_math_prompts]", "training.stage=grpo",
        f"training.micro_batch_size={args.micro}", f"training.grad_accum_steps={completions // args.micro}",
        f"training.steps={args.steps + args.warmup}", f"grpo.num_generations={args.generations}",
        f"grpo.max_completion_length={args.new_tokens}", f"grpo.max_prompt_length={PROMPT_TOKENS}",
        "grpo.rewards=[{name: format}, {name: 'jobs.rewards:digits'}]", f"engine.device={args.device}",
        f"engine.checkpoint_every={args.k}", f"engine.stream_master={args.stream_master}",
        f"engine.kernels={args.kernels}", f"engine.grad_dtype={args.grad_dtype}",
        f"engine.keep_activations={args.keep_activations}", f"grpo.num_iterations={args.num_iterations}",
        f"rollout.placement={placement}", f"engine.device_optimizer_units={args.device_optimizer_units}",
    ])


def measure(args, placement: str) -> list[dict]:
    cfg = run_config(args, placement)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()  # each placement's own peak (host RSS is the process's: list resident first)
    spec, tokenizer = load_model_and_tokenizer(cfg)
    engine = build_backend(cfg, spec)
    steps = GrpoSteps(cfg, engine, spec, tokenizer)
    if args.decode:
        steps.sampler.copy.decode = args.decode
    rows = []
    busy, wait = engine.worker.busy_seconds, engine.streamer.optimizer_wait_s
    try:
        for i, rollout_s, update_s, result in timed_grpo_steps(steps, engine, args.warmup, args.steps):
            m = steps.metrics
            # The host AdamW's busy seconds since the last row, and the engine thread's waits for it (the next
            # rollout's refresh, which reads every updated unit, shows the rest in `refresh_s`).
            (opt_s, opt_wait_s), busy, wait = ((engine.worker.busy_seconds - busy,
                                                engine.streamer.optimizer_wait_s - wait),
                                               engine.worker.busy_seconds, engine.streamer.optimizer_wait_s)
            rows.append({
                "shape": args.shape, "placement": steps.sampler.copy.placement, "decode": steps.sampler.copy.decode, "prompts": args.prompts, "G": args.generations, "new_tokens": args.new_tokens,
                "rollout_tokens_per_s": m["rollout/tokens_per_s"], "generate_s": m["rollout/generate_s"],
                "refresh_s": m["rollout/refresh_s"], "rollout_s": rollout_s, "update_s": update_s,
                "update_tokens": result.num_tokens,
                "update_tflops": 6 * spec.text_params * result.num_tokens / update_s / 1e12,
                "step_s": rollout_s + update_s, "completion_mean_length": m["completions/mean_length"],
                "iteration": i % args.num_iterations + 1, "kept_blocks": engine.kept.last_count,
                "reward": m["reward"], "optimizer_s": opt_s, "optimizer_wait_s": opt_wait_s,
                "device_optimizer_units": len(engine.store.on_device.units) if engine.store.on_device else 0,
                **engine.memory_metrics(),
            })
    finally:
        steps.close()
        engine.close()
    return rows


def compare_decodes(args):
    """Each decode path's rollout of the same prompts from one copy, at each shape, seeded and greedy: the rows
    of each shape as it is done."""
    shapes = [tuple(int(x) for x in shape.split("x")) for shape in args.rollout_shapes.split(",")]
    args.micro = args.generations  # the update is not run: any micro-batch that divides the rows
    cfg = run_config(args, "resident")
    cfg = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"compute_dtype": args.dtype})})
    spec, tokenizer = load_model_and_tokenizer(cfg)
    device = cfg.engine.resolve_device()
    most = max(p * g for p, g, _ in shapes)
    copy = build_copy(spec, cfg.engine, device, most, PROMPT_TOKENS + max(t for *_, t in shapes), "resident")
    stream = PromptStream(read_prompts(cfg.data, tokenizer, PROMPT_TOKENS), 0)
    pad, eos = pad_token_id(tokenizer), {tokenizer.eos_token_id, *generation_eos(copy.model)}
    decodes = args.compare_decodes.split(",")
    reference = "generate" if "generate" in decodes else decodes[0]
    for decode in decodes:  # first use of each path's kernels, outside the timings
        copy.generate([stream.take(1)[0].ids], GrpoConfig(num_generations=2, max_completion_length=8), eos, pad, 0,
                      decode=decode)
    for prompts, g, new_tokens in shapes:
        rows = []
        ids = [p.ids for p in stream.take(prompts)]
        for sampling, temperature in (("seeded", args.temperature), ("greedy", 1e-6)):
            grpo = GrpoConfig(num_generations=g, max_completion_length=new_tokens, temperature=temperature,
                              top_p=args.top_p if sampling == "seeded" else 1.0)
            outs = {d: _timed_rollout(copy, ids, grpo, eos, pad, d) for d in decodes}
            ref = outs[reference][0]
            for d, (rollout, seconds, peak, captured) in outs.items():
                same = [a == b for a, b in zip(rollout.completion_ids, ref.completion_ids, strict=True)]
                rows.append({
                    "shape": args.shape, "dtype": args.dtype, "prompts": prompts, "G": g, "new_tokens": new_tokens,
                    "sampling": sampling, "decode": d, "rollout_tokens_per_s": sum(rollout.lengths) / seconds,
                    "generate_s": seconds, "tokens": sum(rollout.lengths), "captured_steps": captured,
                    "generation_gib": peak / GIB,
                    "predicted_generation_gib": rollout_bytes(spec, cfg.engine, prompts * g,
                                                              PROMPT_TOKENS + new_tokens)[1] / GIB,
                    "equal_rows": sum(same), "rows": len(same), f"equal_to_{reference}": all(same),
                    "equal_token_share": _common_prefix(rollout, ref),
                })
        yield rows


def _timed_rollout(copy, ids, grpo, eos, pad, decode):
    """The rollout, its seconds (returned with its completions: waited for), the device memory it took beyond what
    was allocated before it, and the token steps replayed from a CUDA graph."""
    cuda = copy.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(copy.device)
        torch.cuda.reset_peak_memory_stats(copy.device)
    before = torch.cuda.memory_allocated(copy.device) if cuda else 0
    start = time.perf_counter()
    rollout = copy.generate(ids, grpo, eos, pad, seed=1, decode=decode)  # .tolist() inside: waits for the device
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(copy.device) - before if cuda else 0
    return rollout, seconds, peak, copy.captured_steps


def _common_prefix(rollout, ref) -> float:
    """The share of the reference's tokens each completion matches before its first difference."""
    same = 0
    for a, b in zip(rollout.completion_ids, ref.completion_ids, strict=True):
        same += next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return same / max(1, sum(len(b) for b in ref.completion_ids))


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
    p.add_argument("--decode", default=None, choices=["graph", "static", "graph_sdpa", "generate"],
                   help="the rollout copy's decode path (default: its own, graph on a GPU)")
    p.add_argument("--compare-decodes", default=None, help="comma-separated decode paths: measure the rollout alone "
                   "with each (no update), e.g. graph,graph_sdpa,static,generate")
    p.add_argument("--rollout-shapes", default=None, help="with --compare-decodes: prompts x G x new tokens, "
                   "comma-separated (default: --prompts x --generations x --new-tokens)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="with --compare-decodes: the copy's")
    p.add_argument("--temperature", type=float, default=1.0, help="with --compare-decodes: the seeded rows'")
    p.add_argument("--top-p", type=float, default=1.0, help="with --compare-decodes: the seeded rows'")
    p.add_argument("--device-optimizer-units", default="auto", help="engine.device_optimizer_units: the units whose "
                   "optimizer state stays on the GPU (auto, or a number; 0: every update on the host)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--out", default="bench/results/grpo_gpu.json")
    args = p.parse_args()
    if args.compare_decodes:
        args.rollout_shapes = args.rollout_shapes or f"{args.prompts}x{args.generations}x{args.new_tokens}"
        rows = []
        for shape_rows in compare_decodes(args):  # each shape's printed and written as it is done
            rows += shape_rows
            print_table(shape_rows, ["shape", "prompts", "G", "new_tokens", "sampling", "decode",
                                     "rollout_tokens_per_s", "captured_steps", "generation_gib",
                                     "predicted_generation_gib", "equal_rows", "rows", "equal_token_share"])
            write_json(args.out, {"args": vars(args), "rows": rows})
        return
    rows = [row for placement in args.rollout_placement.split(",") for row in measure(args, placement)]
    print_table(rows, ["shape", "placement", "G", "new_tokens", "iteration", "kept_blocks", "rollout_tokens_per_s", "refresh_s",
                       "update_tflops", "step_s", "gpu_mem_gib", "host_bytes_per_param"])
    write_json(args.out, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
