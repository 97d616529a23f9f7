"""Callbacks that connect the loop to checkpoints (local/S3) and MLflow."""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Any

import torch

from mt_ray.config.identity import RunIdentity, changed_keys
from mt_ray.errors import ConfigError
from mt_ray.tracking import CheckpointManager, MlflowTracker
from mt_ray.training.callbacks import Callback, ResumePoint
from mt_ray.training.run_dir import ANOTHER_NAME, EXPORT_DIR, check_same_run

if TYPE_CHECKING:
    from mt_ray.training.trainer import Trainer


def trainer_state(trainer: Trainer) -> dict[str, Any]:
    """The loop's own state, JSON-able: data position and RNG, so a resume is exact."""
    return {
        "loader": trainer.loader.state_dict(),
        "torch_rng": base64.b64encode(torch.random.get_rng_state().numpy().tobytes()).decode(),
        "history": trainer.history,
        "eval_history": trainer.eval_history,
    }


def restore_trainer_state(trainer: Trainer, state: dict[str, Any]) -> None:
    trainer.loader.load_state_dict(state["loader"])
    rng = torch.frombuffer(bytearray(base64.b64decode(state["torch_rng"])), dtype=torch.uint8)
    torch.random.set_rng_state(rng)
    trainer.history = list(state["history"])
    trainer.eval_history = list(state.get("eval_history", []))  # absent in checkpoints older than evaluation


class CheckpointCallback(Callback):
    """Saves every `every_steps` (and at the end); resumes as `training.resume` says (see `maybe_resume`)."""

    def __init__(self, manager: CheckpointManager):
        self.manager = manager
        self.last_uri: str | None = None

    def maybe_resume(self, trainer: Trainer, mode: str) -> ResumePoint | None:
        """`auto`: this run's newest valid checkpoint, if it has one; `never`: none, and a run that has some is
        refused rather than mixed with them; otherwise the checkpoint at that URI (e.g. another run's, to fork it)."""
        latest = self.manager.latest()
        if mode == "never":
            if latest is not None:
                raise ConfigError(f"training.resume: never, but run '{trainer.run.name}' already has checkpoints "
                                  f"(newest {latest}); continue it with training.resume=auto, give this one {ANOTHER_NAME}, "
                                  f"or delete {trainer.run.uri}")
            return None
        if mode == "auto" and latest is None:
            return None
        if mode != "auto":
            check_same_model(self.manager.read_meta(mode), trainer.run.identity, mode)
        # A single engine's buffers are filled in place; a cluster's shards each read their own range.
        meta = trainer.engine.restore_checkpoint(self.manager, None if mode == "auto" else mode)
        uri = self.manager.uri_of(meta["step"]) if mode == "auto" else mode
        if mode == "auto":  # a run's own folder holds only its own checkpoints, unless copied in by hand
            check_same_run(saved_identity(meta, uri), trainer.run.identity, uri)
            self.last_uri = uri
        restore_trainer_state(trainer, meta["trainer"])
        if meta.get("run") == trainer.run.identity.to_json():
            for cb in trainer.callbacks:  # the same run: its MLflow run and the like carry on
                if (state := meta.get("callbacks", {}).get(type(cb).__name__)) is not None:
                    cb.load_state_dict(state)
        return ResumePoint(uri, meta["step"])

    def on_step_end(self, trainer: Trainer, step: int) -> None:
        if self.manager.config.should_save(step):
            self.save(trainer)

    def on_train_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        if self.last_uri is None or not self.last_uri.rstrip("/").endswith(f"{trainer.step:08d}"):
            self.save(trainer)
        summary["checkpoint"] = self.last_uri

    def save(self, trainer: Trainer) -> None:
        states = {type(cb).__name__: state for cb in trainer.callbacks if (state := cb.state_dict()) is not None}
        meta = {"trainer": trainer_state(trainer), "run": trainer.run.identity.to_json(), "callbacks": states}
        self.last_uri = trainer.engine.save_checkpoint(self.manager, trainer.step, meta)
        for cb in trainer.callbacks:
            cb.on_checkpoint(trainer, self.last_uri)


def saved_identity(meta: dict[str, Any], uri: str) -> RunIdentity:
    if "run" not in meta:
        raise ConfigError(f"checkpoint {uri} records no run identity (an older mt-ray wrote it); start from it "
                          f"explicitly with training.resume={uri}")
    return RunIdentity.from_json(meta["run"])


def check_same_model(meta: dict[str, Any], identity: RunIdentity, uri: str) -> None:
    """A checkpoint another run wrote must hold this run's model; refuse with the model keys that differ."""
    if "run" not in meta:
        return  # nothing to compare; a wrong size still fails when the tensors load
    saved = RunIdentity.from_json(meta["run"])
    model_keys = [line for line in changed_keys(saved.keys, identity.keys) if line.startswith("model.")]
    if model_keys:
        raise ConfigError(f"training.resume: {uri} holds run '{saved.name}', a different model:\n  "
                          + "\n  ".join(model_keys) + "\nResume from a checkpoint of this model.")


class MlflowCallback(Callback):
    """One MLflow run per training run: config, metrics, summary, loss plot, exported model, and a GRPO run's
    completions tables.

    Its run id goes into every checkpoint, so a resumed run continues the same MLflow run.
    """

    def __init__(self, tracker: MlflowTracker):
        self.tracker = tracker
        self.resume_run_id: str | None = None

    def state_dict(self) -> dict[str, Any] | None:
        return {"run_id": self.tracker.run_id} if self.tracker.active else None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.resume_run_id = state.get("run_id")

    def on_train_start(self, trainer: Trainer) -> None:
        cfg, run = trainer.cfg, trainer.run
        self.tracker.start(cfg.model_dump(mode="json"), model=cfg.model.path or cfg.model.preset,
                           dataset=",".join(cfg.data.datasets), resume_run_id=self.resume_run_id,
                           tags={"mt_ray.run_name": run.name, "mt_ray.fingerprint": run.identity.fingerprint,
                                 "mt_ray.run_dir": run.uri})
        if trainer.resumed_from is not None:
            self.tracker.log_resume(trainer.resumed_from.uri, trainer.resumed_from.step)

    def on_log(self, trainer: Trainer, step: int, metrics: dict[str, float]) -> None:
        if step > self.tracker.logged_until:  # a resume's replay of steps the run logged before: once is enough
            self.tracker.log_metrics(step, metrics)

    def on_evaluate(self, trainer: Trainer, step: int, metrics: dict[str, float]) -> None:
        if step > self.tracker.logged_until:
            self.tracker.log_metrics(step, metrics)

    def on_step_end(self, trainer: Trainer, step: int) -> None:
        """GRPO: every `grpo.log_completions_every` steps, the completions the step trained on as a table."""
        every = trainer.cfg.grpo.log_completions_every
        if trainer.cfg.training.stage == "grpo" and every and step % every == 0:
            self.tracker.log_table(trainer.loader.completions_table(step), f"completions/step-{step:08d}.json")

    def on_checkpoint(self, trainer: Trainer, uri: str) -> None:
        self.tracker.log_checkpoint_uri(uri)

    def on_train_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        self.tracker.log_summary(summary)
        self.tracker.log_loss_plot([h["step"] for h in trainer.history], [h["loss"] for h in trainer.history])
        if summary.get("exported_model"):
            summary["mlflow_model"] = self.tracker.log_hf_model(trainer.run.staging / EXPORT_DIR, step=trainer.step)
        self.tracker.close("FINISHED")
