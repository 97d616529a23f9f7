"""When each unit's update starts and ends against when the next step's forward asks for it, over one step.

    python bench/optimizer_timeline.py --shape qwen3-30b-a3b --layers 12 --batch 128 --kernels liger \
        --stream-master --grad-dtype compute --variants 0,auto

For each `engine.device_optimizer_units` in `--variants` (one engine), after warm-up steps: every unit's update
(host or device) relative to the moment the optimizer thread learnt the step's norm (`norm_s`), the moment its
new version was handed over (`updated_s`), and how long the next step's weight streamer waited for it (`waited_s`);
with `--profile`, each device update kernel's GPU start and end on the same clock (torch profiler), so a slow
update shows whether its kernels ran late (behind the forward's) or its thread did.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import device_name, print_table, shape_config, write_json  # noqa: E402
from bench.engine_gpu import add_run_args, build_engine, micro_batches  # noqa: E402


class Timeline:
    """Wraps a worker's and a streamer's methods to stamp each hand-over with `time.perf_counter`."""

    def __init__(self, engine):
        self.engine = engine
        self.events: list[tuple[str, str, float, float]] = []  # (kind, unit, start, end)
        worker, streamer = engine.worker, engine.streamer
        self._restore = [(worker, "_advance", worker._advance), (worker, "_handle", worker._handle),
                         (streamer.versions, "wait_updated", streamer.versions.wait_updated)]
        advance, handle, wait = (m for _, _, m in self._restore)

        def stamped_advance(unit, *a):
            t = time.perf_counter()
            self.events.append(("updated", unit, t, t))
            return advance(unit, *a)

        def stamped_handle(item):
            t0 = time.perf_counter()
            out = handle(item)
            if type(item).__name__ == "_EndOfStep":
                self.events.append(("norm_handled", "", t0, time.perf_counter()))
            return out

        def stamped_wait(unit, version):
            t0 = time.perf_counter()
            out = wait(unit, version)
            self.events.append(("waited", unit, t0, time.perf_counter()))
            return out

        worker._advance, worker._handle, streamer.versions.wait_updated = stamped_advance, stamped_handle, stamped_wait

    def remove(self) -> None:
        for obj, name, fn in self._restore:
            setattr(obj, name, fn)


def one_variant(engine, args, cfg, units: str) -> list[dict]:
    engine.set_device_optimizer_units(units if units == "auto" else int(units))
    mbs = micro_batches(args, cfg)
    for _ in range(args.warmup):
        engine.train_step(mbs)
    engine.wait_for_updates()
    timeline = Timeline(engine)
    try:
        t_step = time.perf_counter()
        engine.train_step(mbs)  # its norm, then the updates the next step waits for
        engine.train_step(mbs)
        engine.wait_for_updates()
    finally:
        timeline.remove()
    norm = next(e for e in timeline.events if e[0] == "norm_handled" and e[2] > t_step)
    zero = norm[2]
    kept = set(engine.store.on_device.units) if engine.store.on_device is not None else set()
    rows = []
    for u in engine.worker.unit_order:
        updated = [e[2] for e in timeline.events if e[0] == "updated" and e[1] == u and e[2] >= zero]
        waits = [e for e in timeline.events if e[0] == "waited" and e[1] == u and e[2] >= zero]
        rows.append({"units": units, "unit": u, "where": "device" if u in kept else "host",
                     "updated_s": (updated[0] - zero) if updated else None,
                     "asked_s": (waits[0][2] - zero) if waits else None,
                     "waited_s": sum(e[3] - e[2] for e in waits)})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_args(p)
    p.add_argument("--variants", default="0,auto", help="engine.device_optimizer_units values, on one engine")
    p.add_argument("--out", default="bench/results/optimizer_timeline.json")
    args = p.parse_args()
    cfg = shape_config(args.shape, layers=args.layers)
    engine, _ = build_engine(args, cfg)
    rows: list[dict] = []
    try:
        engine.set_keep_activations(0)
        for units in args.variants.split(","):
            rows += one_variant(engine, args, cfg, units)
            write_json(args.out, {"args": vars(args), "device": device_name(), "rows": rows})
    finally:
        engine.close()
    print_table(rows, ["units", "unit", "where", "updated_s", "asked_s", "waited_s"])
    if torch.cuda.is_available():
        print(f"peak GPU {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


if __name__ == "__main__":
    main()
