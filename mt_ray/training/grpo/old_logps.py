"""The sampling policy's token log-probs, kept for the ratio when a rollout is trained on more than once.

The rollout's first step runs on the weights that sampled it, so the log-probs its head computes are the
old policy's: the backend keeps them (`kept_logps`: a single engine's head, or each data-parallel worker's for
its whole micro-batches, gathered by the driver in micro-batch order) and the steps after it read them from the
batch. No forward pass of its own, where TRL runs one before the first step (and where `sequence_logps` would
be one more pass over the rollout a step).
"""

from __future__ import annotations


def keep_old_logps(engine, batches: list[dict]) -> None:
    """Attach to `batches` (one step's micro-batches, just trained on for the first time) each one's token
    log-probs as that step computed them (`old_logps`; a single engine's are left on its device)."""
    logps = engine.kept_logps()
    if len(logps) != len(batches):
        raise ValueError(f"the engine kept the log-probs of {len(logps)} micro-batches for {len(batches)}: call this "
                         "right after the rollout's first step, with num_iterations above 1")
    for batch, logp_N in zip(batches, logps, strict=True):
        batch["old_logps"] = logp_N
