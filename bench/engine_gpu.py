"""Benchmark of the streaming engine on one GPU: throughput, memory and where the step time goes.

Reports model TFLOPS as 6 x params x tokens / step time with the optimizer inside the step
(MegaTrain's formula), the attention-inclusive figure, host bytes/param (peak RSS), peak GPU
memory, and the time split of one profiled step (H2D, compute, D2H busy time from CUPTI; the
optimizer thread's CPU time; GPU idle = step time minus compute-stream busy time).

    python bench/engine_gpu.py --shape qwen2.5-7b --batch 128 --micro 16 --out results.json

Packed rows (`--packed-docs N`: documents of N tokens packed as the data loader packs them) against
unpacked ones, on each attention backend, on one engine (one host store) in one call:

    python bench/engine_gpu.py --seq 1024 --runs 0:sdpa,256:sdpa,256:varlen,256:flex_attention \
        --out bench/results/packed_7b.json

Full recompute against kept activations (`engine.keep_activations`), one row each, on one engine:

    python bench/engine_gpu.py --kernels liger --keep-activations 0,auto --out bench/results/keep_activations_7b.json

A mixture of experts' rows add active TFLOPS (6 x active params x tokens / step) beside model TFLOPS, and with
`--module-times` the seconds a step its routed experts, routers and attention take, forward and backward (one
extra step with hooks, `bench/module_times.py`). The MoE suite (issue 38): the 12-layer Qwen3-30B-A3B cut at
128 x 1024 and 512 x 1024 on one engine, then the dense 7B row, into one file:

    python bench/engine_gpu.py --suite moe --kernels liger --stream-master --grad-dtype compute --module-times \
        --out bench/results/moe_qwen3_30b_a3b_12l.json

Side-by-side runs against DeepSpeed, FSDP2 and plain PyTorch are `bench/compare.py`.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    OPT,
    Timer,
    device_name,
    metrics,
    packed_micro_batches,
    peak_rss_bytes,
    print_table,
    random_micro_batches,
    shape_config,
    write_json,
)
from bench.module_times import ModuleTimes  # noqa: E402
from mt_ray.engine import EngineConfig, StreamingEngine  # noqa: E402
from mt_ray.engine.optimizer import UnitOptimizer  # noqa: E402
from mt_ray.engine.preference import PreferenceConfig  # noqa: E402
from mt_ray.engine.sizing import SFT, Stage, device_bytes  # noqa: E402
from mt_ray.engine.step_time import predicted_step_seconds  # noqa: E402
from mt_ray.errors import InsufficientMemoryError  # noqa: E402
from mt_ray.models.discovery import discover  # noqa: E402
from mt_ray.models.grouped_experts import IMPLEMENTATION, experts_banks  # noqa: E402


def build_engine(args, cfg, stage: str = "sft", pref: PreferenceConfig | None = None) -> tuple[StreamingEngine, float]:
    """A randomly initialised engine on the GPU (`--device`) with the run's options and training `stage`; (engine,
    set-up seconds)."""
    spec = discover(cfg)
    ecfg = EngineConfig(device=args.device, compute_dtype="bf16", schedule=args.schedule, checkpoint_every=args.k,
                        stream_master=args.stream_master, grad_dtype=args.grad_dtype, loss_chunk_tokens=args.loss_chunk,
                        kernels=args.kernels, attn_implementation=args.attn)
    opt = OPT.model_copy(update={"max_grad_norm": args.clip})
    t0 = time.perf_counter()
    engine = StreamingEngine(spec, ecfg, opt, total_steps=(args.warmup + args.steps) * 16 + 4, stage=stage, pref=pref)
    engine.load_random(seed=0)
    return engine, time.perf_counter() - t0


def micro_batches(args, cfg) -> list[dict]:
    if args.packed_docs:
        return packed_micro_batches(cfg.vocab_size, args.batch, args.micro, args.seq, args.packed_docs)
    return random_micro_batches(cfg.vocab_size, args.batch, args.micro, args.seq)


def measure(engine: StreamingEngine, args, cfg, profile: bool = False, mbs: list[dict] | None = None,
            stage: Stage = SFT) -> dict:
    """Warm-up and timed steps of `engine` on `mbs` (default: the run's SFT batches); one result row, with the
    calculator's figures for `stage`."""
    spec, ecfg = engine.spec, engine.cfg
    mbs = mbs or micro_batches(args, cfg)
    cuda = engine.device.type == "cuda"
    losses = []
    for _ in range(args.warmup):
        losses.append(engine.train_step(mbs).loss)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    busy0, wait0, dev0 = engine.worker.busy_seconds, engine.streamer.optimizer_wait_s, engine.worker.device_seconds
    # Steady state: the clock starts while the optimizer still finishes the warm-up step
    # (which the first timed step must wait for) and stops when the last step's GPU work
    # ends (its own optimizer tail would overlap the next step): one boundary per step.
    with Timer() as t:
        for _ in range(args.steps):
            losses.append(engine.train_step(mbs).loss)
    engine.wait_for_updates()  # not `synchronize`: the state kept on the device need not come home
    step_s = t.seconds / args.steps
    opt_s = (engine.worker.busy_seconds - busy0) / args.steps
    device_opt_s = (engine.worker.device_seconds - dev0) / args.steps
    kept_units = list(engine.store.on_device.units) if engine.store.on_device is not None else []
    # The engine's thread blocked on the previous step's optimizer: the update the next step could not hide.
    opt_wait_s = (engine.streamer.optimizer_wait_s - wait0) / args.steps
    peak_gpu = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    split = profile_steps(engine, mbs) if profile else {}
    if getattr(args, "module_times", False):
        split.update(module_seconds(engine, mbs))
    row = metrics(args, cfg, spec.num_params, step_s, "mt-ray")
    if spec.routed_active_params:  # a mixture of experts: what its tokens compute with
        tokens = args.batch * args.seq
        # Megatron's and NeMo's convention leaves out the input embedding, a lookup with no matrix product.
        nonembed = spec.active_text_params - (0 if spec.config.tie_word_embeddings else spec.unit("embed").numel)
        row.update(active_params_b=spec.active_text_params / 1e9,
                   active_tflops=6 * spec.active_text_params * tokens / step_s / 1e12,
                   active_tflops_nonembed=6 * nonembed * tokens / step_s / 1e12)
    kept = engine.kept.last_count  # `auto` as resolved, for the calculator's figures
    stage = replace(stage, device_state_bytes=engine.kept.stage.device_state_bytes)  # the units kept on the GPU
    ecfg = ecfg.model_copy(update={"keep_activations": kept})
    predicted = device_bytes(spec, ecfg, args.micro, args.seq, args.batch, stage=stage)["total"] / 2**30
    row.update(split, keep_activations=engine.cfg.keep_activations, kept_graphs=kept, variant=getattr(args, "variant", None),
               optimizer_s=opt_s, optimizer_wait_s=opt_wait_s, losses=[float(x) for x in losses],
               device_optimizer_units=len(kept_units), device_optimizer_s=device_opt_s,
               device_params_b=sum(spec.unit(u).numel for u in kept_units) / 1e9,
               packed_docs=args.packed_docs,
               attn=args.attn, attn_used=spec.config._attn_implementation,
               host_bytes_per_param=peak_rss_bytes() / spec.num_params, peak_gpu_gib=peak_gpu,
               calc_gpu_gib=predicted, calc_step_s=predicted_step_seconds(spec, ecfg, args.seq, args.batch, stage=stage,
                                                                          micro_batch=args.micro, opt=engine.opt_cfg))
    return row


def module_seconds(engine: StreamingEngine, mbs: list[dict]) -> dict:
    """One more step with hooks on the layers' experts, routers and attention: each one's seconds, forward (with the
    recompute) and backward."""
    times = ModuleTimes(engine)
    try:
        times.active = True
        engine.train_step(mbs)
        engine.wait_for_updates()
        times.active = False
        return times.seconds(1)
    finally:
        times.remove()


def use_variant(engine: StreamingEngine, variant: str) -> None:
    """Switch `engine` between steps to `variant`, EXPERTS:OPTIMIZER[:DEVICE_UNITS]: the routed experts' code
    (`grouped`, mt-ray's, or `transformers`, its grouped_mm), the host AdamW (`optimizer.impl`: numba or torch) and,
    if given, `engine.device_optimizer_units` (auto or a number), so the suite compares them on one host store.
    Waits for the previous step's updates first."""
    experts, impl, *units = variant.split(":")
    for bank in experts_banks(engine.spec.skeleton).values():
        bank.config._experts_implementation = IMPLEMENTATION if experts == "grouped" else "grouped_mm"
    if units and units[0] != str(engine.cfg.device_optimizer_units):
        engine.set_device_optimizer_units(units[0] if units[0] == "auto" else int(units[0]))
    engine.wait_for_updates()  # the optimizers are idle until the next step
    if impl != engine.opt_cfg.impl:
        engine.opt_cfg = engine.opt_cfg.model_copy(update={"impl": impl})
        for name, old in list(engine.optimizers.items()):  # the worker reads this same dict
            new = UnitOptimizer(engine.store, engine.spec.unit(name), engine.opt_cfg)
            new.set_step(old.step_count(), old.span_lags())
            engine.optimizers[name] = new


def run_moe_suite(args) -> list[dict]:
    """The MoE shape (`--moe-shape` cut to `--moe-layers`) at each `--moe-batches` on one engine, then the dense
    `--dense-shape` at `--batch`, each engine closed before the next is built (one host holds one), each batch in
    every `--variants` entry; rows written to `--out` as they finish."""
    rows: list[dict] = []
    plan = [(args.moe_shape, args.moe_layers, [int(b) for b in args.moe_batches.split(",")])]
    plan += [(args.dense_shape, None, [args.batch])] if args.dense_shape else []
    for shape, layers, batches in plan:
        cfg = shape_config(shape, layers=layers)
        run = argparse.Namespace(**{**vars(args), "shape": shape, "layers": layers})
        engine, setup_s = build_engine(run, cfg)
        keep = str(args.keep_activations)  # one value here: 0 (full recompute, as issue 38's rows ran), or auto
        engine.set_keep_activations(keep if keep == "auto" else int(keep))
        variants = args.variants.split(",")
        if layers is None:  # a dense model has no experts: its rows differ in the optimizer alone
            variants = list(dict.fromkeys(":".join(["grouped", *v.split(":")[1:]]) for v in variants))
        try:
            for batch in batches:
                run.batch = batch
                for variant in variants:
                    run.variant = variant
                    use_variant(engine, variant)
                    try:
                        rows.append({**measure(engine, run, cfg, profile=args.profile), "setup_s": setup_s})
                    except (torch.OutOfMemoryError, InsufficientMemoryError) as e:
                        rows.append({"system": "mt-ray", "shape": shape, "batch": batch, "variant": variant,
                                     "status": f"out of GPU memory: {e}"[:300]})
                    write_json(args.out, {"args": vars(args), "device": device_name(), "rows": rows})
                    print(f"{shape} {batch} {variant}: {rows[-1].get('step_s', 0):.2f} s", flush=True)
        finally:
            engine.close()
            # The next shape's store needs this one's memory back (one host holds one): drop the engine now, not
            # when `build_engine` returns the next.
            del engine
            gc.collect()
    return rows


def run_engine(args, cfg) -> dict:
    """One engine, one measured run (the side-by-side comparison's mt-ray row)."""
    return run_keeps(args, cfg, None)[0]


def run_keeps(args, cfg, out: str | None) -> list[dict]:
    """A row per `--keep-activations` entry (0: full recompute, auto, or a number) on one engine, written
    to `out` as they finish; a step out of GPU memory ends the list with its error."""
    engine, setup_s = build_engine(args, cfg)
    rows = []
    try:
        for keep in str(args.keep_activations).split(","):
            engine.set_keep_activations(keep if keep == "auto" else int(keep))
            try:
                rows.append({**measure(engine, args, cfg, profile=args.profile), "setup_s": setup_s})
            except (torch.OutOfMemoryError, InsufficientMemoryError) as e:  # the engine is unusable after: stop
                rows.append({"system": "mt-ray", "keep_activations": keep, "status": f"out of GPU memory: {e}"[:300]})
                break
            finally:
                if out:
                    write_json(out, {"args": vars(args), "device": device_name(), "rows": rows})
    finally:
        engine.close()
    return rows


def run_variants(args, cfg, out: str) -> list[dict]:
    """Each `--runs` entry (packed-docs:attention) on one engine, rows written as they finish."""
    engine, setup_s = build_engine(args, cfg)
    rows = []
    try:
        for entry in args.runs.split(","):
            docs, attn = entry.split(":")
            run = argparse.Namespace(**{**vars(args), "packed_docs": int(docs), "attn": attn})
            engine.set_attention(attn)
            try:
                rows.append({**measure(engine, run, cfg), "setup_s": setup_s})
            except torch.OutOfMemoryError as e:  # a step that failed midway leaves the engine unusable: stop
                rows.append({"system": "mt-ray", "seq": args.seq, "packed_docs": run.packed_docs, "attn": attn,
                             "status": f"out of GPU memory: {e}"[:160]})
                break
            finally:
                write_json(out, {"args": vars(args), "device": device_name(), "rows": rows})
            print(f"{entry} ({rows[-1]['attn_used']}): {rows[-1]['model_tflops']:.0f} TFLOPS, "
                  f"{rows[-1]['peak_gpu_gib']:.1f} GiB", flush=True)
    finally:
        engine.close()
    return rows


def profile_steps(engine: StreamingEngine, mbs, n: int = 3) -> dict:
    """Per-step busy time of each engine (compute, H2D, D2H) over `n` back-to-back steps.

    A marker kernel (`torch.cuda._sleep`) is queued before each step; the span between two
    markers is one steady-state step on the GPU timeline, boundary wait included.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            torch.cuda._sleep(1000)
            engine.train_step(mbs)
        torch.cuda._sleep(1000)
        torch.cuda.synchronize()
    markers, kernels, h2d, d2h = [], [], [], []
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        span = (ev.time_range.start, ev.time_range.end)
        name = ev.name.lower()
        if "spin" in name:
            markers.append(span[0])
        elif "memcpy" in name and "htod" in name:
            h2d.append(span)
        elif "memcpy" in name and "dtoh" in name:
            d2h.append(span)
        elif "memcpy" not in name and "memset" not in name:
            kernels.append(span)
    markers.sort()
    window = (markers[1], markers[-1])  # skip the first step: it starts from a synchronised engine
    steps = len(markers) - 2
    step_us = (window[1] - window[0]) / steps
    busy = {k: _union(_clip(v, window)) / steps / 1e6 for k, v in (("compute", kernels), ("h2d", h2d), ("d2h", d2h))}
    return {
        "gpu_step_s": step_us / 1e6, "h2d_busy_s": busy["h2d"], "compute_busy_s": busy["compute"],
        "d2h_busy_s": busy["d2h"], "gpu_idle_frac": max(0.0, 1 - busy["compute"] * 1e6 / step_us),
    }


def _clip(spans, window):
    lo, hi = window
    return [(max(s, lo), min(e, hi)) for s, e in spans if e > lo and s < hi]


def _union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def add_run_args(p: argparse.ArgumentParser) -> None:
    """Model shape, batch and engine options, shared with the side-by-side comparison."""
    p.add_argument("--shape", default="qwen2.5-7b")
    p.add_argument("--layers", type=int, help="cut the shape to its first N layers (a large MoE on a smaller host)")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--micro", type=int, default=16)
    p.add_argument("--schedule", default="stream", choices=["stream", "resident"], help="engine schedule")
    p.add_argument("--k", type=int, default=4, help="checkpoint every K layers")
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--stream-master", action="store_true")
    p.add_argument("--grad-dtype", default="fp32", choices=["fp32", "compute"])
    p.add_argument("--loss-chunk", type=int, default=4096)
    p.add_argument("--kernels", default="torch", choices=["torch", "liger"], help="fused Liger kernels (mt-ray and every peer)")
    p.add_argument("--attn", default="auto", help="engine.attn_implementation (auto, varlen, sdpa, flex_attention, ...)")
    p.add_argument("--packed-docs", type=int, default=0,
                   help="pack rows with documents of this many tokens, as the data loader does (0: unpacked rows)")
    p.add_argument("--keep-activations", default="0",
                   help="engine.keep_activations: 0 (full recompute), auto, a number of block graphs, or a comma "
                   "list of them measured on one engine, a row each (e.g. 0,auto)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="profile one extra step for the time split")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (a tiny --shape)")
    p.add_argument("--module-times", action="store_true", help="one more step timing the layers' routed experts, "
                   "routers and attention, forward and backward (a mixture of experts' time split)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(p)
    p.add_argument("--runs", help="comma list of PACKED_DOCS:ATTN variants to measure on one engine, e.g. "
                   "0:sdpa,256:sdpa,256:varlen (replaces --packed-docs and --attn)")
    p.add_argument("--out", default="bench/results/engine_gpu.json")
    p.add_argument("--suite", choices=["moe"], help="moe: --moe-shape at each --moe-batches, then --dense-shape")
    p.add_argument("--moe-shape", default="qwen3-30b-a3b")
    p.add_argument("--moe-layers", type=int, default=12, help="the MoE shape's layers in the suite (12: 8.1 B "
                   "parameters, what a 128 GiB host holds)")
    p.add_argument("--moe-batches", default="128,512", help="the suite's MoE global batches, comma-separated")
    p.add_argument("--dense-shape", default="qwen2.5-7b", help="the suite's dense row, at --batch ('': none)")
    p.add_argument("--variants", default="grouped:numba", help="the suite's comma list of EXPERTS:OPTIMIZER to "
                   "measure each batch with on one engine: experts grouped (mt-ray's) or transformers (its "
                   "grouped_mm), optimizer.impl numba or torch, and optionally engine.device_optimizer_units; e.g. "
                   "grouped:numba:0,grouped:numba:auto,transformers:torch")
    args = p.parse_args()

    if args.suite:
        rows = run_moe_suite(args)
    else:
        cfg = shape_config(args.shape, layers=args.layers)
        rows = run_variants(args, cfg, args.out) if args.runs else run_keeps(args, cfg, args.out)
    cols = ["system", "shape", "variant", "params_b", "active_params_b", "batch", "seq", "keep_activations", "kept_graphs",
            "packed_docs", "attn", "attn_used", "step_s", "tokens_per_s", "model_tflops", "active_tflops",
            "active_tflops_nonembed",
            "tflops_with_attn", "peak_gpu_gib", "calc_gpu_gib", "host_bytes_per_param", "h2d_busy_s", "compute_busy_s",
            "d2h_busy_s", "optimizer_s", "optimizer_wait_s", "device_optimizer_units", "device_optimizer_s", "experts_forward_s", "experts_backward_s",
            "router_forward_s", "router_backward_s", "attention_forward_s", "attention_backward_s", "gpu_idle_frac",
            "gpu_step_s", "calc_step_s"]
    print_table(rows, cols)
    write_json(args.out, {"args": vars(args), "device": device_name(), "rows": rows})


if __name__ == "__main__":
    main()
