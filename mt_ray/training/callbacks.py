"""Hooks the training loop calls: tracking, checkpoints and progress hang off these."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


class Trainer(Protocol):
    """What a callback may read of the trainer that calls it (`mt_ray.training.trainer.Trainer` is one); a
    protocol, so this module needs nothing of the trainer's and the two do not import each other."""

    cfg: Any  # the run's RunConfig, after auto-fit
    run: Any  # its RunDir
    engine: Any  # the TrainingBackend
    loader: Any
    callbacks: list[Callback]
    history: list[dict[str, float]]
    eval_history: list[dict[str, float]]
    resumed_from: ResumePoint | None
    step: int

    def request_stop(self, reason: str) -> None: ...


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a run continued from."""

    uri: str
    step: int


class Callback:
    """Override the hooks you need; each receives the trainer and plain Python values.

    `state_dict` is saved in every checkpoint under the callback's class name and handed back to
    `load_state_dict` when the same run resumes from it (the MLflow callback keeps its run id so).
    """

    def on_train_start(self, trainer: Trainer) -> None: ...

    def on_log(self, trainer: Trainer, step: int, metrics: dict[str, float]) -> None: ...

    def on_evaluate(self, trainer: Trainer, step: int, metrics: dict[str, float]) -> None: ...

    def on_step_end(self, trainer: Trainer, step: int) -> None: ...

    def on_checkpoint(self, trainer: Trainer, uri: str) -> None:
        """A checkpoint of the current step is complete at `uri`."""

    def on_train_end(self, trainer: Trainer, summary: dict[str, Any]) -> None: ...

    def state_dict(self) -> dict[str, Any] | None:
        """JSON-able state to keep in checkpoints; None: nothing."""
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
