"""The coordinator shard's gradient-sum rate, alone and beside the host optimizer, as the shard runs it.

A node with several engine workers sums their gradients piece by piece (`cluster.wire.sum_in_order`,
on the shard's reduce thread) while the optimizer thread updates the units already summed. On the 7B
two-GPU run the sum took ~14 s a step, so this measures its rate (output elements a second) as the shard
runs it: two bf16 parts of one ring piece summed into a bf16 slot, on a thread of its own with its own
intra-op thread count, alone and beside a thread running fused CPU AdamW on 256 M fp32 parameters.

Rows: `kernel` is `upcast` (`wire.sum_in_order`: each part cast to fp32, then fp32 adds) or `mixed` (the
baseline, the earlier loop: torch's mixed-dtype add of each bf16 part into the fp32 chunk); `threads` and
`adam_threads` the two teams' sizes (equal: both every core but one, the shard's count before the split).
Each row runs in its own process.

    python bench/gradient_sum.py --out bench/results/gradient_sum_h200x2.json
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
from mt_ray.cluster import wire  # noqa: E402
from mt_ray.cluster.shard_state import split_threads  # noqa: E402

PIECE = 64 << 20  # elements: half of the default 256 MiB ring in bf16
COLUMNS = ["kernel", "threads", "adam_threads", "alone_gelem_s", "beside_adam_gelem_s", "adam_gparam_s"]


def mixed_sum(parts: list[torch.Tensor], out: torch.Tensor) -> None:
    """The baseline: the shard's sum before the upcast (a mixed-dtype add per part)."""
    acc = torch.empty(min(wire.SUM_CHUNK, out.numel()), dtype=torch.float32)
    for lo in range(0, out.numel(), wire.SUM_CHUNK):
        hi = min(lo + wire.SUM_CHUNK, out.numel())
        chunk = acc[: hi - lo].copy_(parts[0][lo:hi])
        for v in parts[1:]:
            chunk.add_(v[lo:hi])
        torch.linalg.vector_norm(chunk)
        out[lo:hi].copy_(chunk)


KERNELS = {"upcast": wire.sum_in_order, "mixed": mixed_sum}


def _on_thread(fn, threads: int):
    """Run `fn` on a new thread with its own intra-op count, as the shard's reduce and optimizer threads run."""
    result: list = []

    def run() -> None:
        torch.set_num_threads(threads)
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
    cores = len(os.sched_getaffinity(0))
    adam_threads, threads = split_threads(cores - 1, sums=args.split)
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
    return {"kernel": args.kernel, "threads": threads, "adam_threads": adam_threads, "alone_gelem_s": alone,
            "beside_adam_gelem_s": beside, "adam_gparam_s": adam[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--adam-numel", type=int, default=1 << 28)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--kernel", default="upcast", help=argparse.SUPPRESS)
    p.add_argument("--split", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default="bench/results/gradient_sum.json")
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    rows = []
    for kernel in ("mixed", "upcast"):
        for split in (False, True):
            argv = [sys.executable, __file__, "--child", "--kernel", kernel, "--repeats", str(args.repeats),
                    "--adam-numel", str(args.adam_numel), *(["--split"] if split else [])]
            done = subprocess.run(argv, capture_output=True, text=True, check=True)
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print_table(rows, COLUMNS)
    write_json(args.out, {"piece_elements": PIECE, "rows": rows})


if __name__ == "__main__":
    main()
