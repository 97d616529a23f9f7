"""The longest context that trains on this GPU: one sequence a step, at each length, on one engine.

One engine (one host store) takes a step at each length, shortest first: a warm-up step at the
first length, then one timed step each (the longer steps are tens of seconds to minutes, so a
first step's allocator growth is noise). A length that runs out of GPU memory ends the sweep (a
step that failed midway leaves the engine unusable); it and the lengths after it are rows with
`trained: false`. The engine options that reach long contexts are flags (K, the norms and MLP in
sequence chunks) and `--engine key=value` sets any other EngineConfig field. Each row: seq,
trained, model TFLOPS (6·N·T / step), TFLOPS counting causal attention, peak GPU GiB beside the
calculator's device model for this configuration (`calc_gpu_gib`) and step time (`calc_step_s`),
host bytes per parameter (peak RSS); the file is rewritten after every row. Before the engine is
built, the calculator's longest context for this GPU and host (`mt-ray calc --max-seq`) is recorded.

    python bench/long_context.py --seqs 32768,65536,131072,262144 --k 2 --mlp-chunk 16384 --kernels liger \\
        --out bench/results/long_context_7b.json
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
from mt_ray.engine.calculator import longest_context  # noqa: E402
from mt_ray.engine.host_store import available_host_bytes  # noqa: E402
from mt_ray.engine.sizing import GIB, device_bytes  # noqa: E402
from mt_ray.engine.step_time import predicted_step_seconds  # noqa: E402
from mt_ray.models.discovery import discover  # noqa: E402


def engine_config(args) -> EngineConfig:
    """The memory-lean streaming setting (fp32 master streamed, bf16 gradients) plus the run's options."""
    fields = {"device": "cuda", "compute_dtype": "bf16", "checkpoint_every": args.k, "stream_master": True,
              "grad_dtype": "compute", "kernels": args.kernels, "attn_implementation": args.attn,
              "mlp_chunk_tokens": args.mlp_chunk}
    for item in args.engine:
        key, _, value = item.partition("=")
        fields[key] = value
    return EngineConfig(**fields)


def sweep(engine: StreamingEngine, cfg, seqs: list[int], args, rows: list[dict], save) -> None:
    """Appends a row per length to `rows`, calling `save` after each; after an out-of-memory step the
    rest are not tried."""
    failed = None
    for i, seq in enumerate(seqs):
        if rows:
            save()
        run = argparse.Namespace(shape=args.shape, seq=seq, batch=1, micro=1)
        if failed:
            rows.append({"seq": seq, "trained": False, "error": f"not tried: {failed} ran out of GPU memory"})
            continue
        mbs = random_micro_batches(cfg.vocab_size, 1, 1, seq, seed=i)
        try:
            if i == 0:
                engine.train_step(mbs)  # warm-up: kernels chosen, allocator grown
            engine.synchronize()
            torch.cuda.reset_peak_memory_stats()
            with Timer() as t:
                loss = engine.train_step(mbs).loss
            engine.synchronize()
        except torch.OutOfMemoryError as e:
            failed = seq
            rows.append({"seq": seq, "trained": False, "error": f"out of GPU memory: {e}"[:200],
                         "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30})
            continue
        row = metrics(run, cfg, engine.spec.num_params, t.seconds, "mt-ray")
        row.update(trained=True, loss=float(loss), peak_gpu_gib=torch.cuda.max_memory_allocated() / 2**30,
                   calc_gpu_gib=device_bytes(engine.spec, engine.cfg, 1, seq, 1)["total"] / GIB,
                   calc_step_s=predicted_step_seconds(engine.spec, engine.cfg, seq, 1),
                   host_bytes_per_param=peak_rss_bytes() / engine.spec.num_params)
        rows.append(row)
        print(f"seq {seq}: {row['step_s']:.1f} s, {row['model_tflops']:.0f} TFLOPS ({row['tflops_with_attn']:.0f} "
              f"with attention), {row['peak_gpu_gib']:.1f} GiB", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen2.5-7b")
    p.add_argument("--seqs", default="32768,65536,131072,262144")
    p.add_argument("--k", type=int, default=2, help="checkpoint every K layers")
    p.add_argument("--mlp-chunk", type=int, default=16384, help="engine.mlp_chunk_tokens (0: whole sequences)")
    p.add_argument("--kernels", default="torch", choices=["torch", "liger"])
    p.add_argument("--attn", default="auto", help="engine.attn_implementation")
    p.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE", help="any other EngineConfig field")
    p.add_argument("--out", default="bench/results/long_context.json")
    args = p.parse_args()
    args.mlp_chunk = args.mlp_chunk or None

    cfg = shape_config(args.shape)
    seqs = sorted(map(int, args.seqs.split(",")))
    spec, ecfg = discover(cfg), engine_config(args)
    gpu_gib = torch.cuda.get_device_properties(0).total_memory / GIB
    calc = longest_context(spec, gpu_gib, available_host_bytes() / GIB, cfg=ecfg, opt=OPT)
    print(f"calculator: longest context {calc.get('seq')} on {gpu_gib:.0f} GiB ({calc.get('longer_reason')})", flush=True)
    t0 = time.perf_counter()
    engine = StreamingEngine(spec, ecfg, OPT, total_steps=len(seqs) + 1)
    engine.load_random(seed=0)
    setup_s = time.perf_counter() - t0
    rows: list[dict] = []

    def save() -> None:
        write_json(args.out, {"args": vars(args), "device": torch.cuda.get_device_name(), "setup_s": setup_s,
                              "calc_longest_context": calc, "rows": rows})

    try:
        sweep(engine, cfg, seqs, args, rows, save)
    finally:
        engine.close()
        save()
    print_table(rows, ["seq", "trained", "step_s", "calc_step_s", "model_tflops", "tflops_with_attn", "peak_gpu_gib",
                       "calc_gpu_gib", "host_bytes_per_param", "error"])


if __name__ == "__main__":
    main()
