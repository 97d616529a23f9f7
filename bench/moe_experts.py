"""One routed experts bank, forward and backward, on the GPU: transformers' `grouped_mm` experts against mt-ray's
grouped path (`models.grouped_experts`), and the two grouped GEMMs alone as the ceiling, with each one's kernel time
split (GEMMs, the gated activation, gathers and scatters, the rest) from the torch profiler.

The bank is Qwen3-30B-A3B's (128 experts of 2048 -> 2 x 768 -> 2048, 8 a token), bf16, with a random router's
softmax top-8, at `--tokens` (a micro-batch of 16 x 1024 by default). TFLOPS count 18 x tokens x top_k x hidden x
intermediate (forward and backward of both projections).

    python bench/moe_experts.py --out bench/results/moe_experts.json
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import device_name, print_table, write_json  # noqa: E402
from mt_ray.models.grouped_experts import IMPLEMENTATION, apply_grouped_experts  # noqa: E402


def bank(args) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=args.hidden, moe_intermediate_size=args.intermediate, num_experts=args.experts,
                         num_experts_per_tok=args.top_k)
    module = Qwen3MoeExperts(cfg).to("cuda", torch.bfloat16)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return module


def inputs(args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(args.tokens, args.hidden, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    probs = torch.randn(args.tokens, args.experts, device="cuda", generator=g).softmax(-1)
    weights, index = probs.topk(args.top_k, dim=-1)
    return x, index, (weights / weights.sum(-1, keepdim=True)).bfloat16()


def gemms_only(module, x, index, weights):
    """The two grouped GEMMs and the activation on pre-sorted rows: what the bank costs with nothing around it."""
    expert, order = torch.sort(index.reshape(-1))
    offs = torch.cumsum(torch.bincount(expert, minlength=module.num_experts), 0, dtype=torch.int32)
    rows = x.detach()[order // index.shape[1]].requires_grad_()

    def run():
        gate, up = F.grouped_mm(rows, module.gate_up_proj.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
        return F.grouped_mm(F.silu(gate) * up, module.down_proj.transpose(-2, -1), offs=offs)

    return run


def step_ms(run, reps: int) -> float:
    """Milliseconds of one forward and backward, CUDA events around `reps` of them after three warm-ups."""
    grad = None
    for _ in range(3):
        out = run()
        grad = torch.randn_like(out)
        out.backward(grad)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        run().backward(grad)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def kernel_split(run) -> dict[str, float]:
    """Milliseconds of one forward and backward by kind of kernel."""
    from torch.profiler import ProfilerActivity, profile

    out = run()
    grad = torch.randn_like(out)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run().backward(grad)
        torch.cuda.synchronize()
    split: dict[str, float] = {}
    for ev in prof.key_averages():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = ev.key.lower()
        kind = ("gemm" if "gemm" in name or "cutlass" in name or "sm90" in name else
                "activation" if "silu" in name or "sigmoid" in name else
                "gather_scatter" if any(k in name for k in ("index", "gather", "scatter", "sort", "radix")) else
                "copy_fill_mask" if any(k in name for k in ("copy", "fill", "masked", "memset", "memcpy")) else "other")
        split[kind] = split.get(kind, 0.0) + ev.self_device_time_total / 1e3
    return split


def max_difference(module, x, index, weights) -> dict[str, float]:
    """mt-ray's grouped path against transformers' grouped_mm on the same inputs: the largest difference of the
    output and of the input's gradient, relative to the largest value (0 where they are bit-identical)."""
    results = []
    for impl in ("grouped_mm", IMPLEMENTATION):
        module.config._experts_implementation = impl
        x.grad = None
        out = module(x, index, weights)
        out.backward(torch.ones_like(out))
        results.append((out.detach().float(), x.grad.float()))
    (out, dx), (ours, our_dx) = results
    return {"out_rel_diff": ((ours - out).abs().max() / out.abs().max()).item(),
            "dx_rel_diff": ((our_dx - dx).abs().max() / dx.abs().max()).item()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=str, default="16384", help="comma list of token counts")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", default="bench/results/moe_experts.json")
    args = p.parse_args()
    rows = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        run_args = argparse.Namespace(**{**vars(args), "tokens": tokens})
        module = bank(run_args)
        x, index, weights = inputs(run_args)
        flops = 18 * tokens * args.top_k * args.hidden * args.intermediate
        variants = {"transformers_grouped_mm": "grouped_mm", "mt_ray_grouped": IMPLEMENTATION, "gemms_only": None}
        for name, impl in variants.items():
            if impl == IMPLEMENTATION:
                apply_grouped_experts(module)
            elif impl is not None:
                module.config._experts_implementation = impl
            run = gemms_only(module, x, index, weights) if impl is None else functools.partial(module, x, index, weights)
            ms = step_ms(run, args.reps)
            rows.append({"variant": name, "tokens": tokens, "ms": ms, "tflops": flops / ms / 1e9,
                         **{f"{k}_ms": v for k, v in kernel_split(run).items()}})
            if impl == IMPLEMENTATION:
                rows[-1].update(max_difference(module, x, index, weights))
            write_json(args.out, {"args": vars(args), "device": device_name(), "rows": rows})
    print_table(rows, ["variant", "tokens", "ms", "tflops", "gemm_ms", "activation_ms", "gather_scatter_ms",
                       "copy_fill_mask_ms", "other_ms", "out_rel_diff", "dx_rel_diff"])


if __name__ == "__main__":
    main()
