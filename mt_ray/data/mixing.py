"""Mixes several dataset sources into one endless stream of examples.

Strategies follow LLaMA-Factory's ``mix_strategy``: ``concat`` reads the datasets one
after another; ``interleave_under`` picks a dataset per example by weight and starts a
new epoch of every dataset as soon as any runs out; ``interleave_over`` picks the same
way but restarts only the dataset that ran out. The weighted picks come from blocks of
draws seeded by ``(seed, block)``, so the state is just a draw count.
"""

from __future__ import annotations

import random
from typing import Any

from mt_ray.data.config import MixStrategy
from mt_ray.data.schema import Example
from mt_ray.data.sources import DatasetSource
from mt_ray.errors import ConfigError

_DRAW_BLOCK = 1024


class Mixer:
    """An endless, deterministic, resumable stream of examples from several sources."""

    def __init__(self, sources: list[DatasetSource], weights: list[float] | None, strategy: MixStrategy,
                 seed: int):
        self.sources = sources
        self.weights = weights or [1.0] * len(sources)
        self.strategy = strategy
        self.seed = seed
        self.draws = 0
        self.current = 0
        self._draw_block: tuple[int, list[int]] | None = None

    @property
    def epoch(self) -> int:
        """Completed passes: the fewest epochs any source has finished."""
        return min(s.state.epoch for s in self.sources)

    def next(self) -> Example:
        """The next example of the mixed stream (never runs out: epochs repeat)."""
        while True:
            index = self.current if self.strategy == "concat" else self._draw()
            example = self.sources[index].next()
            if example is not None:
                return example
            self._on_exhausted(index)

    def _on_exhausted(self, index: int) -> None:
        if self.strategy == "interleave_over":
            self.sources[index].new_epoch()
        elif self.strategy == "interleave_under" or index == len(self.sources) - 1:
            for source in self.sources:
                source.new_epoch()
            self.current = 0
        else:
            self.current = index + 1

    def _draw(self) -> int:
        block, offset = divmod(self.draws, _DRAW_BLOCK)
        if self._draw_block is None or self._draw_block[0] != block:
            rng = random.Random(f"mix/{self.seed}/{block}")
            picks = rng.choices(range(len(self.sources)), weights=self.weights, k=_DRAW_BLOCK)
            self._draw_block = (block, picks)
        self.draws += 1
        return self._draw_block[1][offset]

    def state_dict(self) -> dict[str, Any]:
        return {"draws": self.draws, "current": self.current,
                "sources": [s.state_dict() for s in self.sources]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["sources"]) != len(self.sources):
            raise ConfigError(f"data loader state holds {len(state['sources'])} datasets, but data.datasets "
                              f"names {len(self.sources)}: resume with the config the state was saved with")
        self.draws, self.current = state["draws"], state["current"]
        for source, source_state in zip(self.sources, state["sources"], strict=True):
            source.load_state_dict(source_state)
