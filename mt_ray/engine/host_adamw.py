"""AdamW over host fp32 state in one pass a chunk, at memory bandwidth, with torch's fused CPU AdamW arithmetic.

torch's fused AdamW takes a gradient of the parameter's dtype, so a bf16 gradient went through an fp32 scratch
copy first, and with clipping it writes the scaled gradient back: 38 bytes of memory traffic a parameter in two
passes, where the update itself needs 26 (fp32 master, m and v read and written, a bf16 gradient read). This kernel
reads the gradient as it landed (bf16 words or fp32), scales it by the clip, updates master and moments, and can
write the streamed bf16 copy of the new master in the same pass (28 bytes), on a numba thread team of the calling
thread's own (`numba.set_num_threads` holds per thread).

The arithmetic is ATen's `adam_math` for fp32 (aten/src/ATen/native/cpu/FusedAdamKernel.cpp) as torch's x86 build
compiles it, operation for operation in fp32: the fused multiply-adds its compiler contracts (one of which differs in the
last `numel % 8` elements of each call), every coefficient rounded from fp64 as ATen rounds it. So on AVX2 and AVX512
hosts (`CONTRACTED_IN_EIGHTS`) it is bit-identical to `torch.optim.AdamW(fused=True)` over the same slices, and tests
hold it to that; elsewhere it is the same formula, equal to fp32 rounding.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numba
import numpy as np
import torch
from numba import njit, prange

from mt_ray.engine.bf16_words import WORD_DTYPES, fma32, narrow, widen, words_of

BLOCK = 1 << 16  # elements per parallel task: 1.6 MiB of state, far above a task's overhead
CONTRACTED_IN_EIGHTS = ("AVX2", "AVX512")
"""The CPU capabilities whose ATen kernels contract `v * beta2 + c2 * g * g` one way over every full 8 elements of a
call (its vector lanes, and its scalar tail as the compiler vectorised it) and the other way over the last
`numel % 8` (measured against torch's x86 wheels); elsewhere the kernel makes no claim to bit-identity."""


@dataclass(frozen=True)
class AdamStep:
    """One AdamW update's coefficients, as ATen derives them in fp64 and rounds them to fp32."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int  # this update's 1-based count: bias correction
    clip_coef: float = 1.0

    def args(self) -> tuple:
        f = np.float32
        bias1 = 1.0 - math.pow(self.beta1, float(np.float32(self.step)))
        bias2 = 1.0 - math.pow(self.beta2, float(np.float32(self.step)))
        step_size = self.lr / bias1
        c1 = 1.0 - self.beta1
        scaled = self.clip_coef != 1.0
        # torch.optim.AdamW(fused) divides by grad_scale = fp32(1 / coef) (optimizer.UnitOptimizer._apply_clip).
        inv_coef = f(1.0 / self.clip_coef) if scaled else f(1.0)
        return (scaled, inv_coef, self.weight_decay != 0.0, f(1.0 - self.lr * self.weight_decay),
                abs(f(c1)) < f(0.5), f(c1), f(1.0 - self.beta2), f(self.beta2), f(math.sqrt(bias2)), f(self.eps),
                f(-step_size))


@njit(inline="always")
def _moments_and_denom(g, m, v, small, c1, c2, beta2, bias2_sqrt, eps, other_product):
    # ATen's lerp is Vec::blendv + fmadd in the lanes, and its build contracts the scalar tail's lerp alike. Its
    # `v * beta2 + c2 * g * g` is contracted too: around `c2 * g * g`, or in the last `numel % 8` elements of a call
    # around `v * beta2` (`CONTRACTED_IN_EIGHTS`).
    m = fma32(c1, g - m, m) if small else fma32(c1 - np.float32(1.0), g - m, g)
    v = fma32(v, beta2, c2 * g * g) if other_product else fma32(c2 * g, g, v * beta2)
    return m, v, np.sqrt(v) / bias2_sqrt + eps


@njit(inline="always")
def _update(master, exp_avg, exp_avg_sq, grad, copy, lo, hi, args, eights):
    scaled, inv_coef, decays, keep, small, c1, c2, beta2, bias2_sqrt, eps, neg_step = args
    p_, m_, v_, g_ = master[lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi], grad[lo:hi]
    c_ = copy[lo:hi] if copy.size else copy
    for j in range(hi - lo):  # views of the slice: LLVM vectorises loops over a view's own elements
        g = widen(g_[j])
        if scaled:
            g = g / inv_coef
        p = p_[j] * keep if decays else p_[j]
        m, v, denom = _moments_and_denom(g, m_[j], v_[j], small, c1, c2, beta2, bias2_sqrt, eps, not eights)
        p = p + neg_step * m / denom
        p_[j], m_[j], v_[j] = p, m, v
        if copy.size:
            c_[j] = narrow(p, c_[j])


@njit(parallel=True, nogil=True, cache=True, boundscheck=False)
def _adamw_kernel(master, exp_avg, exp_avg_sq, grad, copy, args, eights_end):
    """Update [0, n): [0, eights_end) as ATen computes its full eights, the rest as its remainder; `copy` (empty:
    none) gets the new master narrowed to its dtype."""
    blocks = (eights_end + BLOCK - 1) // BLOCK
    for b in prange(blocks):
        _update(master, exp_avg, exp_avg_sq, grad, copy, b * BLOCK, min((b + 1) * BLOCK, eights_end), args, True)
    _update(master, exp_avg, exp_avg_sq, grad, copy, eights_end, master.size, args, False)


@functools.cache
def contracts_in_eights() -> bool:
    """Whether this CPU's ATen contracts the second moment one way over full eights and the other over the rest."""
    return torch.backends.cpu.get_cpu_capability() in CONTRACTED_IN_EIGHTS


def eights_end(numel: int) -> int:
    """Where ATen's remainder after full eights starts in a call over `numel` elements, on this CPU."""
    return numel - numel % 8 if contracts_in_eights() else numel


def adamw_step(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor,
               step: AdamStep, copy: torch.Tensor | None = None) -> None:
    """One AdamW update in place of fp32 `master`, `exp_avg` and `exp_avg_sq` (flat, contiguous, one size) from `grad`
    (bf16 or fp32, left as it is), with `copy` (bf16 or fp32), if given, set to the new master in its dtype.

    Runs on the calling thread's numba team."""
    if grad.dtype not in WORD_DTYPES or (copy is not None and copy.dtype not in WORD_DTYPES):
        raise TypeError(f"the host AdamW reads bf16 or fp32 gradients and writes a bf16 or fp32 copy; got a "
                        f"{grad.dtype} gradient and a {None if copy is None else copy.dtype} copy")
    n = master.numel()
    state = [words_of(t) for t in (master, exp_avg, exp_avg_sq)]
    target = words_of(copy) if copy is not None else np.empty(0, np.float32)
    # Blocks handed out one at a time as threads come free, not split evenly up front: a thread that shares its
    # core with the engine's own (launching kernels, landing gradients) would otherwise hold every other one up.
    with numba.parallel_chunksize(1):
        _adamw_kernel(*state, words_of(grad), target, step.args(), eights_end(n))


def use_threads(threads: int) -> None:
    """Size the calling thread's numba team (at most numba's pool)."""
    numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))
