"""The loader's worker: step batches built in a background thread, a few steps ahead of the trainer.

Reading, tokenizing, packing and decoding images run here, never on the engine's thread, so a step
never waits for a JPEG. The position a checkpoint stores is the inner loader's state right after the
last batch handed out (captured by the worker with each batch), so resuming is exact although the
worker has read further.
"""

from __future__ import annotations

import contextlib
import copy
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from mt_ray.data.loader import StepLoader


@dataclass
class _Failed:
    error: BaseException


class BackgroundLoader:
    """`StepLoader`'s surface (iteration, `state_dict`, `load_state_dict`, `stats`, `epoch`) over a worker thread."""

    def __init__(self, loader: StepLoader, depth: int = 2):
        self.loader = loader
        self.depth = depth
        self._state = loader.state_dict()
        self._stats = loader.stats()
        self._start()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self

    def __next__(self) -> dict[str, Any]:
        item = self._queue.get()  # waits only when the worker is behind the trainer
        if isinstance(item, _Failed):
            raise item.error
        batch, self._state, self._stats = item
        return batch

    @property
    def epoch(self) -> int:
        return self.loader.epoch

    def stats(self) -> dict[str, Any]:
        """The inner loader's counts as of the last batch handed out (not the batches read ahead)."""
        return copy.deepcopy(self._stats)

    def state_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self._state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.close()
        self.loader.load_state_dict(state)
        self._state = self.loader.state_dict()
        self._stats = self.loader.stats()
        self._start()

    def close(self) -> None:
        """Stop the worker (it finishes the batch it is building)."""
        self._stop.set()
        while self._thread.is_alive():
            with contextlib.suppress(queue.Empty):
                self._queue.get_nowait()  # make room, so a worker blocked on a full queue sees the stop
            self._thread.join(timeout=0.05)

    def _start(self) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=self.depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mt-ray-loader", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                item = (next(self.loader), self.loader.state_dict(), self.loader.stats())
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as e:  # handed to the trainer's thread by __next__
            self._queue.put(_Failed(e))
