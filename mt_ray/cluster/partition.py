"""Which coordinator shard owns which units: the model cut into contiguous, balanced parts.

Each node of a data-parallel run has one coordinator shard holding the fp32 master weights and
Adam moments of its part of the model. Parts are contiguous runs of units in model order, so a
shard's state is one contiguous range of the single engine's flat buffers: a checkpoint is
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
        """Contiguous parts whose largest is as small as a greedy cut can make it (one unit at least)."""
        units = list(spec.units)
        if num_shards > len(units):
            raise ValueError(f"{num_shards} shards but only {len(units)} units to share out")
        parts: list[tuple[UnitSpec, ...]] = []
        start, left = 0, sum(u.numel for u in units)
        for s in range(num_shards):
            shards_left = num_shards - s
            target, end, size = left / shards_left, start, 0
            # Take units until this part reaches its fair share, leaving a unit for every later shard.
            while end < len(units) - (shards_left - 1) and (end == start or size + units[end].numel / 2 <= target):
                size += units[end].numel
                end += 1
            if shards_left == 1:
                end = len(units)
                size = sum(u.numel for u in units[start:])
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

    def ranges(self) -> list[tuple[int, int]]:
        """Each shard's [start, end) in the single engine's flat buffers."""
        out, start = [], 0
        for part in self.parts:
            end = start + sum(u.numel for u in part)
            out.append((start, end))
            start = end
        return out

