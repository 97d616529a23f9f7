"""The coordinator shard's gradient-sum rate, alone and beside the host optimizer, as the shard runs it.

A node with several engine workers sums their gradients piece by piece (`cluster.wire.sum_in_order`,
one reduce thread) while the optimizer thread updates the units already summed. On the 7B two-GPU run
the sum took ~14 s a step, so this measures its rate (output elements a second) where the shard runs it:
a process whose intra-op threads are every core but one, two bf16 parts of one ring piece each, summed
into a bf16 slot, alone and with a thread running fused CPU AdamW on a 7B unit's worth of fp32 state.
Each condition runs in its own process (OpenMP's wait policy is read once, at start).

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

PIECE = 64 << 20  # elements: half of the default 256 MiB ring in bf16
COLUMNS = ["condition", "wait_policy", "threads", "adam_threads", "chunk", "alone_gelem_s", "beside_adam_gelem_s", "adam_gparam_s"]


def _sum_rate(parts: list[torch.Tensor], out: torch.Tensor, repeats: int, threads: int) -> float:
    """On a thread of its own, as the shard's reduce thread, with its own intra-op thread count."""
    rate: list[float] = []

    def run() -> None:
        torch.set_num_threads(threads)
        wire.sum_in_order(parts, out)  # warm: pages touched, threads started
        t0 = time.perf_counter()
        for _ in range(repeats):
            wire.sum_in_order(parts, out)
        rate.append(repeats * out.numel() / (time.perf_counter() - t0) / 1e9)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return rate[0]


def _adam_load(stop: threading.Event, numel: int, rate: list[float], threads: int) -> None:
    torch.set_num_threads(threads)
    p = torch.zeros(numel, requires_grad=True)
    p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW([p], lr=1e-5, fused=True)
    steps, t0 = 0, time.perf_counter()
    while not stop.is_set():
        opt.step()
        steps += 1
    rate.append(steps * numel / (time.perf_counter() - t0) / 1e9)


def child(args) -> dict:
    cores = len(os.sched_getaffinity(0))
    threads = args.threads or cores - 1  # the shard's: every core but one
    adam_threads = cores - 1 if args.adam_rest == 0 else max(1, cores - 1 - threads)
    torch.set_num_threads(cores - 1)
    wire.SUM_CHUNK = args.chunk
    parts = [torch.randn(PIECE).bfloat16() for _ in range(2)]
    out = torch.empty(PIECE, dtype=torch.bfloat16)
    alone = _sum_rate(parts, out, args.repeats, threads)
    stop, adam = threading.Event(), []
    load = threading.Thread(target=_adam_load, args=(stop, args.adam_numel, adam, adam_threads))
    load.start()
    time.sleep(1.0)  # the optimizer's first steps allocate its moments
    beside = _sum_rate(parts, out, args.repeats, threads)
    stop.set()
    load.join()
    return {"threads": threads, "adam_threads": adam_threads, "chunk": args.chunk, "alone_gelem_s": alone, "beside_adam_gelem_s": beside,
            "adam_gparam_s": adam[0] if adam else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunks", default=f"{wire.SUM_CHUNK},{16 << 20}", help="SUM_CHUNK values to compare")
    p.add_argument("--threads", default="0,8,1", help="intra-op threads to compare (0: the shard's own count)")
    p.add_argument("--policies", default=",PASSIVE", help="OMP_WAIT_POLICY values ('' for the default)")
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--adam-numel", type=int, default=1 << 28)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--chunk", type=int, default=wire.SUM_CHUNK, help=argparse.SUPPRESS)
    p.add_argument("--thread-count", dest="threads_one", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--adam-rest", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out", default="bench/results/gradient_sum.json")
    args = p.parse_args()
    if args.child:
        args.threads = args.threads_one
        print(json.dumps(child(args)))
        return
    rows = []
    cases = [(policy, chunk, threads, rest) for policy in args.policies.split(",")
             for chunk in map(int, args.chunks.split(",")) for threads in map(int, args.threads.split(","))
             for rest in ((0, 1) if threads else (0,))]
    for policy, chunk, threads, rest in cases:
        env = dict(os.environ, OMP_WAIT_POLICY=policy) if policy else dict(os.environ)
        argv = [sys.executable, __file__, "--child", "--chunk", str(chunk), "--thread-count", str(threads), "--adam-rest", str(rest),
                "--repeats", str(args.repeats), "--adam-numel", str(args.adam_numel)]
        done = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
        row = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append({"condition": "current" if chunk == wire.SUM_CHUNK and not threads else "variant",
                     "wait_policy": policy or "default", **row})
        print_table(rows, COLUMNS)
    write_json(args.out, {"piece_elements": PIECE, "rows": rows})


if __name__ == "__main__":
    main()
