"""Packed rows through variable-length flash attention: documents kept apart with no mask at all.

For packed rows (position ids restarting at each document) transformers keeps the documents
apart with a dense B x 1 x T x T block mask; SDPA then leaves its flash kernel for a masked one,
and the engine holds each micro-batch's mask for the whole step. PyTorch ships its flash kernel
with variable-length support (`torch.nn.attention.varlen`): the batch is flattened into one run
of tokens and `cu_seq_lens` (each document's start, then the end) bounds every document, so no
attention crosses a boundary, no mask exists, and fully masked tiles are never computed.

`VARLEN` is registered as a transformers attention implementation. transformers has no mask
function for it, so the decoder body builds no mask; the engine passes every layer the
micro-batch's `cu_seq_lens_q/k` and `max_length_q/k` (transformers' own names for the flash
path, built on the host from the position ids: `Documents.flash_kwargs`). Without them each row
is one sequence. Sliding windows come from the `sliding_window` the attention module passes, as
for flash_attention_2. Where the flash kernel does not run (the CPU, fp32) each document runs
through SDPA alone: the same arithmetic, so every family's packed parity is tested on the CPU.

Tensor shape key: B batch, H query heads, K key/value heads, T tokens, N = B*T, D head dim.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from mt_ray.models.discovery import ModelSpec

VARLEN = "varlen"
# The same kernel for a vision tower whose attention runs both ways within each image or window, bounded by
# `cu_seqlens` (Qwen-VL). transformers hands those bounds (and their longest span, read once per tower call) to
# an attention backend only when its name says "flash"; under any other it splits the patches at the bounds on
# the host (a device sync every block) and calls the backend once per window (about a hundred calls a block).
TOWER_VARLEN = "varlen_flash_tower"
HALF = (torch.float16, torch.bfloat16)


def varlen_attention_forward(module: torch.nn.Module, query_BHTD: torch.Tensor, key_BKTD: torch.Tensor,
                             value_BKTD: torch.Tensor, attention_mask: Any, scaling: float | None = None,
                             dropout: float = 0.0, sliding_window: int | None = None, softcap: float | None = None,
                             s_aux: torch.Tensor | None = None, cu_seq_lens_q: torch.Tensor | None = None,
                             max_length_q: int | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: the output as [B, T, H, D], no weights."""
    causal = kwargs.get("is_causal", getattr(module, "is_causal", True))
    if attention_mask is not None or softcap or s_aux is not None or dropout or (not causal and sliding_window):
        # `resolve_attention` refuses such families; this guards a config set by hand.
        raise ValueError("varlen attention takes no mask, soft-capping, sinks, dropout or bidirectional window")
    B, H, T, D = query_BHTD.shape
    if cu_seq_lens_q is None:  # no document bounds given: each row is one sequence
        cu_seq_lens_q = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=query_BHTD.device)
        max_length_q = T
    q_NHD, k_NKD, v_NKD = (t.transpose(1, 2).reshape(B * T, t.shape[1], t.shape[-1])
                           for t in (query_BHTD, key_BKTD, value_BKTD))
    scale = D**-0.5 if scaling is None else scaling
    left = sliding_window - 1 if sliding_window else -1  # keys q-left..q, as transformers' sliding masks
    run = _flash if q_NHD.is_cuda and q_NHD.dtype in HALF else _per_document
    out_NHD = run(q_NHD, k_NKD, v_NKD, cu_seq_lens_q, max_length_q, scale, left, causal)
    return out_NHD.view(B, T, H, -1), None


def _flash(q_NHD, k_NKD, v_NKD, cu_seq_lens, max_length, scale, left, causal):
    """PyTorch's varlen flash kernel (grouped-query heads natively; one head dim for q, k and v)."""
    varlen_attn, params = _kernel()
    dv = v_NKD.shape[-1]
    if dv != q_NHD.shape[-1]:  # MLA: pad the values to the query's head dim, as transformers' flash path does
        v_NKD = F.pad(v_NKD, (0, q_NHD.shape[-1] - dv))
    out = varlen_attn(q_NHD, k_NKD, v_NKD, cu_seq_lens, cu_seq_lens, max_length, max_length, scale=scale,
                      **_kernel_kwargs(params, left, q_NHD.shape[1] != k_NKD.shape[1], causal))
    return out[..., :dv]


def _per_document(q_NHD, k_NKD, v_NKD, cu_seq_lens, max_length, scale, left, causal):
    """Each document through SDPA alone (reads the bounds on the host: for the CPU and for tests)."""
    bounds = cu_seq_lens.tolist()
    groups = q_NHD.shape[1] // k_NKD.shape[1]
    outs = []
    for s, e in zip(bounds[:-1], bounds[1:], strict=True):
        q, k, v = (t[s:e].transpose(0, 1) for t in (q_NHD, k_NKD, v_NKD))
        k, v = k.repeat_interleave(groups, dim=0), v.repeat_interleave(groups, dim=0)
        mask = _window(e - s, left, q.device) if left >= 0 else None
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None, scale=scale)
        outs.append(out.transpose(0, 1))
    return torch.cat(outs)


def _window(n: int, left: int, device: torch.device) -> torch.Tensor:
    """Causal sliding-window mask of one document: query i sees keys i-left..i."""
    i = torch.arange(n, device=device)
    dist = i[:, None] - i[None, :]
    return (dist >= 0) & (dist <= left)


@functools.cache
def _kernel() -> tuple[Callable, frozenset[str]] | None:
    """torch's `varlen_attn` and its parameter names; None where this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def _kernel_kwargs(params: frozenset[str], left: int, grouped: bool, causal: bool = True) -> dict:
    """The keywords for causality with a left window (or none: attention both ways) and for grouped-query heads
    in this torch's form of the API (a prototype: releases ask for causality as `is_causal`, later as
    `window_size`, and for grouped heads with `enable_gqa` or not at all)."""
    if "window_size" in params:
        out = {"window_size": (left, 0) if causal else (-1, -1)}
    elif left < 0:
        out = {"is_causal": causal}
    else:  # `varlen_problem` refuses sliding-window families on such a torch; this guards a config set by hand
        raise ValueError(f"torch {torch.__version__}'s varlen attention has no sliding window")
    if grouped and "enable_gqa" in params:
        out["enable_gqa"] = True
    return out


def varlen_problem(spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the varlen path cannot train this model here (None when it can)."""
    config = spec.base.config  # the language model's (an image-text model's text config)
    if device.type == "cuda" and dtype not in HALF:
        return "runs the flash kernel, which takes bf16 or fp16 compute only (engine.compute_dtype)"
    if device.type == "cuda":
        kernel = _kernel()
        if kernel is None:
            return f"needs torch.nn.attention.varlen, which torch {torch.__version__} lacks (torch 2.10 or later has it)"
        if _uses_sliding_window(config) and "window_size" not in kernel[1]:
            return (f"cannot apply the sliding window '{config.model_type}' uses: torch {torch.__version__}'s "
                    "varlen attention has no window_size")
    if not getattr(spec.skeleton, "_supports_flash_attn", False):
        return f"needs a family whose attention transformers runs with flash kernels, which '{config.model_type}' is not"
    if getattr(config, "attention_dropout", 0.0):
        return "has no attention dropout (config.attention_dropout is not 0)"
    both_ways = getattr(config, "use_bidirectional_attention", None)  # "vision": an image's tokens only (Gemma 4)
    if both_ways == "vision" or spec.vision is not None and spec.vision.image_tokens_attend_both_ways:
        return (f"computes causal attention only, and '{spec.config.model_type}' lets some tokens (an image's, or a "
                "prefix of image and prompt) attend to each other both ways")
    if both_ways:
        return f"computes causal attention only, and this '{config.model_type}' attends both ways"
    return None


def _uses_sliding_window(config) -> bool:
    return bool(getattr(config, "sliding_window", None)) or "sliding_attention" in (getattr(config, "layer_types", None) or ())


def register_varlen() -> str:
    """Make `VARLEN` a transformers attention implementation (idempotent); returns its name."""
    AttentionInterface.register(VARLEN, varlen_attention_forward)
    return VARLEN


def register_tower_varlen() -> str:
    """Make `TOWER_VARLEN` a transformers attention implementation (idempotent); returns its name."""
    AttentionInterface.register(TOWER_VARLEN, varlen_attention_forward)
    return TOWER_VARLEN


def bounds_attention_by_cu_seqlens(blocks: torch.nn.ModuleList) -> bool:
    """Whether a vision tower's blocks take `cu_seqlens` (Qwen-VL's: images and windows bounded by them), so
    `TOWER_VARLEN` runs their attention as one kernel call."""
    return len(blocks) > 0 and "cu_seqlens" in inspect.signature(type(blocks[0]).forward).parameters


def takes_document_bounds(attn_implementation: str) -> bool:
    """Whether the backend keeps documents apart from `cu_seq_lens` (given to each layer) instead of a mask."""
    return attn_implementation == VARLEN or attn_implementation.startswith("flash_attention")
