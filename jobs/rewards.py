"""Example user reward functions for `grpo.rewards` (`jobs.rewards:<name>`), with TRL's signature.

`digits` is what the GRPO demo's tiny random model can learn within minutes on a CPU: its completions
start as random tokens, and the share of digits in them varies enough within a group to rank them.
"""

from __future__ import annotations


def digits(prompts: list[str], completions: list[str], **_) -> list[float]:
    """The share of a completion's non-space characters that are digits."""
    out = []
    for text in completions:
        chars = [c for c in text if not c.isspace()]
        out.append(sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0)
    return out
