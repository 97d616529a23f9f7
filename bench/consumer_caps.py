"""The 7B shape on emulated consumer cards: GPU memory capped per process, the calculator's configuration.

For each cap the calculator (`mt-ray calc`'s `recommend`, given the cap and this host's available
memory) picks the configuration; the engine then runs it with `engine.gpu_memory_limit_gb` set to
the cap, which caps the caching allocator (`torch.cuda.set_per_process_memory_fraction`), so an
allocation past the cap fails as it would on that card. fp32 master weights and fp32 moments, as
always, and global-norm clipping on. Each cap runs in its own process: a fresh CUDA context and
allocator, and the host state of the previous cap freed before the next one builds its own. The
allocator runs with expandable segments (what a small card wants: less memory lost to
fragmentation); the CUDA context itself lies outside the cap, where a real card would hold it.

    python bench/consumer_caps.py --caps 24,16,10 --seq 1024 --global-batch 64
    python bench/consumer_caps.py --dry-run --host-mem-gb 128    # the calculator's choices only, no GPU

Writes one row per cap: cap_gib, trained, peak_gpu_gib, calc_gpu_gib, step_s, model_tflops, and the
configuration chosen, the predicted step time, the measured peak over the prediction, the peak
reserved by the allocator, the host bytes per parameter and any error.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import OPT, print_table, row_in_child, shape_config, write_json  # noqa: E402
from bench.engine_gpu import measure  # noqa: E402
from bench.memory_profile import replay  # noqa: E402
from mt_ray.engine import EngineConfig, StreamingEngine  # noqa: E402
from mt_ray.engine.calculator import SEARCHED, recommend  # noqa: E402
from mt_ray.engine.host_store import GIB, available_host_bytes  # noqa: E402
from mt_ray.errors import InsufficientMemoryError  # noqa: E402
from mt_ray.models.discovery import discover  # noqa: E402

COLUMNS = ["cap_gib", "trained", "peak_gpu_gib", "calc_gpu_gib", "step_s", "model_tflops"]
DRY_COLUMNS = ["cap_gib", "fits", "calc_gpu_gib", "calc_host_gib", "predicted_step_s", "micro_batch_size", "config"]
CAP_TIMEOUT_S = 300  # one cap's process: a hung run must not eat the others' time


def choose(args, cap: float) -> dict:
    """The calculator's configuration for one cap, as the first columns of its row."""
    spec = discover(shape_config(args.shape))
    host_gb = args.host_mem_gb if args.host_mem_gb is not None else available_host_bytes() / GIB
    rec = recommend(spec, args.seq, args.global_batch, cap, host_gb, opt=OPT)
    row = {"cap_gib": cap, "fits": rec["fits"], "host_mem_gb": host_gb, "calc_gpu_gib": rec.get("device_gib"),
           "calc_host_gib": rec.get("host_gib"), "predicted_step_s": rec.get("predicted_step_s"),
           "micro_batch_size": rec.get("micro_batch_size"),
           "config": {k: rec[k] for k in SEARCHED} if rec["fits"] else None}
    return row if rec["fits"] else {**row, "error": f"calculator: {rec['reason']}"}


def run_cap(args, cap: float) -> dict:
    """One cap: the calculator's choice, then a warm-up step and timed steps under the cap."""
    row = {**choose(args, cap), "trained": False}
    if not row["fits"]:
        return row
    cfg = shape_config(args.shape)
    ecfg = EngineConfig(device="cuda", compute_dtype="bf16", gpu_memory_limit_gb=cap,
                        host_memory_limit_gb=row["host_mem_gb"], **row["config"])
    run = argparse.Namespace(shape=args.shape, batch=args.global_batch, micro=row["micro_batch_size"], seq=args.seq,
                             warmup=1, steps=args.steps, packed_docs=0, attn=ecfg.attn_implementation)
    try:
        engine = StreamingEngine(discover(cfg), ecfg, OPT, total_steps=run.warmup + run.steps + 1)
    except InsufficientMemoryError as e:
        return {**row, "error": str(e)}
    try:
        engine.load_random(seed=0)
        if args.profile:  # the allocator's history from here on, replayed to its peak below
            row["held_before_profile_gib"] = torch.cuda.memory_allocated() / GIB
            torch.cuda.memory._record_memory_history(max_entries=4_000_000, stacks="python")
        m = measure(engine, run, cfg)  # engine_gpu's: the peak is the timed steps' (after the warm-up)
        if args.profile:
            row["at_peak"] = peak_sites(torch.cuda.memory._snapshot())
            torch.cuda.memory._record_memory_history(enabled=None)
        row.update(trained=all(math.isfinite(x) for x in m["losses"]), **{k: m[k] for k in (
            "step_s", "peak_gpu_gib", "model_tflops", "tokens_per_s", "host_bytes_per_param", "losses")},
            peak_vs_calc=m["peak_gpu_gib"] / row["calc_gpu_gib"],
            reserved_gpu_gib=torch.cuda.max_memory_reserved() / GIB)
    except (torch.OutOfMemoryError, InsufficientMemoryError) as e:
        row["error"] = f"{type(e).__name__}: {e}"[:400]
    finally:
        engine.close()
    return row


def peak_sites(snapshot: dict, top: int = 12) -> list[dict]:
    """What is live at the recorded history's peak allocation, by the line of mt-ray that allocated it
    (memory_profile's replay): where the calculator's device model and the device part ways."""
    _, peak, at_peak = replay(snapshot["device_traces"][0], 0)
    return [{"site": "peak", "gib": peak / GIB}] + [{"site": s, "gib": b / GIB} for s, b in at_peak.most_common(top)]


def run_in_child(argv: list[str], cap: float) -> dict:
    """`run_cap` in a fresh process (own CUDA context, allocator and host memory); its row."""
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF",
                                                                   "expandable_segments:True")}
    return row_in_child(__file__, [*argv, "--cap", str(cap)], {"cap_gib": cap, "trained": False}, CAP_TIMEOUT_S, env)


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen2.5-7b")
    p.add_argument("--caps", default="24,16,10", help="GPU memory caps in GiB, one process each")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up step")
    p.add_argument("--host-mem-gb", type=float, help="host memory to plan for (default: what is available)")
    p.add_argument("--dry-run", action="store_true", help="print the calculator's choice per cap; run nothing")
    p.add_argument("--profile", action="store_true",
                   help="record the allocator's history (slower steps) and add what is live at its peak, by site")
    p.add_argument("--cap", type=float, help=argparse.SUPPRESS)  # one cap, in a child process
    p.add_argument("--row-out", help=argparse.SUPPRESS)
    p.add_argument("--out", default="bench/results/consumer_caps_7b.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.cap is not None:
        Path(args.row_out).write_text(json.dumps(run_cap(args, args.cap), default=str))
        return []
    caps = [float(c) for c in args.caps.split(",")]
    if args.dry_run:
        rows = [choose(args, cap) for cap in caps]
        print_table(rows, DRY_COLUMNS)
        return rows
    rows = []
    for cap in caps:
        rows.append(run_in_child(argv, cap))
        print(f"cap {cap:g} GiB: {rows[-1]}", flush=True)
        write_json(args.out, {"args": vars(args), "device": torch.cuda.get_device_name(), "rows": rows})
    print_table(rows, [*COLUMNS, "peak_vs_calc", "micro_batch_size", "config"])
    return rows


if __name__ == "__main__":
    main()
