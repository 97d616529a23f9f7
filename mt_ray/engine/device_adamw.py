"""`host_adamw`'s AdamW on the GPU, for the state kept there (`device_state.py`): the same arithmetic, bit for bit.

One Triton kernel a call, the fp32 operations of `host_adamw._update` in its order: fp-contraction off
(`enable_fp_fusion=False`) and the fused multiply-adds written out where ATen's build contracts them, IEEE
division and square root (`div_rn`, `sqrt_rn`: Triton's defaults are approximate), and the same switch of the
second moment's contraction at `eights_end`. So a unit updated here holds exactly the bits the host kernel (and
torch's fused CPU AdamW) would give it, and a run's result does not depend on how many units its GPU kept.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from mt_ray.engine.host_adamw import AdamStep, contracts_in_eights

BLOCK = 4096


@triton.jit
def _adamw_kernel(master, exp_avg, exp_avg_sq, grad, n, chunk, inv_coef, keep, c1, c1_minus_1, c2, beta2,
                  bias2_sqrt, eps, neg_step, SCALED: tl.constexpr, DECAYS: tl.constexpr, SMALL: tl.constexpr,
                  EIGHTS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    # The host's calls are `chunk` elements each (the last shorter): the second moment's contraction switches in
    # the last `len % 8` elements of each (`host_adamw.eights_end`).
    start = (offs // chunk) * chunk
    length = tl.minimum(n - start, chunk)
    in_eights = offs < start + length - length % 8 if EIGHTS else offs < n
    g = tl.load(grad + offs, mask=mask, other=0.0).to(tl.float32)
    p = tl.load(master + offs, mask=mask, other=0.0)
    m = tl.load(exp_avg + offs, mask=mask, other=0.0)
    v = tl.load(exp_avg_sq + offs, mask=mask, other=0.0)
    if SCALED:
        g = tl.math.div_rn(g, inv_coef)
    if DECAYS:
        p = p * keep
    m = tl.math.fma(c1, g - m, m) if SMALL else tl.math.fma(c1_minus_1, g - m, g)
    c2g = c2 * g
    v = tl.where(in_eights, tl.math.fma(c2g, g, v * beta2), tl.math.fma(v, beta2, c2g * g))
    denom = tl.math.div_rn(tl.math.sqrt_rn(v), bias2_sqrt) + eps
    p = p + tl.math.div_rn(neg_step * m, denom)
    tl.store(master + offs, p, mask=mask)
    tl.store(exp_avg + offs, m, mask=mask)
    tl.store(exp_avg_sq + offs, v, mask=mask)


def adamw_step(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor,
               step: AdamStep, copy: torch.Tensor | None = None, chunk: int | None = None) -> None:
    """`host_adamw.adamw_step` on CUDA tensors, on the current stream (no streamed copy: the GPU's weights are
    cast from the master as they are read), as one host call or (`chunk`) as the host's calls of `chunk`
    elements each over the same elements, in one launch."""
    if copy is not None:
        raise ValueError("the device AdamW writes no streamed copy")
    if grad.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"the device AdamW reads bf16 or fp32 gradients, not {grad.dtype}")
    n = master.numel()
    if n == 0:
        return
    scaled, inv_coef, decays, keep, small, c1, c2, beta2, bias2_sqrt, eps, neg_step = step.args()
    c1_minus_1 = np.float32(c1 - np.float32(1.0))
    _adamw_kernel[(triton.cdiv(n, BLOCK),)](
        master, exp_avg, exp_avg_sq, grad, n, chunk or n, float(inv_coef), float(keep), float(c1),
        float(c1_minus_1), float(c2), float(beta2), float(bias2_sqrt), float(eps), float(neg_step),
        SCALED=bool(scaled), DECAYS=bool(decays), SMALL=bool(small), EIGHTS=contracts_in_eights(),
        BLOCK=BLOCK, enable_fp_fusion=False)
