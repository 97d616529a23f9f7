"""The host AdamW's throughput against what the host and the link allow, in one process: G params/s of each way to
update an fp32 master and fp32 moments from a landed gradient, over a state far larger than the caches, chunk by
chunk as the engine does (16 M elements a chunk).

- `torch_fused_fp32`: torch's fused CPU AdamW on an fp32 gradient, no clip (the probe in shared/PERFORMANCE.md);
- `torch_engine_path`: what `optimizer.impl: torch` does with a bf16 gradient and a clip: upcast through an fp32
  scratch chunk, then fused AdamW with `grad_scale` (which writes the scaled gradient back);
- `numba`, `numba_with_copy`: `engine.host_adamw` on the bf16 gradient with the clip, without and with the streamed
  bf16 copy written in the same pass (`optimizer.impl: numba`);
- `copy_gbps`: the host's memory bandwidth as a plain fp32 copy sees it (bytes read + written a second);
- `gpu_over_link` (CUDA): master and moments carried to the GPU and back around torch's fused CUDA AdamW, on two
  copy streams overlapped with the update: what a GPU share of the update could take;
- `numba_under_dma` (CUDA): the numba kernel while the link copies pinned host memory to the GPU without pause, as
  the next step's weight uploads do while the engine's update runs (`dma_gbps`: what the link moved meanwhile).

Each way runs on the same state, `--threads` (default: every core but one, as the engine's optimizer thread), and
checks that the numba kernel equals torch's engine path bit for bit on the first chunk.

    python bench/optimizer_host.py --params-b 1.0 --out bench/results/optimizer_host.json
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import device_name, print_table, write_json  # noqa: E402
from mt_ray.engine.host_adamw import AdamStep, adamw_step, use_threads  # noqa: E402

CHUNK = 1 << 24
LR, BETAS, EPS, WD, CLIP = 1e-5, (0.9, 0.999), 1e-8, 0.01, 0.37


def state(numel: int) -> dict[str, torch.Tensor]:
    """A master, moments, a bf16 and an fp32 gradient and a bf16 copy, written once so every page is resident."""
    out = {name: torch.empty(numel) for name in ("master", "exp_avg", "exp_avg_sq", "grad32")}
    for name, t in out.items():
        t.uniform_(-1e-3, 1e-3) if name != "exp_avg_sq" else t.fill_(1e-8)
    out["grad16"] = out["grad32"].bfloat16()
    out["copy"] = torch.empty(numel, dtype=torch.bfloat16)
    return out


def chunks(numel: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + CHUNK, numel)) for lo in range(0, numel, CHUNK)]


def torch_step(opt: torch.optim.Optimizer, p: torch.nn.Parameter, s: dict, lo: int, hi: int, grad: torch.Tensor,
               count: int) -> None:
    p.data = s["master"][lo:hi]
    opt.state[p] = {"step": torch.tensor(float(count)), "exp_avg": s["exp_avg"][lo:hi],
                    "exp_avg_sq": s["exp_avg_sq"][lo:hi]}
    p.grad = grad
    opt.step()
    p.grad = None


def numba_pass(s: dict, numel: int, step: AdamStep, copy: bool) -> None:
    """`engine.host_adamw` over the whole state from the bf16 gradient, chunk by chunk, writing the bf16 copy where
    `copy`."""
    for lo, hi in chunks(numel):
        adamw_step(s["master"][lo:hi], s["exp_avg"][lo:hi], s["exp_avg_sq"][lo:hi], s["grad16"][lo:hi], step,
                   s["copy"][lo:hi] if copy else None)


def timed(fn, numel: int, reps: int) -> float:
    """G params/s of `fn()` (one pass over the whole state), best of `reps` after a warm-up pass."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return numel / best / 1e9


def host_rows(s: dict, numel: int, reps: int) -> dict[str, float]:
    p = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    opt = torch.optim.AdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
    scratch = torch.empty(CHUNK)
    step = AdamStep(LR, *BETAS, EPS, WD, 2, CLIP)

    def fused_fp32():
        opt.grad_scale = opt.found_inf = None
        for lo, hi in chunks(numel):
            torch_step(opt, p, s, lo, hi, s["grad32"][lo:hi], 1)

    def engine_path():
        opt.grad_scale, opt.found_inf = torch.tensor(1.0 / CLIP), torch.tensor(0.0)
        for lo, hi in chunks(numel):
            torch_step(opt, p, s, lo, hi, scratch[: hi - lo].copy_(s["grad16"][lo:hi]), 1)

    big = s["grad32"][: min(numel, 1 << 28)]
    dst = torch.empty_like(big)
    copy_s = 1 / timed(lambda: dst.copy_(big), big.numel(), reps)  # seconds per G elements
    return {"torch_fused_fp32": timed(fused_fp32, numel, reps), "torch_engine_path": timed(engine_path, numel, reps),
            "numba": timed(lambda: numba_pass(s, numel, step, False), numel, reps),
            "numba_with_copy": timed(lambda: numba_pass(s, numel, step, True), numel, reps), "copy_gbps": 8 / copy_s}


def identical_on_first_chunk(s: dict) -> bool:
    """The numba kernel against torch's engine path (bf16 gradient upcast, clip through grad_scale), one chunk."""
    n = min(CHUNK, s["master"].numel())
    ref = {k: s[k][:n].clone() for k in ("master", "exp_avg", "exp_avg_sq")}
    ours = {k: v.clone() for k, v in ref.items()}
    p = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    opt = torch.optim.AdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
    opt.grad_scale, opt.found_inf = torch.tensor(1.0 / CLIP), torch.tensor(0.0)
    torch_step(opt, p, ref, 0, n, s["grad16"][:n].float(), 1)
    adamw_step(ours["master"], ours["exp_avg"], ours["exp_avg_sq"], s["grad16"][:n], AdamStep(LR, *BETAS, EPS, WD, 2,
                                                                                                 CLIP))
    return all(torch.equal(ref[k], ours[k]) for k in ref)


def gpu_over_link(s: dict, numel: int, reps: int) -> float:
    """G params/s of the update on the GPU with master and moments carried over the link each way (pinned), the
    bf16 gradient carried up too, on an upload stream and a download stream around the compute stream."""
    pinned = {k: s[k].pin_memory() for k in ("master", "exp_avg", "exp_avg_sq", "grad16")}
    up, down = torch.cuda.Stream(), torch.cuda.Stream()
    slots = [{k: torch.empty(CHUNK, device="cuda", dtype=v.dtype) for k, v in pinned.items()} for _ in range(3)]
    freed = [torch.cuda.Event() for _ in slots]
    lr, step = torch.tensor(LR, device="cuda"), torch.tensor(2.0, device="cuda")

    def one_pass():
        for i, (lo, hi) in enumerate(chunks(numel)):
            slot, n = slots[i % len(slots)], hi - lo
            with torch.cuda.stream(up):
                up.wait_event(freed[i % len(slots)])  # the slot's previous chunk has gone back
                for k, v in pinned.items():
                    slot[k][:n].copy_(v[lo:hi], non_blocking=True)
            torch.cuda.current_stream().wait_stream(up)
            grad = slot["grad16"][:n].float().mul_(CLIP)
            torch._fused_adamw_([slot["master"][:n]], [grad], [slot["exp_avg"][:n]], [slot["exp_avg_sq"][:n]], [],
                                [step], lr=lr, beta1=BETAS[0], beta2=BETAS[1], weight_decay=WD, eps=EPS,
                                amsgrad=False, maximize=False)
            down.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(down):
                for k in ("master", "exp_avg", "exp_avg_sq"):
                    pinned[k][lo:hi].copy_(slot[k][:n], non_blocking=True)
                freed[i % len(slots)].record(down)
        torch.cuda.synchronize()

    return timed(one_pass, numel, reps)


def numba_under_dma(s: dict, numel: int, reps: int) -> tuple[float, float]:
    """The numba kernel's G params/s while another thread streams a pinned 2 GiB buffer to the GPU back to back,
    and the GB/s that stream moved meanwhile."""
    src = torch.empty(1 << 29).pin_memory()
    dst = torch.empty(1 << 29, device="cuda")
    stream, stop, moved = torch.cuda.Stream(), threading.Event(), [0]

    def upload():
        with torch.cuda.stream(stream):
            while not stop.is_set():
                dst.copy_(src, non_blocking=True)
                stream.synchronize()
                moved[0] += src.numel() * 4

    step = AdamStep(LR, *BETAS, EPS, WD, 2, CLIP)
    worker = threading.Thread(target=upload, daemon=True)
    worker.start()
    t0 = time.perf_counter()
    rate = timed(lambda: numba_pass(s, numel, step, False), numel, reps)
    stop.set()
    worker.join()
    return rate, moved[0] / (time.perf_counter() - t0) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params-b", type=float, default=1.0, help="state size in G parameters (16 bytes each here)")
    p.add_argument("--threads", type=str, default=None, help="comma list of thread counts (default: cores - 1)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default="bench/results/optimizer_host.json")
    args = p.parse_args()
    numel = int(args.params_b * 1e9)
    s = state(numel)
    cores = len(os.sched_getaffinity(0))
    rows = []
    for threads in [int(t) for t in (args.threads or str(max(1, cores - 1))).split(",")]:
        torch.set_num_threads(threads)
        use_threads(threads)
        rows.append({"threads": threads, "params_b": args.params_b, **host_rows(s, numel, args.reps)})
    rows[-1]["numba_bit_identical"] = identical_on_first_chunk(s)
    if torch.cuda.is_available():
        rows[-1]["gpu_over_link"] = gpu_over_link(s, numel, args.reps)
        rows[-1]["numba_under_dma"], rows[-1]["dma_gbps"] = numba_under_dma(s, numel, args.reps)
    print_table(rows, ["threads", "params_b", "torch_fused_fp32", "torch_engine_path", "numba", "numba_with_copy",
                       "copy_gbps", "gpu_over_link", "numba_under_dma", "dma_gbps", "numba_bit_identical"])
    write_json(args.out, {"args": vars(args), "device": device_name(), "cores": cores, "rows": rows})


if __name__ == "__main__":
    main()
