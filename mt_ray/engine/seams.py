"""The seams through which a trainer other than the local one plugs into the engine.

By default the engine sends finished gradients to its own `OptimizerWorker` and streams
weights from its own `HostStore`. A data-parallel trainer (mt_ray.cluster) passes objects with
the same methods instead, so the step schedule stays one piece of code.
"""

from __future__ import annotations

from typing import Protocol

import torch


class GradSink(Protocol):
    """Where the engine hands each finished unit gradient (the `OptimizerWorker` surface)."""

    unit_order: list[str]
    # Whether the sink copies each finished gradient to the host itself (`submit_device`), from a thread of its own,
    # so a landing that must wait for room (a data-parallel worker's ring) never holds the engine's thread.
    copies_out: bool

    def submit(self, unit: str, grad: torch.Tensor | None, landed: torch.cuda.Event | None, lr: float,
               skip: tuple[tuple[int, int], ...] = ()) -> None:
        """`grad` is a host buffer that is valid once `landed` has completed (None on CPU), one call per piece of
        the engine's `grad_buffers.pieces(unit)`, in order; None (once) where the step did not use the unit (a
        vision unit in a step without images): it is not updated. `skip`: the [lo, hi) spans of the whole unit's
        state that got no gradient (a tower norm `get_image_features` never reads), left as they are."""

    def submit_device(self, unit: str, grad: torch.Tensor, ready: torch.cuda.Event | None, lr: float,
                      skip: tuple[tuple[int, int], ...] = ()) -> None:
        """Where `copies_out`: the whole gradient on the device (the gradient dtype), complete once `ready` has
        (None on CPU); the sink lands it on the host and keeps it alive until its copies have run."""

    def end_step(self, norm_sq: torch.Tensor, ready: torch.cuda.Event | None, lr: float) -> None:
        """Every unit of the step has been submitted; `norm_sq` is this engine's local norm squared."""

    def wait_updated(self, unit: str, version: int) -> None:
        """Block until `unit` holds the weights after `version` optimizer steps."""

    def close(self) -> None: ...


class UnitVersions(Protocol):
    """How far each unit's optimizer has got: what the weight streamer asks before it uploads a unit."""

    def wait_updated(self, unit: str, version: int) -> None:
        """Block (with a bound: past it, raise naming the unit) until `unit` holds the weights after `version`
        optimizer steps."""

    def is_updated(self, unit: str, version: int) -> bool:
        """Whether `unit` already holds the weights after `version` optimizer steps (never blocks)."""


class WeightSource(UnitVersions, Protocol):
    """Where the engine reads each unit's streamed (compute-dtype) weights (the `HostStore` surface), and how far
    the optimizer that writes them has got (`UnitVersions`)."""

    def streamed_of(self, unit: str) -> torch.Tensor:
        """The unit's flat host weights, or its fp32 master on the engine's device where its state is kept there
        (`engine.device_optimizer_units`); the engine only reads them."""

    def release(self, unit: str, copied: torch.cuda.Event | None) -> None:
        """The step will not read `unit` again once `copied` (its last upload; None on CPU) completes."""


class ReferenceSource(Protocol):
    """Where a preference stage reads its frozen reference's weights (the `ReferenceWeights` surface): a
    data-parallel worker's are its node's, held once there for all its workers."""

    def streamed_of(self, unit: str) -> torch.Tensor:
        """The unit's flat host reference weights, in the compute dtype; never written during training."""

    def close(self) -> None: ...
