"""Which coordinator shard owns which units: the model cut into contiguous, balanced parts.

Each node of a data-parallel run has one coordinator shard holding the fp32 master weights and
Adam moments of its part of the model. Parts are contiguous runs of units in model order, so a
shard's state is one contiguous range of each of the single engine's flat buffers (frozen units,
a frozen vision tower's, have no moments: they take room in the master only): a checkpoint is
written as one piece per range, in the single engine's format, and read back by any other cut.
"""

from __future__ import annotations

from dataclasses import dataclass

from mt_ray.models.discovery import ModelSpec, UnitSpec


@dataclass(frozen=True)
class ShardPlan:
    """The cut of `spec`'s units over `num_shards` shards."""

    parts: tuple[tuple[UnitSpec, ...], ...]
    owners: dict[str, int]  # unit name -> shard

    @classmethod
    def build(cls, spec: ModelSpec, num_shards: int) -> ShardPlan:
        """Contiguous parts whose largest state is as small as a greedy cut can make it (one unit at least)."""
        units = list(spec.units)
        if num_shards > len(units):
            raise ValueError(f"{num_shards} shards but only {len(units)} units to share out")
        parts: list[tuple[UnitSpec, ...]] = []
        start, left = 0, sum(state_cost(u) for u in units)
        for s in range(num_shards):
            shards_left = num_shards - s
            target, end, size = left / shards_left, start, 0
            # Take units until this part reaches its fair share, leaving a unit for every later shard.
            while end < len(units) - (shards_left - 1) and (end == start or size + state_cost(units[end]) / 2 <= target):
                size += state_cost(units[end])
                end += 1
            if shards_left == 1:
                end = len(units)
                size = sum(state_cost(u) for u in units[start:])
            parts.append(tuple(units[start:end]))
            start, left = end, left - size
        return cls(tuple(parts), {u.name: s for s, part in enumerate(parts) for u in part})

    @property
    def num_shards(self) -> int:
        return len(self.parts)

    def owner(self, unit: str) -> int:
        return self.owners[unit]

    def units_of(self, shard: int) -> list[UnitSpec]:
        return list(self.parts[shard])

    def ranges(self, moments: bool = False) -> list[tuple[int, int]]:
        """Each shard's [start, end) in the single engine's flat master buffer (`moments`: in its moment
        buffers, which hold the trained units only)."""
        out, start = [], 0
        for part in self.parts:
            end = start + sum(u.numel for u in part if not (moments and u.frozen))
            out.append((start, end))
            start = end
        return out

    def flat_ranges(self) -> dict[str, list[tuple[int, int]]]:
        """Each of a checkpoint's flat tensors (`HostStore.flat_state`'s names): every shard's [start, end) in it."""
        moments = self.ranges(moments=True)
        return {"master": self.ranges(), "exp_avg": moments, "exp_avg_sq": moments}


def state_cost(unit: UnitSpec) -> int:
    """Host bytes of a unit's fp32 state: master and both moments, or the master alone when frozen."""
    return unit.numel * (4 if unit.frozen else 12)

