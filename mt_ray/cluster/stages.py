"""What the training stages need from the cluster beyond SFT's: how a batch may split, and how the workers'
metric sums become the step's metrics.

A preference stage's pair shares one row, so any split between rows keeps it whole; KTO's KL estimate is over a
whole micro-batch's twins, and GRPO normalises its loss per micro-batch (grpo, bnpo, dr_grpo) and takes its clip
extremes per micro-batch, so those two stages give each worker whole micro-batches. No GRPO normaliser is per
group of G: the advantages are the driver's, computed over the whole rollout before the split.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from mt_ray.engine.grpo import GroupObjective, GrpoConfig
from mt_ray.engine.preference import Objective, PreferenceConfig, add_sums

# Stages whose loss reads a whole micro-batch: each worker gets whole micro-batches, as many as the split allows.
WHOLE_MICRO_BATCHES = ("kto", "grpo")


def stage_objective(stage: str, pref: PreferenceConfig, grpo: GrpoConfig) -> Objective | GroupObjective | None:
    """What turns the workers' metric sums into a stage's metrics: none for SFT."""
    if stage == "sft":
        return None
    return GroupObjective(grpo) if stage == "grpo" else Objective(stage, pref)


def summed_metrics(parts: Iterable[dict[str, float]]) -> dict[str, torch.Tensor]:
    """The workers' preference metric sums added up, key by key (in rank order)."""
    total: dict[str, torch.Tensor] = {}
    for part in parts:
        add_sums(total, {k: torch.tensor(v, dtype=torch.float64) for k, v in part.items()})
    return total
