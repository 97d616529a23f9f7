"""The weights' ways in and out of a `StreamingEngine`: loading, exporting, and checkpointing them with the
optimizer state, between steps.

A base class of `StreamingEngine` rather than a part it holds: these are the engine's own public methods (the
trainers call `engine.save_checkpoint`, `engine.state_dict`, ...), and they share nothing with the step but the
host store, the optimizer worker and the step count, declared below.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import GenerationConfig

from mt_ray.engine.host_store import HostStore
from mt_ray.engine.optimizer import UnitOptimizer, counts_behind, restore_counts
from mt_ray.engine.optimizer_worker import OptimizerWorker
from mt_ray.engine.reference import PreferenceSteps
from mt_ray.engine.seams import GradSink
from mt_ray.models.discovery import ModelSpec
from mt_ray.models.weights import export_hf, init_random, load_safetensors


class WeightsIO:
    """Load, export and checkpoint the weights held in `store`; every method first lets pending updates land."""

    spec: ModelSpec
    device: torch.device
    store: HostStore | None
    optimizers: dict[str, UnitOptimizer]
    worker: OptimizerWorker | GradSink
    step_idx: int
    pref: PreferenceSteps | None
    _streams_reference: bool

    def synchronize(self) -> None:
        """Wait until every update of the steps run so far is in the master weights, and the host buffers hold the
        state of the units kept on the device (`engine.device_optimizer_units`)."""
        self.wait_for_updates()
        if self.store is not None:
            self.store.bring_home()

    def wait_for_updates(self) -> None:
        """Wait until every update of the steps run so far has run (where the units kept on the device are, the host
        buffers may still lag: `synchronize` brings them home)."""
        for unit in self.worker.unit_order:
            self.worker.wait_updated(unit, self.step_idx)

    def _written(self) -> None:
        """The host buffers were written (a load, a restore): the units kept on the device take their values."""
        if self.store is not None:
            self.store.send_out()

    def load_random(self, seed: int = 0) -> None:
        """Initialise weights as the family's `from_config` does (on the device when it is a GPU); they are a
        preference stage's reference, as all weights loaded below (a checkpoint restores the policy only)."""
        init_random(self.spec, self.store.load_named, seed, self.device)
        self._written()
        self._snapshot_reference()

    def load_pretrained(self, folder: str | Path) -> None:
        """Read a safetensors checkpoint folder straight into the host store."""
        load_safetensors(self.spec, folder, self.store.load_named)
        self._written()
        self._snapshot_reference()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy weights given by Hugging Face name (e.g. another model's state_dict) into the store."""
        self.synchronize()
        for unit in self.spec.units:
            self.store.load_named(unit, state)
        self._written()
        self._snapshot_reference()

    def load_reference(self, state: dict[str, torch.Tensor]) -> None:
        """Make `state` (by Hugging Face name) the preference stage's reference instead of the starting weights."""
        self.pref.reference.load_named(self.store, state)

    def _snapshot_reference(self) -> None:
        if self._streams_reference:
            self.pref.reference.snapshot(self.store.master)

    def export(self, out_dir: str | Path, tokenizer=None, dtype: torch.dtype = torch.float32,
               extra_files: tuple[Path, ...] = (), generation: GenerationConfig | None = None) -> Path:
        """Write the trained weights as a Hugging Face folder that `from_pretrained` loads (`extra_files`
        copied in: an image-text model's processor files)."""
        return export_hf(self.spec, self.state_dict(), out_dir, tokenizer, dtype, extra_files=extra_files,
                         generation=generation)

    def checkpoint_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """Everything a checkpoint needs: the flat fp32 master/moment buffers and the step.

        The tensors are the live buffers (no copies); call between steps. State on NVMe has no such buffers:
        `save_checkpoint` writes it from its files by range.
        """
        self.synchronize()
        return self.store.flat_state(), self._checkpoint_meta()

    def _checkpoint_meta(self) -> dict:
        meta = {"step": self.step_idx, "layout": self.store.layout.describe()}
        behind = counts_behind(self.optimizers, self.step_idx)
        return {**meta, "adam_counts": behind} if behind else meta

    def checkpoint_buffers(self) -> dict[str, torch.Tensor]:
        """The live buffers a checkpoint is read into in place, so a resume holds the state once."""
        return self.checkpoint_state()[0]

    def load_checkpoint_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        """Restore buffers and step from `checkpoint_state()` output, so training continues exactly."""
        self.synchronize()
        self.store.layout.check_matches(meta["layout"])
        self.store.load_flat_state(tensors)
        self._written()
        self._restore_step(meta)

    def _restore_step(self, meta: dict) -> None:
        restore_counts(self.optimizers, meta["step"], meta.get("adam_counts", {}))
        self.step_idx = meta["step"]
        self.worker.reset_versions(self.step_idx)

    def save_checkpoint(self, manager, step: int, extra_meta: dict) -> str:
        """Write the state through `manager` (a `CheckpointManager`); returns the checkpoint's URI. State on
        NVMe is read from its files a block at a time as the shards are written."""
        if not self.store.placement.on_disk:
            tensors, meta = self.checkpoint_state()
            return manager.save(step, tensors, {**meta, **extra_meta})
        self.synchronize()
        self.store.settle()
        return manager.save_ranges(step, self.store.flat_ranges(), {**self._checkpoint_meta(), **extra_meta})

    def restore_checkpoint(self, manager, uri: str | None = None) -> dict:
        """Read a checkpoint (`uri`, or the newest that verifies) into the live state; returns its meta. State on
        NVMe is written into its files one stored piece (at most `shard_bytes`) at a time."""
        if not self.store.placement.on_disk:
            tensors, meta = manager.load(uri, out=self.checkpoint_buffers())
            self.load_checkpoint_state(tensors, meta)
            return meta
        self.synchronize()
        self.store.settle()
        meta = manager.load_with(self._read_into_files, uri)
        self._restore_step(meta)
        return meta

    def _read_into_files(self, stored) -> dict:
        """Copy a stored checkpoint (`StoredCheckpoint`) into the state files, piece by piece."""
        self.store.layout.check_matches(stored.manifest.meta["layout"])
        for name in self.store.flat_parts():
            for piece in stored.manifest.tensors[name].pieces:
                buf = torch.empty(piece.numel, dtype=torch.float32)
                stored.read_range(name, piece.start, piece.start + piece.numel, buf)
                self.store.access_flat(name, piece.start, buf, write=True)
        return stored.manifest.meta

    def state_dict(self) -> dict[str, torch.Tensor]:
        """fp32 master weights by Hugging Face name, after all pending updates."""
        self.synchronize()
        return self.store.state_dict()

    def streamed_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights the layer loop uploads, by Hugging Face name, after all pending updates (views of the host
        copy in the compute dtype, or of the fp32 master where none is kept, on the device for a unit whose state
        is kept there): what a rollout copy loads."""
        self.wait_for_updates()
        return {k: v for unit in self.spec.units
                for k, v in self.store.named_views(unit, self.store.streamed_of(unit.name)).items()}
