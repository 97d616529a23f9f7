"""What the Trainer drives: one `StreamingEngine` in this process, or a `DataParallelTrainer` on Ray.

Both train one global batch per `train_step` and own the fp32 state (here, or on the cluster's
coordinator shards), with the same checkpoint format; the Trainer, its checkpoints and its tracking
see only `TrainingBackend`, so a run switches between them with `cluster.num_workers` alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from transformers import GenerationConfig

from mt_ray.config.run import RunConfig
from mt_ray.engine import EvalResult, StepResult, StreamingEngine
from mt_ray.models.discovery import ModelSpec
from mt_ray.training.auto_fit import rollout_placement
from mt_ray.training.model_source import pretrained_weights

if TYPE_CHECKING:
    from mt_ray.tracking import CheckpointManager


class TrainingBackend(Protocol):
    """The training surface `StreamingEngine` and `DataParallelTrainer` share."""

    step_idx: int
    """Optimizer steps taken (the next step's index)."""

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> StepResult:
        """One optimizer step over a global batch; loss and norm are read only when logging."""

    def evaluate(self, micro_batches: list[dict[str, torch.Tensor]]) -> EvalResult:
        """Summed loss of `micro_batches` under the current weights: forward only, nothing changes."""

    def sequence_logps(self, micro_batches: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """A preference stage's sequence log-prob sums of each micro-batch under the current weights (forward only)."""

    def kept_logps(self) -> list[torch.Tensor]:
        """GRPO: each micro-batch's token log-probs as the last step computed them (the rollout's old policy's)."""

    def synchronize(self) -> None:
        """Wait until every update so far is in the master weights."""

    def save_checkpoint(self, manager: CheckpointManager, step: int, extra_meta: dict) -> str:
        """Write the fp32 state (the single engine's checkpoint format) and meta; returns the URI."""

    def restore_checkpoint(self, manager: CheckpointManager, uri: str | None = None) -> dict:
        """Continue exactly from a checkpoint (`uri`, or the newest valid one); returns its meta."""

    def export(self, out_dir: str | Path, tokenizer=None, dtype: torch.dtype = torch.float32,
               extra_files: tuple[Path, ...] = (), generation: GenerationConfig | None = None) -> Path:
        """Write the master weights as a Hugging Face folder on this node, `extra_files` (processor files) copied in."""

    def memory_metrics(self) -> dict[str, float]:
        """Memory figures worth logging (peak host bytes per parameter, GPU memory where known)."""

    def close(self) -> None: ...


def initial_weights(cfg: RunConfig) -> int | str:
    """The folder to load pretrained weights from (see `pretrained_weights`), else the random-init seed."""
    folder = pretrained_weights(cfg)
    return folder if folder is not None else cfg.training.seed


def build_backend(cfg: RunConfig, spec: ModelSpec) -> TrainingBackend:
    """A single engine for `cluster.num_workers == 1`, else Ray workers and coordinator shards; weights loaded."""
    weights = initial_weights(cfg)
    steps = cfg.training.steps
    if cfg.cluster.num_workers > 1:
        from mt_ray.cluster import DataParallelTrainer  # Ray is needed only here

        return DataParallelTrainer(spec, cfg.engine, cfg.optimizer, cfg.cluster.num_workers, steps,
                                   cluster=cfg.cluster, weights=weights, stage=cfg.training.stage, pref=cfg.pref,
                                   grpo=cfg.grpo)
    rollout = cfg.rollout.model_copy(update={"placement": rollout_placement(cfg, spec)}) \
        if cfg.training.stage == "grpo" else None  # the copy the step's kept graphs make room for
    engine = StreamingEngine(spec, cfg.engine, cfg.optimizer, total_steps=steps, stage=cfg.training.stage,
                             pref=cfg.pref, grpo=cfg.grpo, rollout=rollout)
    if isinstance(weights, int):
        engine.load_random(seed=weights)
    else:
        engine.load_pretrained(weights)
    return engine
