"""The 7B shape on emulated consumer cards: GPU memory capped per process, the calculator's configuration.

For each cap the calculator (`mt-ray calc`'s `recommend`, given the cap and this host's available
memory) picks the configuration; the engine then runs it with `engine.gpu_memory_limit_gb` set to
the cap, which caps the caching allocator (`torch.cuda.set_per_process_memory_fraction`), so an
allocation past the cap fails as it would on that card. fp32 master weights and fp32 moments, as
always. Each cap runs in its own process: a fresh CUDA context and allocator, and the host state
freed before the next one builds its own.

    python bench/consumer_caps.py --caps 24,16,10 --seq 1024 --global-batch 64

Writes one row per cap: cap_gib, trained, peak_gpu_gib, calc_gpu_gib, step_s, model_tflops (and the
configuration chosen, the predicted step time and any error).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import OPT, Timer, print_table, random_micro_batches, shape_config, write_json  # noqa: E402
from mt_ray.engine import EngineConfig, StreamingEngine  # noqa: E402
from mt_ray.engine.calculator import SEARCHED, recommend  # noqa: E402
from mt_ray.engine.host_store import GIB, available_host_bytes  # noqa: E402
from mt_ray.models.discovery import discover  # noqa: E402

COLUMNS = ["cap_gib", "trained", "peak_gpu_gib", "calc_gpu_gib", "step_s", "model_tflops"]


def run_cap(args) -> dict:
    """One cap: the calculator's choice, a warm-up step, then timed steps under the cap."""
    cfg = shape_config(args.shape)
    spec = discover(cfg)
    rec = recommend(spec, args.seq, args.global_batch, args.cap, available_host_bytes() / GIB, opt=OPT)
    row: dict = {"cap_gib": args.cap, "trained": False, "calc_gpu_gib": rec.get("device_gib"),
                 "predicted_step_s": rec.get("predicted_step_s"), "config": {k: rec.get(k) for k in SEARCHED},
                 "micro_batch_size": rec.get("micro_batch_size")}
    if not rec["fits"]:
        return {**row, "error": f"calculator: {rec['reason']}"}
    knobs = {k: rec[k] for k in SEARCHED}
    ecfg = EngineConfig(device="cuda", compute_dtype="bf16", gpu_memory_limit_gb=args.cap, **knobs)
    engine = StreamingEngine(spec, ecfg, OPT, total_steps=args.steps + 2)
    try:
        engine.load_random(seed=0)
        mbs = random_micro_batches(cfg.vocab_size, args.global_batch, rec["micro_batch_size"], args.seq)
        engine.train_step(mbs)  # warm-up: the host slab is allocated and pinned here
        engine.synchronize()
        torch.cuda.reset_peak_memory_stats()
        with Timer() as t:
            losses = [engine.train_step(mbs).loss for _ in range(args.steps)]
        engine.synchronize()
        step_s = t.seconds / args.steps
        tokens = args.global_batch * args.seq
        row.update(trained=all(torch.isfinite(x).item() for x in losses), step_s=step_s,
                   peak_gpu_gib=torch.cuda.max_memory_allocated() / GIB,
                   model_tflops=6 * spec.num_params * tokens / step_s / 1e12, losses=[float(x) for x in losses])
    except torch.OutOfMemoryError as e:
        row["error"] = f"out of GPU memory: {e}"[:300]
    finally:
        engine.close()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen2.5-7b")
    p.add_argument("--caps", default="24,16,10", help="GPU memory caps in GiB, one process each")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up step")
    p.add_argument("--cap", type=float, help=argparse.SUPPRESS)  # one cap, in a child process
    p.add_argument("--row-out", help=argparse.SUPPRESS)
    p.add_argument("--out", default="bench/results/consumer_caps_7b.json")
    args = p.parse_args()
    if args.cap is not None:
        Path(args.row_out).write_text(json.dumps(run_cap(args), default=str))
        return

    rows = []
    for cap in map(float, args.caps.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "row.json"
            child = [sys.executable, __file__, "--cap", str(cap), "--row-out", str(out), "--shape", args.shape,
                     "--seq", str(args.seq), "--global-batch", str(args.global_batch), "--steps", str(args.steps)]
            done = subprocess.run(child, check=False)
            row = json.loads(out.read_text()) if out.exists() else {
                "cap_gib": cap, "trained": False, "error": f"the run's process exited with {done.returncode}"}
        rows.append(row)
        print(f"cap {cap:g} GiB: {row}", flush=True)
        write_json(args.out, {"args": vars(args), "device": torch.cuda.get_device_name(), "rows": rows})
    print_table(rows, COLUMNS)


if __name__ == "__main__":
    main()
