"""Summing a unit's gradients over a step's micro-batches into one flat fp32 buffer, and finding the tensors that
got none.

torch's AdamW leaves a parameter whose `.grad` is None untouched (no decay, no moment update). A contribution may
hold None for a tensor (autograd's answer for one it never reached: a tower norm `get_image_features` never
reads); a tensor None in every contribution of the step is handed to the optimizer as a span to skip.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mt_ray.engine.optimizer import Spans


def accumulate(acc: torch.Tensor | None, grads: Sequence[torch.Tensor | None], sizes: Sequence[int],
               frozen_numel: int, device: torch.device) -> tuple[torch.Tensor, set[int]]:
    """Sum a unit's parameter gradients (`sizes` elements each; None: none this time) into one flat fp32 buffer
    (micro-batches add up here), the frozen tail zeros, so the optimizer leaves it unchanged; and the indexes of the
    tensors this contribution left without a gradient.

    Each gradient is upcast as it is copied or added into its slice: no concatenated or upcast copy
    of the whole unit beside the sum (at the embedding's backward, 3 GiB less at 7B). The sum is
    the same to the bit: each element is upcast exactly and added once, in the same order.
    """
    first = acc is None
    if first:
        acc = torch.empty(sum(sizes) + frozen_numel, dtype=torch.float32, device=device)
        acc[acc.numel() - frozen_numel:].zero_()
    lo, missing = 0, set()
    for k, (g, n) in enumerate(zip(grads, sizes, strict=True)):
        part = acc[lo : lo + n]
        if g is None:
            missing.add(k)
            if first:
                part.zero_()
        elif first:
            part.copy_(g.reshape(-1))
        else:
            part.add_(g.reshape(-1))
        lo += n
    return acc, missing


def spans_of(sizes: Sequence[int], indexes: set[int]) -> Spans:
    """The [lo, hi) spans of the flat buffer that the tensors at `indexes` (of `sizes` elements each, in order) take."""
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + n)
    return tuple((starts[k], starts[k + 1]) for k in sorted(indexes))
