"""The longest context that trains on this GPU: a sweep of sequence length at fixed tokens per step.

One engine (one host store) runs a warm-up and a timed step at each length, shortest first,
with the global batch shrunk so every step holds the same number of tokens; the first length
that runs out of GPU memory ends the sweep (the engine is not reused after a failed step).

    python bench/long_context.py --shape qwen2.5-7b --seqs 1024,4096,8192,16384,32768,65536
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import Timer, cuda_engine, metrics, print_table, random_micro_batches, write_json  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen2.5-7b")
    p.add_argument("--seqs", default="1024,4096,8192,16384,32768,65536")
    p.add_argument("--tokens", type=int, default=131072, help="tokens per step (global batch x seq)")
    p.add_argument("--micro-tokens", type=int, default=16384, help="tokens per micro-batch (at least one row)")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--out", default="bench/results/long_context.json")
    args = p.parse_args()

    cfg, spec, engine = cuda_engine(args.shape, args.k, total_steps=64)
    rows = []
    try:
        for seq in map(int, args.seqs.split(",")):
            run = argparse.Namespace(shape=args.shape, seq=seq, batch=max(1, args.tokens // seq),
                                     micro=max(1, args.micro_tokens // seq))
            mbs = random_micro_batches(cfg.vocab_size, run.batch, run.micro, seq)
            try:
                engine.train_step(mbs)
                engine.synchronize()
                torch.cuda.reset_peak_memory_stats()
                with Timer() as t:
                    loss = engine.train_step(mbs).loss
                engine.synchronize()
            except torch.OutOfMemoryError as e:
                rows.append({"system": "mt-ray", "seq": seq, "batch": run.batch, "status": f"out of GPU memory: {e}"[:120]})
                break
            row = metrics(run, cfg, spec.num_params, t.seconds, "mt-ray")
            row.update(status="ok", loss=float(loss), peak_gpu_gib=torch.cuda.max_memory_allocated() / 2**30)
            rows.append(row)
            print(f"seq {seq}: {row['model_tflops']:.0f} TFLOPS, {row['peak_gpu_gib']:.1f} GiB", flush=True)
            write_json(args.out, {"args": vars(args), "device": torch.cuda.get_device_name(), "rows": rows})
    finally:
        engine.close()
    print_table(rows, ["seq", "batch", "micro", "step_s", "tokens_per_s", "model_tflops", "tflops_with_attn",
                       "peak_gpu_gib", "status"])
    write_json(args.out, {"args": vars(args), "device": torch.cuda.get_device_name(), "rows": rows})


if __name__ == "__main__":
    main()
