"""bf16 as numba sees it: 16-bit words (numba has no bfloat16), widened by a shift and narrowed with
round-to-nearest-even as torch rounds (NaN stays NaN); and the single-rounding fused multiply-add that ATen's
vectorised kernels use, which plain numba arithmetic (one rounding per operation) does not give.

Shared by the host optimizer (`engine.host_adamw`) and the node's gradient sum (`cluster.grad_sum`).
"""

from __future__ import annotations

import numpy as np
import torch
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic, overload


@intrinsic
def f32_of(typingctx, bits):
    """The float32 whose bits are `bits` (uint32)."""

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


@intrinsic
def bits_of(typingctx, value):
    """The bits (uint32) of a float32."""

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def fma32(typingctx, a, b, c):
    """a * b + c in float32, rounded once (LLVM's fma: a hardware FMA where the CPU has one)."""

    def codegen(context, builder, sig, args):
        return builder.fma(*args)

    return types.float32(types.float32, types.float32, types.float32), codegen


def widen(x):
    """An element as float32 (resolved per dtype by `_widen_impl`)."""


@overload(widen, inline="always")
def _widen_impl(x):
    if x == types.uint16:  # bf16 words: the upper half of a float32
        return lambda x: f32_of(np.uint32(x) << np.uint32(16))
    if x == types.float32:
        return lambda x: x
    return None


def narrow(a, like):
    """float32 `a` in the dtype of `like` (resolved per dtype by `_narrow_impl`)."""


@overload(narrow, inline="always")
def _narrow_impl(a, like):
    if like == types.uint16:
        def to_bf16(a, like):
            u = bits_of(a)
            if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
                return np.uint16(0x7FC0)  # NaN stays a (quiet) NaN
            return np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))

        return to_bf16
    if like == types.float32:
        return lambda a, like: a
    return None


WORD_DTYPES = (torch.bfloat16, torch.float32)
"""The tensor dtypes these kernels read and write: bf16 as uint16 words, fp32 as it is."""


def words_of(t: torch.Tensor) -> np.ndarray:
    """A numpy view (no copy) of a contiguous CPU tensor of a `WORD_DTYPES` dtype: bf16 as uint16 words."""
    t = t.detach()
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()
