"""The sampling policy's token log-probs, kept for the ratio when a rollout is trained on more than once."""

from __future__ import annotations


def attach_old_logps(engine, batches: list[dict]) -> None:
    """Score `batches` (one step's micro-batches) with the engine's current weights, forward only, and attach each
    micro-batch's token log-probs (`old_logps`, left on the device) for the steps that train on it."""
    with engine.pref.collecting() as logps:
        engine.evaluate(batches)
    for batch, logp_N in zip(batches, logps, strict=True):
        batch["old_logps"] = logp_N
