"""What holds GPU memory at the peak of one engine step: the data behind the calculator's model.

Records the CUDA caching allocator's history over one steady-state step, replays the trace to
the moment of peak allocation and groups the live blocks by the line of mt-ray (or
transformers/torch, when no mt-ray frame is on the stack) that allocated them.

    python bench/memory_profile.py --shape qwen2.5-7b --batch 128 --micro 16 --out mem.json
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import cuda_engine, print_table, random_micro_batches, write_json  # noqa: E402
from mt_ray.engine.sizing import device_bytes  # noqa: E402


def site(frames: list[dict]) -> str:
    """The most telling frame of an allocation: the first in mt_ray, else the first in transformers."""
    for marker in ("mt_ray/", "transformers/", "torch/"):
        for f in frames:
            if marker in f["filename"]:
                return f"{f['filename'].split(marker)[-1]}:{f['line']} {f['name']}"
    return "?"


def replay(trace: list[dict], start: int) -> tuple[Counter, int, Counter]:
    """Replay alloc/free events: live bytes by site at event `start`, then the peak after it and
    the live bytes by site at that peak."""
    live: dict[int, dict] = {}
    held = peak = peak_idx = total = 0
    for i, ev in enumerate(trace):
        if i == start:
            held = total
            held_by_site = _by_site(live.values())
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
            total += ev["size"]
            if i >= start and total > peak:
                peak, peak_idx = total, i
        elif ev["action"] == "free_completed" and ev["addr"] in live:
            total -= live.pop(ev["addr"])["size"]
    live = {}
    for ev in trace[: peak_idx + 1]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
        elif ev["action"] == "free_completed":
            live.pop(ev["addr"], None)
    assert held >= 0
    return held_by_site, peak, _by_site(live.values())


def _by_site(events) -> Counter:
    out: Counter = Counter()
    for ev in events:
        out[site(ev.get("frames", []))] += ev["size"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen2.5-7b")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--micro", type=int, default=16)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", default="bench/results/memory_profile.json")
    args = p.parse_args()

    cfg, spec, engine = cuda_engine(args.shape, args.k, total_steps=4)
    stages = {"after_setup_gib": torch.cuda.memory_allocated() / 2**30}
    try:
        mbs = random_micro_batches(cfg.vocab_size, args.batch, args.micro, args.seq)
        # Recording starts before the first step, so what stays allocated between steps is seen too.
        torch.cuda.memory._record_memory_history(max_entries=4_000_000, stacks="python")
        engine.train_step(mbs)
        engine.synchronize()
        torch.cuda.synchronize()
        stages["after_first_step_gib"] = torch.cuda.memory_allocated() / 2**30
        between = len(torch.cuda.memory._snapshot()["device_traces"][0])
        torch.cuda.reset_peak_memory_stats()
        engine.train_step(mbs)
        engine.synchronize()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        measured = torch.cuda.max_memory_allocated()
    finally:
        engine.close()
    held, peak, at_peak = replay(snap["device_traces"][0], between)
    tables = {name: [{"site": s, "gib": b / 2**30} for s, b in c.most_common(args.top)]
              for name, c in (("between_steps", held), ("at_peak", at_peak))}
    stages.update(replayed_peak_gib=peak / 2**30, measured_peak_gib=measured / 2**30)
    print(", ".join(f"{k} {v:.2f}" for k, v in stages.items()))
    for name, rows in tables.items():
        print(name)
        print_table(rows, ["site", "gib"])
    predicted = device_bytes(spec, engine.cfg, args.micro, args.seq, args.batch)
    write_json(args.out, {"args": vars(args), **stages, **tables,
                          "calc_gib": {k: v / 2**30 for k, v in predicted.items()}})


if __name__ == "__main__":
    main()
