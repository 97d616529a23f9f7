"""Callbacks that connect the loop to checkpoints (local/S3) and MLflow."""

from __future__ import annotations

import base64
import logging
from typing import TYPE_CHECKING, Any

import torch

from mt_ray.tracking import CheckpointManager, MlflowTracker
from mt_ray.training.callbacks import Callback

if TYPE_CHECKING:
    from mt_ray.training.trainer import Trainer

log = logging.getLogger(__name__)


def trainer_state(trainer: Trainer) -> dict[str, Any]:
    """The loop's own state, JSON-able: data position and RNG, so a resume is exact."""
    return {
        "loader": trainer.loader.state_dict(),
        "torch_rng": base64.b64encode(torch.random.get_rng_state().numpy().tobytes()).decode(),
        "history": trainer.history,
    }


def restore_trainer_state(trainer: Trainer, state: dict[str, Any]) -> None:
    trainer.loader.load_state_dict(state["loader"])
    rng = torch.frombuffer(bytearray(base64.b64decode(state["torch_rng"])), dtype=torch.uint8)
    torch.random.set_rng_state(rng)
    trainer.history = list(state["history"])


class CheckpointCallback(Callback):
    """Saves every `every_steps` (and at the end); resumes from the newest valid checkpoint."""

    def __init__(self, manager: CheckpointManager):
        self.manager = manager
        self.last_uri: str | None = None

    def maybe_resume(self, trainer: Trainer, uri: str | None = None) -> bool:
        if uri is None and self.manager.latest() is None:
            return False
        meta = trainer.engine.restore_checkpoint(self.manager, uri)  # a single engine's buffers filled in place
        restore_trainer_state(trainer, meta["trainer"])
        log.info("resumed at step %d from %s", meta["step"], uri or self.manager.latest())
        return True

    def on_step_end(self, trainer: Trainer, step: int) -> None:
        if self.manager.config.should_save(step):
            self.save(trainer)

    def on_train_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        if self.last_uri is None or not self.last_uri.rstrip("/").endswith(f"{trainer.step:08d}"):
            self.save(trainer)
        summary["checkpoint"] = self.last_uri

    def save(self, trainer: Trainer) -> None:
        self.last_uri = trainer.engine.save_checkpoint(self.manager, trainer.step, {"trainer": trainer_state(trainer)})
        for cb in trainer.callbacks:
            if isinstance(cb, MlflowCallback):
                cb.tracker.log_checkpoint_uri(self.last_uri)


class MlflowCallback(Callback):
    """One MLflow run per training run: config, metrics, summary, loss plot, exported model."""

    def __init__(self, tracker: MlflowTracker):
        self.tracker = tracker

    def on_train_start(self, trainer: Trainer) -> None:
        cfg = trainer.cfg
        self.tracker.start(cfg.model_dump(mode="json"), model=cfg.model.path or cfg.model.preset,
                           dataset=",".join(cfg.data.datasets))

    def on_log(self, trainer: Trainer, step: int, metrics: dict[str, float]) -> None:
        self.tracker.log_metrics(step, metrics)

    def on_train_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        self.tracker.log_summary(summary)
        self.tracker.log_loss_plot([h["step"] for h in trainer.history], [h["loss"] for h in trainer.history])
        if summary.get("exported_model"):
            self.tracker.log_hf_model(summary["exported_model"])
        self.tracker.close("FINISHED")
