"""mt-ray side by side with the offloading peers, in one run on one machine.

Each system trains the same model shape on the same batches with the same optimizer and loss
(see `bench/peers.py`) in its own process, so peak host RSS and peak GPU memory are its own and
one system running out of memory does not end the comparison. Reports model TFLOPS (6 x all
params x tokens / step time, optimizer included), tokens/s, peak GPU memory, peak host RSS, the
host's used-memory growth (which counts pinned pages too) and mt-ray's speed-up over each peer.

    python bench/compare.py --shape qwen2.5-3b --batch 88 --micro 8 --systems mt-ray,deepspeed
    python bench/compare.py --shape qwen2.5-1.5b --batch 64 --micro 8 --systems mt-ray,plain,fsdp2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    OPT,
    HostMemorySampler,
    Timer,
    count_params,
    metrics,
    peak_rss_bytes,
    print_table,
    random_micro_batches,
    shape_config,
    write_json,
)
from bench.engine_gpu import add_run_args, run_engine  # noqa: E402
from bench.peers import PEERS, deepspeed_host_bytes  # noqa: E402
from mt_ray.engine.host_store import available_host_bytes  # noqa: E402

SYSTEMS = ["mt-ray", *PEERS]
COLUMNS = ["system", "status", "params_b", "batch", "micro", "seq", "step_s", "tokens_per_s", "model_tflops",
           "peak_gpu_gib", "host_rss_gib", "host_used_gib", "host_bytes_per_param", "mtray_speedup", "setup_s"]


def run_one(args, system: str) -> dict:
    """Train `system` for warm-up + timed steps in this process; one result row."""
    cfg = shape_config(args.shape, args.attn)
    with HostMemorySampler() as host:
        row = run_engine(args, cfg) if system == "mt-ray" else run_peer(args, cfg, system)
    row.update(status="ok", host_rss_gib=peak_rss_bytes() / 2**30, host_used_gib=host.peak_bytes / 2**30,
               host_bytes_per_param=peak_rss_bytes() / (row["params_b"] * 1e9))
    return row


def run_peer(args, cfg, system: str) -> dict:
    opt = OPT.model_copy(update={"max_grad_norm": args.clip})
    mbs = random_micro_batches(cfg.vocab_size, args.batch, args.micro, args.seq)
    t0 = time.perf_counter()
    step = PEERS[system](cfg, mbs, opt, args.loss_chunk, kernels=args.kernels)
    setup_s = time.perf_counter() - t0
    losses = [step() for _ in range(args.warmup)]
    torch.cuda.reset_peak_memory_stats()
    with Timer() as t:
        losses += [step() for _ in range(args.steps)]
    row = metrics(args, cfg, count_params(cfg), t.seconds / args.steps, system)
    row.update(setup_s=setup_s, losses=[float(x) for x in losses], peak_gpu_gib=torch.cuda.max_memory_allocated() / 2**30)
    return row


def preflight(args, system: str) -> str | None:
    """Why `system` cannot run here, before spending minutes finding out; None if it may."""
    if system.startswith("deepspeed"):
        need, have = deepspeed_host_bytes(count_params(shape_config(args.shape))), available_host_bytes()
        if need > have:
            return f"skipped: DeepSpeed's own estimate needs {need / 2**30:.0f} GiB host RAM, {have / 2**30:.0f} GiB free"
    return None


def spawn(args, system: str, argv: list[str]) -> dict:
    """Run one system in a child process (its own memory), with a time limit."""
    reason = preflight(args, system)
    if reason:
        return {"system": system, "status": reason}
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, __file__, *argv, "--one", system, "--row-out", out.name]
        try:
            proc = subprocess.run(cmd, timeout=args.timeout, capture_output=True, text=True)
        except subprocess.TimeoutExpired:
            return {"system": system, "status": f"timed out after {args.timeout}s"}
        if proc.returncode != 0:
            tail = [line for line in proc.stderr.strip().splitlines() if line.strip()][-3:]
            return {"system": system, "status": f"failed (exit {proc.returncode}): " + " | ".join(tail)[-400:]}
        return json.loads(Path(out.name).read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(p)
    p.set_defaults(attn="sdpa")  # one attention implementation for every system
    p.add_argument("--systems", default="mt-ray,deepspeed,fsdp2,plain", help=f"comma list of {SYSTEMS}")
    p.add_argument("--timeout", type=int, default=900, help="seconds each system may take, set-up included")
    p.add_argument("--out", default="bench/results/compare.json")
    p.add_argument("--one", choices=SYSTEMS, help=argparse.SUPPRESS)  # child mode
    p.add_argument("--row-out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.packed_docs:
        p.error("--packed-docs: the peers train unpacked rows; measure packed rows with bench/engine_gpu.py")
    if args.one:
        write_json(args.row_out, run_one(args, args.one))
        return

    rows = []
    for system in args.systems.split(","):
        rows.append(spawn(args, system, sys.argv[1:]))
        print(f"{system}: {rows[-1]['status']}", flush=True)
        write_json(args.out, {"args": vars(args), "device": torch.cuda.get_device_name(), "rows": rows})
    ours = next((r for r in rows if r["system"] == "mt-ray" and r["status"] == "ok"), None)
    for r in rows:
        if ours and r["status"] == "ok":
            r["mtray_speedup"] = r["step_s"] / ours["step_s"]
    print_table(rows, COLUMNS)
    write_json(args.out, {"args": vars(args), "device": torch.cuda.get_device_name(), "rows": rows})


if __name__ == "__main__":
    main()
