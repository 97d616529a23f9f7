"""Hooks the training loop calls: tracking, checkpoints and progress hang off these."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mt_ray.training.trainer import Trainer


class Callback:
    """Override the hooks you need; each receives the trainer and plain Python values."""

    def on_train_start(self, trainer: Trainer) -> None: ...

    def on_log(self, trainer: Trainer, step: int, metrics: dict[str, float]) -> None: ...

    def on_evaluate(self, trainer: Trainer, step: int, metrics: dict[str, float]) -> None: ...

    def on_step_end(self, trainer: Trainer, step: int) -> None: ...

    def on_train_end(self, trainer: Trainer, summary: dict[str, Any]) -> None: ...
