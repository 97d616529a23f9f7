"""A scored rollout: the completions of one rollout batch with their rewards and advantages, as the steps train
on them, as the completions table shows them (`table`), and as a checkpoint keeps them (`state_dict`).

A checkpoint taken between the iterations of a rollout (`grpo.num_iterations` > 1) keeps it whole, with the
old policy's log-probs, so a resumed run trains its remaining iterations on the same completions as an
uninterrupted one: what the sampler drew cannot be drawn again once the weights have moved. Tensors travel as
base64 of their float32 bytes (exact, and compact in the checkpoint's JSON meta).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from mt_ray.training.grpo.rollout import Rollout


@dataclass
class ScoredRollout:
    """One rollout batch, scored: per completion (prompts repeated G times, in groups), its texts, each reward
    function's reward [B, F] (NaN where a function could not score it), its advantage [B], and TRL's metrics."""

    rollout: Rollout
    prompts: list[str]
    completions: list[str]
    rewards: torch.Tensor
    advantages: torch.Tensor
    metrics: dict[str, float]
    extra_columns: dict[str, list] = field(default_factory=dict)
    """Columns reward functions added to the completions table (TRL's `log_extra`)."""

    def table(self, step: int, names: list[str]) -> dict[str, list]:
        """The completions table of `step` (TRL's columns): step, prompt, completion, each reward function's
        reward under its name, and the advantage; one row per completion."""
        rewards = {name: self.rewards[:, f].tolist() for f, name in enumerate(names)}
        return {"step": [step] * len(self.completions), "prompt": self.prompts, "completion": self.completions,
                **rewards, "advantage": self.advantages.tolist(), **self.extra_columns}

    def state_dict(self, group: int, old_logps: list[torch.Tensor]) -> dict[str, Any]:
        """JSON-able: the rollout (each prompt's tokens once per group of `group`), texts, rewards, advantages,
        metrics, and each micro-batch's old log-probs."""
        r = self.rollout
        return {"prompt_ids": r.prompt_ids[::group], "completion_ids": r.completion_ids, "truncated": r.truncated,
                "prompts": self.prompts[::group], "completions": self.completions, "rewards": _pack(self.rewards),
                "advantages": _pack(self.advantages), "metrics": self.metrics,
                "old_logps": [_pack(t) for t in old_logps]}

    @classmethod
    def from_state(cls, state: dict[str, Any], group: int) -> tuple[ScoredRollout, list[torch.Tensor]]:
        """The scored rollout `state_dict` wrote, and its micro-batches' old log-probs."""
        prompt_ids = [p for p in state["prompt_ids"] for _ in range(group)]
        rollout = Rollout(prompt_ids, state["completion_ids"], state["truncated"])
        n = len(state["completion_ids"])
        scored = cls(rollout, [p for p in state["prompts"] for _ in range(group)], state["completions"],
                     _unpack(state["rewards"]).view(n, -1), _unpack(state["advantages"]), state["metrics"])
        return scored, [_unpack(t) for t in state["old_logps"]]


def _pack(t: torch.Tensor) -> str:
    """A float32 tensor's bytes as base64 (its shape is the reader's to know)."""
    return base64.b64encode(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()).decode()


def _unpack(text: str) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(base64.b64decode(text), dtype=np.float32).copy())
