"""DPO beside SFT on one GPU, same shape and batch: step time, tokens/s, model TFLOPS, peak GPU memory, host B/param.

The DPO row trains the policy in fp32 master weights and moments (as the SFT row) with the reference, the
frozen starting weights, held in host memory in bf16 (2 B/param more) and streamed forward beside the policy
(`pref.reference: stream`). Its model TFLOPS count the reference's forward: 8 x params x tokens a step (6 for
the policy's forward and backward, 2 for the reference's), against the SFT row's 6; `model_tflops_6nt` is
both rows on the SFT formula. Rows are packed as the data loader packs them: a DPO row is one pair (chosen and
rejected, half a row each: a quarter prompt, a quarter response), an SFT row two documents of half a row, so
attention spans the same tokens.

Each row runs in a process of its own, one after the other, so that the first row's host memory (about
100 GiB at 7B) is returned before the second allocates its own:

    python bench/dpo_gpu.py --kernels liger --stream-master --grad-dtype compute --out bench/results/dpo_7b.json

A CPU smoke run of the script: `--device cpu --shape tiny --batch 4 --micro 2 --seq 64 --steps 1`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    device_name,
    packed_micro_batches,
    pair_micro_batches,
    print_table,
    row_in_child,
    shape_config,
    write_json,
)
from bench.engine_gpu import add_run_args, build_engine, measure  # noqa: E402
from mt_ray.engine.preference import PreferenceConfig  # noqa: E402
from mt_ray.engine.sizing import Stage  # noqa: E402
from mt_ray.engine.step_time import attention_flops  # noqa: E402

STAGES = ("sft", "dpo")


def run_row(args) -> dict:
    """One row in this process: an engine of `args.row`'s stage, its warm-up and timed steps."""
    cfg = shape_config(args.shape)
    pref = PreferenceConfig(loss=args.loss, reference="stream") if args.row == "dpo" else None
    args.packed_docs = args.seq // 2  # attention spans half a row in both rows (metrics' tflops_with_attn)
    if args.row == "dpo":
        mbs = pair_micro_batches(cfg.vocab_size, args.batch, args.micro, args.seq)
    else:
        mbs = packed_micro_batches(cfg.vocab_size, args.batch, args.micro, args.seq, args.packed_docs)
    engine, setup_s = build_engine(args, cfg, args.row, pref)
    try:
        row = measure(engine, args, cfg, profile=args.profile, mbs=mbs, stage=Stage.of(args.row, pref))
    finally:
        engine.close()
    return {**row, **reference_flops(row, cfg, args), "stage": args.row, "setup_s": setup_s}


def reference_flops(row: dict, cfg, args) -> dict:
    """The row's model TFLOPS counting the reference's forward (2 x params x tokens, and its attention forward)."""
    if args.row != "dpo":
        return {"model_tflops_6nt": row["model_tflops"]}
    tokens = args.batch * args.seq
    ref_flops = 2 * row["params_b"] * 1e9 * tokens
    ref_attn = attention_flops(cfg, tokens, args.packed_docs) / 3  # forward only: a third of forward and backward
    return {"model_tflops_6nt": row["model_tflops"],
            "model_tflops": row["model_tflops"] + ref_flops / row["step_s"] / 1e12,
            "tflops_with_attn": row["tflops_with_attn"] + (ref_flops + ref_attn) / row["step_s"] / 1e12}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(p)
    p.add_argument("--loss", default="sigmoid", help="pref.loss of the DPO row")
    p.add_argument("--row", choices=STAGES, help=argparse.SUPPRESS)  # one row, in a child process
    p.add_argument("--row-out", help=argparse.SUPPRESS)
    p.add_argument("--out", default="bench/results/dpo_gpu.json")
    args = p.parse_args()
    if args.row:
        Path(args.row_out).write_text(json.dumps(run_row(args), default=str))
        return
    rows = []
    for stage in STAGES:
        # Each row in a fresh process: its host memory is returned before the next builds its own.
        rows.append(row_in_child(__file__, [*sys.argv[1:], "--row", stage], {"system": "mt-ray", "stage": stage}))
        write_json(args.out, {"args": vars(args), "device": device_name(), "rows": rows})  # as each finishes
    cols = ["stage", "shape", "params_b", "batch", "seq", "step_s", "tokens_per_s", "model_tflops", "model_tflops_6nt",
            "tflops_with_attn", "peak_gpu_gib", "calc_gpu_gib", "host_bytes_per_param", "optimizer_s", "calc_step_s",
            "setup_s", "error"]
    print_table(rows, cols)


if __name__ == "__main__":
    main()
