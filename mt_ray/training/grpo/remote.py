"""GRPO on the Ray cluster: the rollout actor, placed beside the engine workers as VERL lays them out.

The engine workers only train. The rollout actor holds the policy's copy for generation (the single engine's
`PolicyCopy`, transformers' `generate`: no second decoder) on a GPU of node 0 (half of the first worker's by
default, `cluster.rollout_gpus`; the CPU beside CPU workers). Before each rollout it refreshes the copy from
node 0's shared-memory arena, the weights the workers stream (the shard's fp32 master; other nodes' units in
the compute dtype), once every unit's version word says the last step's update is in: nothing model-sized goes
through Ray's object store. The driver sends it prompt tokens and gets completion tokens back; rewards and
advantages are scored on the driver as on a single engine.
"""

from __future__ import annotations

import ray
import torch

from mt_ray.cluster.arena import ArenaAccess
from mt_ray.engine.config import EngineConfig
from mt_ray.engine.grpo import GrpoConfig
from mt_ray.engine.host_store import unit_views
from mt_ray.engine.pinning import register_pinned
from mt_ray.training.grpo.rollout import Rollout, build_copy, generation_eos


class RolloutActor:
    """A Ray actor: the policy's copy for generation, refreshed from its node's arena."""

    def __init__(self, access: ArenaAccess, engine_cfg: dict, rows: int, tokens: int, placement: str = "auto"):
        """`access`: the node's arena; `engine_cfg`: the run's (its device and compute dtype); a copy sized for
        `rows` completions of up to `tokens` tokens, placed as `placement` (`rollout.placement`; auto: resident
        where the whole copy fits the GPU's free memory beside the worker, else streamed), refused where even
        that cannot fit."""
        spec, self.arena = access.attach()
        cfg = EngineConfig(**engine_cfg)
        device = cfg.resolve_device()
        if device.type == "cuda":  # page-locked for the actor's life, as the workers do: each refresh's uploads
            register_pinned(self.arena.bytes)  # are then DMAs from the arena (the mapping goes with the process)
        self.copy = build_copy(spec, cfg, device, rows, tokens, placement)
        self.units = spec.units

    def refresh(self, step: int, generation: int, timeout_s: float) -> float:
        """Load the weights after `step` steps, once each unit's update is in; the copy's seconds."""
        state: dict[str, torch.Tensor] = {}
        for unit in self.units:
            self.arena.wait_version(unit.name, step, generation, timeout_s)
            state.update(unit_views(unit, self.arena.weights(unit.name)))
        return self.copy.refresh(state)

    def generate(self, prompt_ids: list[list[int]], cfg: GrpoConfig, eos_ids: set[int], pad_id: int,
                 seed: int) -> Rollout:
        return self.copy.generate(prompt_ids, cfg, eos_ids, pad_id, seed)

    def generation_eos(self) -> list[int]:
        return generation_eos(self.copy.model)


class RemoteSampler:
    """`LocalSampler`'s surface over a rollout actor placed by the data-parallel trainer (`rollout_options`)."""

    def __init__(self, trainer, rows: int, tokens: int, placement: str = "auto"):
        self.trainer = trainer
        self.actor = ray.remote(RolloutActor).options(**trainer.rollout_options()).remote(
            trainer.arena_access(0), trainer.engine_cfg.model_dump(), rows, tokens, placement)

    def refresh(self) -> float:
        """The actor's copy of the weights after every step so far (it waits for their updates in the arena)."""
        t = self.trainer
        return ray.get(self.actor.refresh.remote(t.step_idx, t.generation, t.weights_timeout_s))

    def generate(self, prompt_ids: list[list[int]], cfg: GrpoConfig, eos_ids: set[int], pad_id: int,
                 seed: int) -> Rollout:
        return ray.get(self.actor.generate.remote(prompt_ids, cfg, eos_ids, pad_id, seed))

    def generation_eos(self) -> list[int]:
        return ray.get(self.actor.generation_eos.remote())

    def close(self) -> None:
        """End the actor: its copy, its mapping and its page-locking go with its process."""
        ray.kill(self.actor, no_restart=True)
