"""What a run's summary counts of its data: the examples its steps trained, not those the loader read ahead.

The loader tokenizes a packing window of examples at a time and a background thread builds batches ahead of the
steps, so counts taken at the loader's position run ahead of training: a small dataset's window can span many
passes. Here each example is tagged as it is drawn (whether it was cut to `max_seq_len`), and counts as trained
when the row holding its first sequence is yielded; an example that leaves nothing to train counts with the next
one that does. The size of a pass is the number of examples drawn before the data started over.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Origin:
    """The examples a sequence stands for in the counts: itself (`cut` or not) and the untrainable ones before it."""

    cut: bool
    examples: int


@dataclass
class TrainedCounts:
    """Examples drawn per pass, and the examples (and cut examples) the yielded rows hold."""

    drawn: list[int] = field(default_factory=list)  # examples drawn in each pass, by pass
    trained: int = 0
    cut: int = 0
    _dropped: int = 0  # drawn since the last trainable example, with nothing to train

    def on_drawn(self, pass_index: int, trainable: bool, cut: bool) -> Origin | None:
        """Count an example drawn in pass `pass_index`; the `Origin` its first sequence carries, if it has one."""
        self.drawn += [0] * (pass_index + 1 - len(self.drawn))
        self.drawn[pass_index] += 1
        if not trainable:
            self._dropped += 1
            return None
        origin, self._dropped = Origin(cut, 1 + self._dropped), 0
        return origin

    def on_yielded(self, origin: Origin) -> None:
        self.trained += origin.examples
        self.cut += origin.cut

    def epochs(self) -> float | None:
        """Passes over the data the trained examples make (2 decimals); None until a whole pass has been read."""
        size = self.drawn[0] if len(self.drawn) > 1 else None
        return round(self.trained / size, 2) if size else None

    def drawn_state(self) -> dict[str, Any]:
        """What rebuilding a window from its start draws again: the draw counts (and the untrainable ones pending)."""
        return {"drawn": list(self.drawn), "dropped": self._dropped}  # a list: JSON keeps it as it is (checkpoints)

    def load_drawn_state(self, state: dict[str, Any]) -> None:
        self.drawn = list(state.get("drawn", []))
        self._dropped = state.get("dropped", 0)

    def trained_state(self) -> dict[str, int]:
        return {"trained": self.trained, "cut": self.cut}

    def load_trained_state(self, state: dict[str, int]) -> None:
        self.trained, self.cut = state.get("trained", 0), state.get("cut", 0)
