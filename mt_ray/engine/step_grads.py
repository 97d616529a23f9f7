"""A step's gradients on their way out of the engine: one fp32 sum per unit on the device, and each finished sum's
copy to the host and hand-off to the optimizer.

Kept apart from the step's schedule because every pass (head, layers, embedding, vision) adds into the same sums
and only the last contribution to a unit ships it; this is the one place that knows which sums are open, which
have gone, and the squared norm the clip coefficient is computed from.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from mt_ray.engine.grad_sums import accumulate, spans_of
from mt_ray.engine.optimizer import Spans
from mt_ray.engine.seams import GradSink
from mt_ray.engine.transfer import GradBuffers, Outbox, StreamSet
from mt_ray.models.discovery import ModelSpec

# A data-parallel worker's collective (`cluster.grad_reduce: nccl`) over a gradient in the gradient dtype: the sum
# where this engine ships it (the caller's stream ordered after the collective), else None.
ReduceGrad = Callable[[str, torch.Tensor], torch.Tensor | None]


class StepGrads:
    """The open gradient sums of a step, and the shipping of the finished ones to `worker`."""

    # The step's own, set by `start`.
    norm_sq: torch.Tensor
    lr: float
    sums: dict[str, torch.Tensor]
    ungraded: dict[str, set[int]]  # per unit: its tensors no contribution has reached yet
    sent: set[str]

    def __init__(self, spec: ModelSpec, device: torch.device, grad_dtype: torch.dtype, streams: StreamSet,
                 grad_buffers: GradBuffers, worker: GradSink, pin: bool):
        self.spec = spec
        self.device = device
        self.grad_dtype = grad_dtype
        self.streams = streams
        self.grad_buffers = grad_buffers
        self.worker = worker
        self.outbox = Outbox(streams)
        self.reduce: ReduceGrad | None = None
        # Units whose optimizer state is kept on the device (`HostStore.keep_on_device`): their gradients stay there.
        self.on_device: frozenset[str] = frozenset()
        # Each unit's trainable tensors' sizes, in order: the slices of its gradient sum (`grad_sums.accumulate`).
        self.sizes = {u.name: [p.numel for p in u.params if p.trainable] for u in spec.units}
        # Reused every step: with clipping, step t+1 cannot finish its forward before the worker
        # has read step t's norm (layer updates wait for it), so it is never overwritten early.
        self.norm_sq_host = torch.zeros((), dtype=torch.float32, pin_memory=pin)

    def start(self, lr: float) -> None:
        """Open a step whose updates use learning rate `lr`: no sum open, none sent, the norm at zero."""
        self.norm_sq = torch.zeros((), dtype=torch.float32, device=self.device)
        self.lr = lr
        self.sums, self.ungraded, self.sent = {}, {}, set()

    def sum_of(self, unit: str) -> torch.Tensor:
        """This step's fp32 gradient sum of `unit` on the device, zeroed on first use."""
        if unit not in self.sums:
            self.sums[unit] = torch.zeros(self.spec.unit(unit).numel, dtype=torch.float32, device=self.device)
        return self.sums[unit]

    def add_mirrors(self, unit: str, grads: Sequence[torch.Tensor]) -> None:
        """Add the gradients of `unit`'s mirrors to their owners' sums, which wait on the device: an owner sits in an
        earlier layer, whose backward comes later, so its gradient ships with every layer's part in it."""
        for mirror, g in zip(self.spec.mirrors.get(unit, ()), grads, strict=True):
            owner_sum = self.sum_of(mirror.owner)
            owner_sum[mirror.owner_offset : mirror.owner_offset + mirror.numel] += g.reshape(-1)

    def add(self, unit: str, grads: Sequence[torch.Tensor | None], final: bool, frozen_numel: int = 0) -> None:
        """Add a micro-batch's gradients (None: that tensor got none) to the unit's sum; the final contribution
        ships it, with the tensors no contribution reached (a sum begun by `sum_of` counts as reaching all)."""
        prior = self.sums.pop(unit, None)
        sizes = self.sizes[unit]
        acc, missing = accumulate(prior, grads, sizes, frozen_numel, self.device)
        ungraded = missing if prior is None else self.ungraded.pop(unit, set()) & missing
        if final:
            self.send(unit, acc, spans_of(sizes, ungraded))
        else:
            self.sums[unit], self.ungraded[unit] = acc, ungraded

    def send(self, unit: str, acc: torch.Tensor, skip: Spans = ()) -> None:
        """Ship a finished fp32 gradient to the host and queue its optimizer update (`skip`: spans without one)."""
        self.sent.add(unit)
        if self.reduce is None:
            self.norm_sq += norm_sq_of(acc)
            grad = acc.to(self.grad_dtype)
        else:
            # The node's collective runs in the gradient dtype, off the compute stream; only the engine that ships
            # the node's sum goes on, its norm that of the sum it ships.
            grad = self.reduce(unit, acc.to(self.grad_dtype))
            if grad is None:
                return
            self.norm_sq += norm_sq_of(grad)
        done_on_compute = self.streams.record(self.streams.compute)
        if unit in self.on_device:
            # Updated on the device: the worker holds the gradient there until its update has run.
            self.worker.submit(unit, grad, done_on_compute, self.lr, skip)
            return
        if self.worker.copies_out:
            # The sink copies it out from a thread of its own: room in its landing is never waited for here.
            self.worker.submit_device(unit, grad, done_on_compute, self.lr, skip)
            return
        for lo, hi in self.grad_buffers.pieces(unit):  # each piece is handed on as it lands
            host = self.grad_buffers.acquire(unit, lo, hi)
            with self.streams.on(self.streams.d2h):
                self.streams.wait(self.streams.d2h, done_on_compute)  # gradient fully computed
                host.copy_(grad[lo:hi], non_blocking=True)
                landed = self.streams.record(self.streams.d2h)
            self.worker.submit(unit, host, landed, self.lr, skip)
        self.outbox.add(grad, landed)  # keeps it alive until the last copy has read it

    def finish(self, optional: Sequence[str]) -> None:
        """Close the step: the `optional` units it never sent are not updated, and the worker gets the norm."""
        for unit in optional:
            if unit not in self.sent:  # no image this step: the unit is not updated (torch skips a None grad)
                self.worker.submit(unit, None, None, self.lr)
        with self.streams.on(self.streams.d2h):
            # The clip coefficient needs the global norm on the host; only the worker waits for it.
            self.streams.wait(self.streams.d2h, self.streams.record(self.streams.compute))
            self.norm_sq_host.copy_(self.norm_sq, non_blocking=True)
            norm_ready = self.streams.record(self.streams.d2h)
        self.outbox.add(self.norm_sq, norm_ready)  # a later step must not reuse it before the copy
        self.worker.end_step(self.norm_sq_host, norm_ready, self.lr)


CPU_NORM_SLICE = 1 << 13  # elements whose fp32 norm the CPU takes exactly enough (3e-8)


def norm_sq_of(grad: torch.Tensor) -> torch.Tensor:
    """‖grad‖² in fp32, for the clip. On the CPU torch's fp32 norm sums each vector lane in turn (2e-5 off at 1 M
    elements, 6e-4 at 10 M, so one engine's clip differed from the cluster's exact one): there it is taken over
    slices of CPU_NORM_SLICE elements (3e-8 off) added in fp64, with no copy of the gradient. A GPU's tree
    reduction in fp32 is exact to fp32 rounding and reads the gradient once."""
    if grad.device.type != "cpu":
        return torch.linalg.vector_norm(grad, dtype=torch.float32).square()
    norms = torch._foreach_norm(list(grad.reshape(-1).split(CPU_NORM_SLICE)), dtype=torch.float32)
    return torch.stack(norms).double().square().sum().float()
