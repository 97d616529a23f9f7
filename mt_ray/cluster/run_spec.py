"""What every actor of a run is built from, decided once by the driver: the run (`RunSpec`) and each node
(`NodePlan`, with its arena's layout).

The driver resolves what an actor could otherwise decide differently (the compute dtype of `auto`, the ring's
size), computes each node's `ArenaLayout` once and hands these objects to the node's coordinator shard, its workers
and anything else that maps the arena (GRPO's rollout replicas, through `ArenaHandle`, which carries the layout).
No actor rebuilds a layout or reads a config from a dict.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mt_ray.cluster.arena import ArenaLayout
from mt_ray.cluster.partition import ShardPlan
from mt_ray.engine.config import EngineConfig, OptimizerConfig
from mt_ray.engine.grpo import GrpoConfig
from mt_ray.engine.preference import PreferenceConfig
from mt_ray.models.discovery import ModelSpec, discover
from mt_ray.models.vision import VISION_EMBED, VISION_PROJECTOR


@dataclass(frozen=True)
class RunSpec:
    """The model and the configs every actor of the run shares."""

    model: Any  # what `discover` takes: the driver's transformers config
    freeze: dict[str, bool]  # the `discover` options the driver's spec was found with (image-text freeze flags)
    engine: EngineConfig  # its compute dtype resolved by the driver (never `auto`)
    optimizer: OptimizerConfig
    total_steps: int
    num_nodes: int
    stage: str = "sft"
    pref: PreferenceConfig = field(default_factory=PreferenceConfig)
    grpo: GrpoConfig = field(default_factory=GrpoConfig)

    def discover(self) -> ModelSpec:
        """The model's spec, found as the driver found it."""
        return discover(self.model, **self.freeze)


@dataclass(frozen=True)
class RolloutBeside:
    """What shares each worker's GPU with its rollout replica: `rows` completions (0: none beside it) of up to
    `tokens` tokens, placed as `placement` (`rollout.placement`), beside steps of `n_micro` micro-batches of
    `micro_batch` rows."""

    rows: int
    tokens: int
    placement: str
    micro_batch: int
    n_micro: int


@dataclass(frozen=True)
class NodePlan:
    """One node of the run: its shard's index, its workers and the layout of its arena."""

    node: int
    workers: int  # workers placed on the node
    layout: ArenaLayout  # computed once by the driver; `layout.num_local` workers land gradients in it

    @property
    def landers(self) -> int:
        """Workers of the node whose gradients land in its arena (one where the GPUs sum them between them)."""
        return self.layout.num_local

    def local_rank(self, rank: int) -> int:
        """Where run-wide worker `rank` lands its gradients on its node (0: the slots and the pool; else a ring)."""
        return rank % self.landers


def plan_nodes(spec: ModelSpec, plan: ShardPlan, engine: EngineConfig, workers_per_node: int, landers: int,
               ring: int, reference: bool) -> list[NodePlan]:
    """Every node's plan: its arena laid out for `landers` landing workers, rings of `ring` elements, the
    `reference` where the stage streams one, in the engine's (resolved) compute and gradient dtypes."""
    return [NodePlan(node, workers_per_node,
                     ArenaLayout.build(spec, plan, node, engine.dtype, engine.grad_torch_dtype, landers, ring,
                                       reference))
            for node in range(plan.num_shards)]


def freeze_options(spec: ModelSpec) -> dict[str, bool]:
    """The `discover` options that find `spec` again in an actor: an image-text model's freeze flags."""
    if spec.vision is None:
        return {}
    return {"freeze_vision_tower": spec.unit(VISION_EMBED).frozen,
            "freeze_multi_modal_projector": spec.unit(VISION_PROJECTOR).frozen}
