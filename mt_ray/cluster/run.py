"""`run_data_parallel`: a whole data-parallel run in one call (the controller is `DataParallelTrainer`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from mt_ray.cluster.config import ClusterConfig
from mt_ray.cluster.driver import DataParallelResult, DataParallelTrainer
from mt_ray.cluster.errors import ClusterError
from mt_ray.cluster.split import Batch
from mt_ray.engine.config import EngineConfig, OptimizerConfig


def run_data_parallel(model, engine_cfg: EngineConfig, opt_cfg: OptimizerConfig,
                      batches: Iterable[Batch] | Callable[[], Iterable[Batch]], num_workers: int,
                      total_steps: int | None = None, weights: int | str | dict = 0,
                      cluster: ClusterConfig | None = None, return_state: bool = False,
                      export_dir: str | Path | None = None) -> DataParallelResult:
    """Train `model` data-parallel on `num_workers` engine workers (one per GPU, or CPU workers).

    model: a ModelSpec, a transformers config, a config dict with model_type, or a local folder.
    batches: global batches (each a list of micro-batches), or a factory returning them.
    weights: a random-init seed, a safetensors folder, or a state dict by Hugging Face name.
    Ray is started in-process unless already running, `cluster.address` is set, or RAY_ADDRESS is.
    """
    if callable(batches):
        batches = batches()
    if total_steps is None:
        if not hasattr(batches, "__len__"):
            raise ClusterError("total_steps is needed when the batches have no length (it sets the LR schedule)")
        total_steps = len(batches)
    trainer = DataParallelTrainer(model, engine_cfg, opt_cfg, num_workers, total_steps, cluster, weights)
    try:
        result = trainer.train(batches)
        if return_state:
            result.state_dict = trainer.state_dict()
        if export_dir is not None:
            trainer.export(export_dir)
        return result
    finally:
        trainer.close()
