"""What a training step and an evaluation return.

Their tensors stay on the device, so that returning a result never makes the CPU wait for the GPU: a caller
reads them on its logging cadence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepResult:
    """What a step returns. Tensors stay on the device: read them only when logging.

    `loss` is what the step minimised: the mean token cross-entropy, plus `router_aux_loss_coef`
    times `aux_loss` where the MoE config asks for the router's load-balancing loss (as
    transformers' own loss); `aux_loss` is that loss, its micro-batches weighted by loss tokens.
    """

    loss: torch.Tensor
    grad_norm: torch.Tensor
    lr: float
    num_tokens: int
    num_loss_tokens: int
    aux_loss: torch.Tensor | None = None
    metrics: dict[str, torch.Tensor] | None = None  # a preference stage's rewards and log-probs (TRL's names)


@dataclass
class EvalResult:
    """What `evaluate` returns: the summed token loss (on the device: read it once per eval) and its counts."""

    loss_sum: torch.Tensor
    num_loss_tokens: int
    num_tokens: int
    pref_sums: dict[str, torch.Tensor] | None = None  # a preference stage's metric sums, and what they count
    pref_counts: dict[str, int] | None = None
