"""The coordinator shard's gradient-sum rate, alone and beside the host optimizer, as the shard runs it.

A node with several engine workers sums their gradients piece by piece (`cluster.grad_sum.sum_in_order`, on the
shard's reduce thread) while the optimizer thread updates the units already summed. This measures the rate (output
elements a second) as the shard runs it: two bf16 parts of one ring piece summed into a bf16 slot, on a thread of its
own with its own team, alone and beside a thread running fused CPU AdamW on 256 M fp32 parameters.

Rows: `kernel` is `numba` (`grad_sum.sum_in_order`: one compiled pass, numba's per-thread team) or `torch` (the
baseline, the shard's earlier loop: per 1 Mi-element chunk, each bf16 part cast up, fp32 adds, a norm, a cast
down); `threads` the sum team's size, `adam_threads` the optimizer's (the cores left). Each row runs in its own
process.

    python bench/gradient_sum.py --threads 4,8,12 --out bench/results/gradient_sum_h200x2.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table, write_json  # noqa: E402
from mt_ray.cluster.grad_sum import sum_in_order, use_sum_threads  # noqa: E402

PIECE = 64 << 20  # elements: a quarter of a 7B shape's two-layer ring in bf16
CHUNK = 1 << 20  # the baseline's chunk
COLUMNS = ["kernel", "layer", "threads", "adam_threads", "alone_gelem_s", "beside_adam_gelem_s", "adam_gparam_s"]


def torch_sum(parts: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """The baseline: the shard's earlier sum, about eight torch ops per cache-sized chunk."""
    norm_sq = torch.zeros((), dtype=torch.float64)
    acc, upcast = torch.empty(CHUNK, dtype=torch.float32), torch.empty(CHUNK, dtype=torch.float32)
    for lo in range(0, out.numel(), CHUNK):
        hi = min(lo + CHUNK, out.numel())
        chunk = acc[: hi - lo].copy_(parts[0][lo:hi])
        for v in parts[1:]:
            chunk.add_(upcast[: hi - lo].copy_(v[lo:hi]))
        norm_sq += torch.linalg.vector_norm(chunk).square()
        out[lo:hi].copy_(chunk)
    return norm_sq


KERNELS = {"numba": sum_in_order, "torch": torch_sum}


def _on_thread(fn, threads: int):
    """Run `fn` on a new thread with its own intra-op count, as the shard's reduce and optimizer threads run."""
    result: list = []

    def run() -> None:
        torch.set_num_threads(threads)  # the baseline's team (ATen's); numba's below
        use_sum_threads(threads)
        result.append(fn())

    t = threading.Thread(target=run)
    t.start()
    return t, result


def _sum_rate(kernel, parts: list[torch.Tensor], out: torch.Tensor, repeats: int, threads: int) -> float:
    def timed() -> float:
        kernel(parts, out)  # warm: pages touched, the team started
        t0 = time.perf_counter()
        for _ in range(repeats):
            kernel(parts, out)
        return repeats * out.numel() / (time.perf_counter() - t0) / 1e9

    t, rate = _on_thread(timed, threads)
    t.join()
    return rate[0]


def _adam(stop: threading.Event, numel: int) -> float:
    p = torch.zeros(numel, requires_grad=True)
    p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW([p], lr=1e-5, fused=True)
    steps, t0 = 0, time.perf_counter()
    while not stop.is_set():
        opt.step()
        steps += 1
    return steps * numel / (time.perf_counter() - t0) / 1e9


def child(args) -> dict:
    threads = args.threads
    adam_threads = max(1, len(os.sched_getaffinity(0)) - 1 - threads)
    kernel = KERNELS[args.kernel]
    parts = [torch.randn(PIECE).bfloat16() for _ in range(2)]
    out = torch.empty(PIECE, dtype=torch.bfloat16)
    alone = _sum_rate(kernel, parts, out, args.repeats, threads)
    stop = threading.Event()
    load, adam = _on_thread(lambda: _adam(stop, args.adam_numel), adam_threads)
    time.sleep(1.0)  # the optimizer's first steps allocate its moments
    beside = _sum_rate(kernel, parts, out, args.repeats, threads)
    stop.set()
    load.join()
    import numba

    return {"kernel": args.kernel, "layer": numba.threading_layer() if args.kernel == "numba" else "aten", "threads": threads, "adam_threads": adam_threads, "alone_gelem_s": alone,
            "beside_adam_gelem_s": beside, "adam_gparam_s": adam[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--adam-numel", type=int, default=1 << 28)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--kernel", default="numba", help=argparse.SUPPRESS)
    p.add_argument("--threads", default="4,8", help="sum team sizes to measure, comma-separated")
    p.add_argument("--out", default="bench/results/gradient_sum.json")
    args = p.parse_args()
    if args.child:
        args.threads = int(args.threads)
        print(json.dumps(child(args)))
        return
    rows = []
    for kernel in ("torch", "numba"):
        for threads in args.threads.split(","):
            argv = [sys.executable, __file__, "--child", "--kernel", kernel, "--repeats", str(args.repeats),
                    "--adam-numel", str(args.adam_numel), "--threads", threads]
            done = subprocess.run(argv, capture_output=True, text=True, check=True)
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print_table(rows, COLUMNS)
    write_json(args.out, {"piece_elements": PIECE, "rows": rows})


if __name__ == "__main__":
    main()
