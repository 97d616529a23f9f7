"""Routed experts as two grouped GEMMs around the gated activation, with no pass over the tokens the GEMMs do not need.

transformers' `grouped_mm` experts (its default) compute the same products, but around them it masks three
token-by-hidden tensors for expert-parallel sentinels the engine never routes (three full copies forward, three
backward), gathers the tokens by advanced indexing (whose backward sorts the indices again and scatter-adds), and
restores the token order with another scatter. Here the token-expert pairs are sorted by expert once a call, the
tokens gathered into that order with a backward that adds each token's `top_k` rows in fp32 (a gather and a sum, no
scatter), the expert outputs put back in token order by the inverse permutation (its backward the forward
permutation), and weighted and summed over `top_k` exactly as transformers does (the product rounded in the compute
dtype, the sum accumulated in fp32). The products go through transformers' own grouped GEMM dispatcher on the same
operands, so the forward equals transformers' to the bit.

It runs the experts transformers declares through `use_experts_implementation` as a concatenated gate-and-up bank
with SiLU, no bias and the default gate (Qwen2/3-MoE, Mixtral, OLMoE, DeepSeek-V3, GLM-4-MoE, ...); any other bank
(GPT-OSS's clamped, biased gate; an ungated bank) keeps transformers' own implementation, and the engine says so
once (`apply_grouped_experts`).

Shapes: N tokens, K experts a token (`top_k`), S = N * K token-expert pairs, D hidden, E experts, I an expert's width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from transformers.integrations.moe import ExpertsInterface, _default_apply_gate, _grouped_mm

IMPLEMENTATION = "mt_ray_grouped"
"""The name this path is registered under in transformers' experts interface."""


class _Dispatch(torch.autograd.Function):
    """Token rows in expert order: row s is token `order[s] // top_k`. Backward adds each token's `top_k` rows."""

    @staticmethod
    def forward(ctx, x_ND: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, top_k: int) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.top_k = top_k
        return x_ND.index_select(0, order // top_k)

    @staticmethod
    def backward(ctx, d_SD: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        # Back in (token, choice) order, then each token's choices summed in fp32, as one sum kernel rounds.
        d_NKD = d_SD.index_select(0, inverse).view(-1, ctx.top_k, d_SD.shape[-1])
        return d_NKD.sum(1), None, None, None


class _Permute(torch.autograd.Function):
    """Rows gathered by a permutation; backward gathers by its inverse (no scatter)."""

    @staticmethod
    def forward(ctx, y_SD: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return y_SD.index_select(0, index)

    @staticmethod
    def backward(ctx, d_SD: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return d_SD.index_select(0, inverse), None, None


def _expert_offsets(expert_S: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Where each expert's rows end in expert order (int32, as grouped_mm takes them), with no host sync."""
    # histc, not bincount: bincount sizes its output from the data (a device sync); histc takes int on CUDA only.
    counts = torch.histc(expert_S.int() if expert_S.is_cuda else expert_S.float(), bins=num_experts, min=0,
                         max=num_experts - 1)
    return torch.cumsum(counts, dim=0, dtype=torch.int32)


def grouped_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts' output for N tokens [N, D], each routed to `top_k_index` [N, K] with `top_k_weights` [N, K]."""
    num_tokens, top_k = top_k_index.shape
    weight = self.gate_up_proj.dtype
    expert_S, order = torch.sort(top_k_index.reshape(-1))  # S = N * K token-expert pairs, by expert
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    offsets = _expert_offsets(expert_S, self.num_experts)
    x_SD = _Dispatch.apply(hidden_states.to(weight), order, inverse, top_k)
    gate_up = self.gate_up_proj if self.is_transposed else self.gate_up_proj.transpose(-2, -1)  # [E, D, 2I]
    down = self.down_proj if self.is_transposed else self.down_proj.transpose(-2, -1)  # [E, I, D]
    # transformers' dispatcher: torch's grouped_mm, or its own per-expert fallback where torch's cannot run.
    gate, up = _grouped_mm(x_SD, gate_up, offs=offsets).chunk(2, dim=-1)
    y_SD = _grouped_mm(self.act_fn(gate) * up, down, offs=offsets)
    y_NKD = _Permute.apply(y_SD, inverse, order).view(num_tokens, top_k, -1)
    # transformers' order of operations: the weighted rows rounded (in the dtype the two promote to), their sum over
    # K accumulated in fp32.
    out_ND = (y_NKD * top_k_weights.unsqueeze(-1)).sum(dim=1)
    return out_ND.to(hidden_states.dtype)


ExpertsInterface.register(IMPLEMENTATION, grouped_experts_forward)


def unsupported_reason(bank: nn.Module) -> str | None:
    """Why `bank` (an experts module under transformers' experts interface) cannot run here, or None if it can."""
    if not getattr(bank, "has_gate", False):
        return "its experts have no gate"
    if getattr(bank, "has_bias", False):
        return "its experts have biases"
    if not getattr(bank, "is_concatenated", True):
        return "its gate and up projections are interleaved"
    if getattr(type(bank), "_apply_gate", _default_apply_gate) is not _default_apply_gate:
        return f"{type(bank).__name__} gates its experts its own way"
    act = getattr(bank, "act_fn", None)
    if not (isinstance(act, (type(ACT2FN["silu"]), nn.SiLU)) or act is F.silu):
        return f"its experts' activation is {getattr(act, '__name__', type(act).__name__)}, not SiLU"
    return None


def experts_banks(model: nn.Module) -> dict[str, nn.Module]:
    """The modules of `model` that dispatch through transformers' experts interface, by name."""
    return {name: m for name, m in model.named_modules() if hasattr(m, "is_concatenated") and hasattr(m, "config")}


def apply_grouped_experts(model: nn.Module) -> str | None:
    """Run every experts bank of `model` on this path (each bank's config names it); returns None, or why it keeps
    transformers' own implementation (a one-line notice for the log), for the first bank that cannot."""
    banks = experts_banks(model)
    for name, bank in banks.items():
        if (reason := unsupported_reason(bank)) is not None:
            return f"MoE experts keep transformers' {bank.config._experts_implementation} path: {name}: {reason}"
    for bank in banks.values():
        bank.config._experts_implementation = IMPLEMENTATION
    return None
