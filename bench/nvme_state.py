"""Optimizer state on NVMe against host placement: one shape, two runs, each in its own process.

The disk under `--nvme-path` is measured first (`measure_disk`: direct write, read, then both at once). Then the
shape trains with `state_placement: host` (the baseline) and with `--placement` (nvme by default)
under `engine.host_memory_limit_gb = --host-limit-gb`, set below what host placement needs, so the
run cannot hold its state in RAM. Each row: peak RSS (B/param; also after loading the weights, before the
first step), step time, model TFLOPS, the disk's read and write GB/s during the timed steps
(`/proc/self/io`), and the calculator's predictions: the step at the measured disk bandwidth (reads and
writes at the mixed rate; `calc_serial_step_s`: one after the other at their own rates) and the peak
RSS (`sizing.rss_bytes`: the engine's allocations and the process's own). No clipping and compute-dtype gradients: gradients then wait in a
few slabs, not one buffer per unit, so host memory is the streamed copy plus the window.

    python bench/nvme_state.py --shape qwen2.5-3b --nvme-path /tmp/mt-ray-nvme --out bench/results/nvme_3b.json
    python bench/nvme_state.py --shape tiny --device cpu --batch 2 --micro 1 --seq 64 --nvme-path /tmp/x  # smoke
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402,E501
    OPT,
    count_params,
    peak_rss_bytes,
    print_table,
    random_micro_batches,
    row_in_child,
    shape_config,
    write_json,
)
from mt_ray.engine import EngineConfig, StreamingEngine  # noqa: E402
from mt_ray.engine.direct_io import measure_disk  # noqa: E402
from mt_ray.engine.sizing import disk_bytes, host_bytes, rss_bytes  # noqa: E402
from mt_ray.engine.step_time import Machine, predicted_step_seconds  # noqa: E402
from mt_ray.models.discovery import discover  # noqa: E402

GIB = 2**30
RUN_TIMEOUT_S = 540
COLUMNS = ["placement", "step_s", "calc_step_s", "step_vs_calc", "calc_serial_step_s", "model_tflops",
           "host_bytes_per_param", "calc_host_bytes_per_param", "load_host_bytes_per_param", "disk_read_gbps",
           "disk_write_gbps"]


def engine_config(args, placement: str) -> EngineConfig:
    on_disk = placement != "host"
    return EngineConfig(device=args.device, compute_dtype="bf16" if args.device != "cpu" else "fp32",
                        checkpoint_every=args.k, grad_dtype="compute", kernels=args.kernels, keep_activations=0,
                        state_placement=placement, nvme_path=args.nvme_path if on_disk else None,
                        host_memory_limit_gb=args.host_limit_gb if on_disk else None)


def disk_counters() -> tuple[int, int]:
    """Bytes this process has read from and written to storage (direct I/O included)."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def run_one(args, placement: str) -> dict:
    """One placement: a warm-up step, then timed steps; its row."""
    cfg = shape_config(args.shape)
    spec = discover(cfg)
    ecfg = engine_config(args, placement)
    opt = OPT.model_copy(update={"max_grad_norm": 0.0})
    machine = Machine(nvme_read_gbps=args.read_gbps, nvme_write_gbps=args.write_gbps, nvme_mixed_gbps=args.mixed_gbps)
    serial = Machine(nvme_read_gbps=args.read_gbps, nvme_write_gbps=args.write_gbps)
    engine = StreamingEngine(spec, ecfg, opt, total_steps=args.steps + 2)
    try:
        engine.load_random(seed=0)
        loaded_rss = peak_rss_bytes()
        mbs = random_micro_batches(cfg.vocab_size, args.batch, args.micro, args.seq)
        losses = [engine.train_step(mbs).loss]
        engine.synchronize()
        read0, write0 = disk_counters()
        t0 = time.perf_counter()
        losses += [engine.train_step(mbs).loss for _ in range(args.steps)]
        engine.synchronize()  # the last step's updates (and their disk traffic) count
        seconds = time.perf_counter() - t0
        read1, write1 = disk_counters()
    finally:
        engine.close()
    step_s = seconds / args.steps
    n = count_params(cfg)
    calc, calc_serial = (predicted_step_seconds(spec, ecfg, args.seq, args.batch, m, micro_batch=args.micro, opt=opt)
                         for m in (machine, serial))
    return {"placement": placement, "step_s": step_s, "calc_step_s": calc, "step_vs_calc": step_s / calc,
            "calc_serial_step_s": calc_serial, "model_tflops": 6 * n * args.seq * args.batch / step_s / 1e12,
            "params": n, "host_bytes_per_param": peak_rss_bytes() / n, "load_host_bytes_per_param": loaded_rss / n,
            "calc_host_bytes_per_param": rss_bytes(spec, ecfg, opt) / n,
            "calc_alloc_bytes_per_param": host_bytes(spec, ecfg, opt) / n, "disk_gib": disk_bytes(spec, ecfg) / GIB,
            "disk_read_gbps": (read1 - read0) / seconds / 1e9, "disk_write_gbps": (write1 - write0) / seconds / 1e9,
            "host_limit_gb": ecfg.host_memory_limit_gb, "losses": [float(x) for x in losses]}


def run_in_child(argv: list[str], placement: str) -> dict:
    """`run_one` in a fresh process, so each run's peak RSS is its own."""
    return row_in_child(__file__, [*argv, "--placement-run", placement], {"placement": placement}, RUN_TIMEOUT_S)


def parse_args(argv: list[str]):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen2.5-3b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--placement", default="nvme", choices=["nvme", "nvme_moments"])
    p.add_argument("--nvme-path", required=True, help="an existing folder on the disk to hold the state")
    p.add_argument("--host-limit-gb", type=float, default=20.0,
                   help="engine.host_memory_limit_gb of the NVMe run (3B: host placement needs ~44 GiB)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--kernels", default="torch", choices=["torch", "liger"])
    p.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    p.add_argument("--probe-gib", type=float, default=4.0, help="size of the disk probe's scratch file")
    p.add_argument("--read-gbps", type=float, help=argparse.SUPPRESS)  # measured by the parent
    p.add_argument("--write-gbps", type=float, help=argparse.SUPPRESS)
    p.add_argument("--mixed-gbps", type=float, help=argparse.SUPPRESS)
    p.add_argument("--placement-run", help=argparse.SUPPRESS)
    p.add_argument("--row-out", help=argparse.SUPPRESS)
    p.add_argument("--out", default="bench/results/nvme_3b.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.placement_run:
        Path(args.row_out).write_text(json.dumps(run_one(args, args.placement_run)))
        return []
    speed = measure_disk(args.nvme_path, int(args.probe_gib * GIB))
    print(f"disk under {args.nvme_path}: {speed.describe()}", flush=True)
    child = [*argv, "--read-gbps", str(speed.read_gbps), "--write-gbps", str(speed.write_gbps),
             "--mixed-gbps", str(speed.mixed_gbps)]
    rows = []
    for placement in ("host", args.placement):
        rows.append(run_in_child(child, placement))
        print(f"{placement}: {rows[-1]}", flush=True)
    device = torch.cuda.get_device_name() if args.device != "cpu" else "cpu"
    write_json(args.out, {"args": vars(args), "device": device, "disk_read_gbps": speed.read_gbps,
                          "disk_write_gbps": speed.write_gbps, "disk_mixed_gbps": speed.mixed_gbps, "rows": rows})
    print_table(rows, COLUMNS)
    return rows


if __name__ == "__main__":
    main()
