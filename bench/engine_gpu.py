"""Benchmark of the streaming engine on one GPU: throughput, memory and where the step time goes.

Reports model TFLOPS as 6 x params x tokens / step time with the optimizer inside the step
(MegaTrain's formula), the attention-inclusive figure, host bytes/param (peak RSS), peak GPU
memory, and the time split of one profiled step (H2D, compute, D2H busy time from CUPTI; the
optimizer thread's CPU time; GPU idle = step time minus compute-stream busy time).

    python bench/engine_gpu.py --shape qwen2.5-7b --batch 128 --micro 16 --out results.json

Side-by-side runs against DeepSpeed, FSDP2 and plain PyTorch are `bench/compare.py`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    OPT,
    Timer,
    metrics,
    peak_rss_bytes,
    print_table,
    random_micro_batches,
    shape_config,
    write_json,
)
from mt_ray.engine import EngineConfig, StreamingEngine  # noqa: E402
from mt_ray.engine.sizing import device_bytes, predicted_step_seconds  # noqa: E402
from mt_ray.models.discovery import discover  # noqa: E402


def run_engine(args, cfg) -> dict:
    spec = discover(cfg)
    ecfg = EngineConfig(device="cuda", compute_dtype="bf16", schedule=args.schedule, checkpoint_every=args.k,
                        stream_master=args.stream_master, grad_dtype=args.grad_dtype, loss_chunk_tokens=args.loss_chunk,
                        kernels=args.kernels)
    opt = OPT.model_copy(update={"max_grad_norm": args.clip})
    t0 = time.perf_counter()
    engine = StreamingEngine(spec, ecfg, opt, total_steps=args.warmup + args.steps + 4)
    engine.load_random(seed=0)
    setup_s = time.perf_counter() - t0
    mbs = random_micro_batches(cfg.vocab_size, args.batch, args.micro, args.seq)
    losses = []
    try:
        for _ in range(args.warmup):
            losses.append(engine.train_step(mbs).loss)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        busy0 = engine.worker.busy_seconds
        # Steady state: the clock starts while the optimizer still finishes the warm-up step
        # (which the first timed step must wait for) and stops when the last step's GPU work
        # ends (its own optimizer tail would overlap the next step): one boundary per step.
        with Timer() as t:
            for _ in range(args.steps):
                losses.append(engine.train_step(mbs).loss)
        engine.synchronize()
        step_s = t.seconds / args.steps
        opt_s = (engine.worker.busy_seconds - busy0) / args.steps
        split = profile_steps(engine, mbs) if args.profile else {}
        row = metrics(args, cfg, spec.num_params, step_s, "mt-ray")
        predicted = device_bytes(spec, ecfg, args.micro, args.seq, args.batch)["total"] / 2**30
        row.update(split, optimizer_s=opt_s, setup_s=setup_s, losses=[float(x) for x in losses],
                   host_bytes_per_param=peak_rss_bytes() / spec.num_params,
                   peak_gpu_gib=torch.cuda.max_memory_allocated() / 2**30, calc_gpu_gib=predicted,
                   calc_step_s=predicted_step_seconds(spec, ecfg, args.seq, args.batch))
        return row
    finally:
        engine.close()


def profile_steps(engine: StreamingEngine, mbs, n: int = 3) -> dict:
    """Per-step busy time of each engine (compute, H2D, D2H) over `n` back-to-back steps.

    A marker kernel (`torch.cuda._sleep`) is queued before each step; the span between two
    markers is one steady-state step on the GPU timeline, boundary wait included.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            torch.cuda._sleep(1000)
            engine.train_step(mbs)
        torch.cuda._sleep(1000)
        torch.cuda.synchronize()
    markers, kernels, h2d, d2h = [], [], [], []
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        span = (ev.time_range.start, ev.time_range.end)
        name = ev.name.lower()
        if "spin" in name:
            markers.append(span[0])
        elif "memcpy" in name and "htod" in name:
            h2d.append(span)
        elif "memcpy" in name and "dtoh" in name:
            d2h.append(span)
        elif "memcpy" not in name and "memset" not in name:
            kernels.append(span)
    markers.sort()
    window = (markers[1], markers[-1])  # skip the first step: it starts from a synchronised engine
    steps = len(markers) - 2
    step_us = (window[1] - window[0]) / steps
    busy = {k: _union(_clip(v, window)) / steps / 1e6 for k, v in (("compute", kernels), ("h2d", h2d), ("d2h", d2h))}
    return {
        "gpu_step_s": step_us / 1e6, "h2d_busy_s": busy["h2d"], "compute_busy_s": busy["compute"],
        "d2h_busy_s": busy["d2h"], "gpu_idle_frac": max(0.0, 1 - busy["compute"] * 1e6 / step_us),
    }


def _clip(spans, window):
    lo, hi = window
    return [(max(s, lo), min(e, hi)) for s, e in spans if e > lo and s < hi]


def _union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def add_run_args(p: argparse.ArgumentParser) -> None:
    """Model shape, batch and engine options, shared with the side-by-side comparison."""
    p.add_argument("--shape", default="qwen2.5-7b")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--micro", type=int, default=16)
    p.add_argument("--schedule", default="stream", choices=["stream", "resident"], help="engine schedule")
    p.add_argument("--k", type=int, default=4, help="checkpoint every K layers")
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--stream-master", action="store_true")
    p.add_argument("--grad-dtype", default="fp32", choices=["fp32", "compute"])
    p.add_argument("--loss-chunk", type=int, default=4096)
    p.add_argument("--kernels", default="torch", choices=["torch", "liger"], help="fused Liger kernels (mt-ray and every peer)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="profile one extra step for the time split")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(p)
    p.add_argument("--out", default="bench/results/engine_gpu.json")
    args = p.parse_args()

    cfg = shape_config(args.shape)
    rows = [run_engine(args, cfg)]
    cols = ["system", "shape", "params_b", "batch", "seq", "step_s", "tokens_per_s", "model_tflops", "tflops_with_attn",
            "peak_gpu_gib", "calc_gpu_gib", "host_bytes_per_param", "h2d_busy_s", "compute_busy_s", "d2h_busy_s", "optimizer_s",
            "gpu_idle_frac", "gpu_step_s", "calc_step_s"]
    print_table(rows, cols)
    write_json(args.out, {"args": vars(args), "device": torch.cuda.get_device_name(), "rows": rows})


if __name__ == "__main__":
    main()
