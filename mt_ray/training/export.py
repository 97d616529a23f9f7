"""`mt-ray export`: a checkpoint's fp32 master weights -> a Hugging Face folder, no engine needed."""

from __future__ import annotations

from pathlib import Path

from mt_ray.config.run import load_run_config
from mt_ray.data.mm_processor import processor_files
from mt_ray.engine.host_store import plan_layout
from mt_ray.errors import CheckpointError
from mt_ray.models.weights import export_hf
from mt_ray.tracking import CheckpointManager
from mt_ray.training.model_source import load_model_and_tokenizer
from mt_ray.training.run_dir import RunDir


def export_checkpoint(config_path: str, checkpoint: str | None, out: str) -> Path:
    """Export the given checkpoint (default: the run's newest valid one) of the configured model."""
    cfg = load_run_config(config_path)
    spec, tokenizer = load_model_and_tokenizer(cfg)
    manager = CheckpointManager(RunDir(cfg).checkpoint_config)
    if checkpoint is None and manager.latest() is None:
        raise CheckpointError(f"no checkpoint under {manager.config.uri}; train first or pass --checkpoint")
    tensors, _ = manager.load(checkpoint)
    layout = plan_layout(spec, None)
    master = tensors["master"]
    if master.numel() != layout.total:
        raise CheckpointError(f"checkpoint holds {master.numel()} parameters, the configured model {layout.total}")
    state = {}
    for unit in spec.units:
        off = layout.offsets[unit.name]
        for p in unit.params:
            state[p.hf_name] = master[off : off + p.numel].view(p.shape)
            off += p.numel
    extra = processor_files(cfg.model.path) if spec.vision is not None else ()
    return export_hf(spec, state, out, tokenizer, extra_files=extra)
