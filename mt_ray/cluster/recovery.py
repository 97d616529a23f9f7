"""The driver's recovery policy: what a step that lost a worker becomes, as a typed decision.

With clipping no unit is updated before every gradient of the step is in, so the step is redone, or completed if
every gradient was in. Without clipping some units may already be updated: the snapshot is restored and the steps
since it replayed; with no snapshot only the newest checkpoint holds a consistent state (`ClusterLostError`). A step
whose answers are needed beside its update (GRPO's first on a rollout: its log-probs are the old policy's) is never
completed without them: it is redone, or restored as an unclipped one.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from mt_ray.cluster.errors import ClusterLostError


class RecoveryAction(str, enum.Enum):
    """What the driver did with a step that lost a worker (the value is what the log and `FailureEvent` say)."""

    COMPLETED = "step had every gradient; completed"
    REDONE = "no unit updated; step redone"
    RESTORED = "units partly updated; restored snapshot"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class StepReport:
    """One shard's account of a stopped step (`CoordinatorShard.stop`)."""

    complete: bool  # every gradient of the shard's units is summed
    touched: bool  # some unit was updated (only without clipping)
    norm_sq: float | None  # the shard's norm² where it had to take it itself (the lone worker's GPU norm was lost)
    snapshot_step: int | None  # the step of the shard's snapshot (None: none taken)


@dataclass(frozen=True)
class RecoveryDecision:
    """Where the run resumes after a lost worker, and how."""

    action: RecoveryAction
    resume_at: int
    restore_snapshot: bool = False
    norm_sq: float | None = None  # COMPLETED: the step's global norm² to hand the shards (None: they have it)


@dataclass
class FailureEvent:
    """A lost worker and what the driver did about it."""

    step: int
    error: str
    lost_ranks: list[int]
    resumed_at: int
    action: RecoveryAction


def decide_recovery(step: int, reports: list[StepReport], clips: bool, snapshot_every: int,
                    keeps_answers: bool) -> RecoveryDecision:
    """The decision for `step`, stopped on every shard (`reports`, shard order). `keeps_answers`: the step's
    answers are needed beside its update (see the module docstring)."""
    if all(r.complete for r in reports) and not keeps_answers:
        norms = [r.norm_sq for r in reports if r.norm_sq is not None]
        return RecoveryDecision(RecoveryAction.COMPLETED, step + 1, norm_sq=sum(norms) if norms else None)
    if clips or not any(r.touched for r in reports):
        return RecoveryDecision(RecoveryAction.REDONE, step)
    if snapshot_every == 0:
        raise ClusterLostError(
            f"a worker was lost in step {step} after some units were updated (optimizer.max_grad_norm=0 updates "
            "each unit as its gradient lands); the run restarts from the newest checkpoint "
            "(cluster.snapshot_every > 0 recovers in memory instead, at 12 B/param more per node)")
    # Every shard with a trained unit took its snapshot at the same step; one of frozen units alone takes none.
    snapshot = next(r.snapshot_step for r in reports if r.snapshot_step is not None)
    return RecoveryDecision(RecoveryAction.RESTORED, snapshot, restore_snapshot=True)
