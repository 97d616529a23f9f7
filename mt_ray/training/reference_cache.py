"""`pref.reference: precompute`: the reference's per-sequence log-probs, computed once per dataset and cached.

Before training (and before a resume restores the policy), the engine still holds the starting weights, which
are the reference. `compute_reference_logps` runs them forward over every training and eval sequence with the
engine's own `evaluate` (`sequence_logps`: no second layer loop; on the cluster, its workers') and keys each sequence's log-prob
sum by its tokens and labels: a sequence is its own document (positions restart, attention stays inside it), so
its sum does not depend on the row it is packed in, and every later epoch's packing finds it. Training then
holds no reference weights: `ReferenceLogps.attach` gives each batch its `ref_logps`.

The cache is one JSON file under the run's storage root, `reference_logps/<digest>.json`, named by the digest of
its key (the model and its starting weights, the compute dtype, the datasets' files, `data.max_seq_len` and
`data.template`) and holding the key itself: a run with the same key (a restart, or another run of the same
model and data) reads it; any change of the key computes and writes another.

KTO: a pair's sequences are the same in every epoch, but a KL twin (an example's prompt with the previous
example's response) follows the data order, which each epoch's shuffle and each packing window change. So a
KTO pass walks the run's own batches, `training.steps` of them, as a fresh loader of the same seed yields them
(a resume continues inside them), and its key adds what decides that order: the whole `data` section, the
seed, the rows per step and the step count. It costs a reference forward over every trained token, as
`stream` does, but training holds no reference weights.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import torch

from mt_ray.config.run import RunConfig
from mt_ray.data import build_dataloader, split_micro_batches
from mt_ray.data.loader import resolve_entries
from mt_ray.errors import DatasetError
from mt_ray.tracking.run_files import RunFiles
from mt_ray.training.backend import initial_weights

log = logging.getLogger(__name__)

CACHE_DIR = "reference_logps"


class ReferenceLogps:
    """Each sequence's reference log-prob sum, by `sequence_key`; `computed` says whether this run computed them."""

    def __init__(self, logps: dict[str, float], computed: bool):
        self.logps = logps
        self.computed = computed

    def attach(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`batch` with `ref_logps` [B, W]: each sequence slot's sum (0 where a row has no sequence)."""
        ref = torch.zeros(batch["seq_role"].shape, dtype=torch.float32)
        flat = ref.view(-1)
        for index, key in sequence_keys(batch):
            value = self.logps.get(key)
            if value is None:
                raise DatasetError("pref.reference: precompute: a sequence of this batch is not in the reference "
                                   "cache (the data changed under the same key?); delete the run storage's "
                                   f"{CACHE_DIR}/ folder to compute it again")
            flat[index] = value
        return {**batch, "ref_logps": ref}


def sequence_keys(batch: dict[str, torch.Tensor]) -> list[tuple[int, str]]:
    """(flat slot b * W + s, key) of each sequence of a batch: the digest of its tokens and labels."""
    roles, seg = batch["seq_role"], batch["segment_ids"]
    out = []
    for b in range(roles.shape[0]):
        for s in roles[b].nonzero().flatten().tolist():
            mask = seg[b] == s
            h = hashlib.sha256(batch["input_ids"][b][mask].numpy().tobytes())
            h.update(batch["labels"][b][mask].numpy().tobytes())
            out.append((b * roles.shape[1] + s, h.hexdigest()))
    return out


def cache_key(cfg: RunConfig) -> dict[str, Any]:
    """What the reference's log-probs depend on: model and starting weights, dtype, data files, length, template."""
    weights = initial_weights(cfg)
    data = cfg.data
    names = list(data.datasets) + list(data.eval_datasets or [])
    t = cfg.training
    entries = resolve_entries(data, names, t.stage)
    key = {
        "model": cfg.model.model_dump(mode="json"),
        "weights": weights if isinstance(weights, int) else _files_fingerprint(Path(weights), "*.safetensors"),
        "compute_dtype": cfg.engine.compute_dtype,
        "datasets": [{"name": e.name, "entry": repr(e), "files": _files_fingerprint(Path(e.path), "*")}
                     for e in entries],
        "max_seq_len": data.max_seq_len,
        "template": data.template,
    }
    if t.stage == "kto":  # its KL twins follow the data order: the batches of this run
        key["order"] = {"data": data.model_dump(mode="json"), "seed": t.seed, "steps": t.steps,
                        "rows_per_step": t.micro_batch_size * t.grad_accum_steps}
    return key


def _files_fingerprint(path: Path, pattern: str) -> list[list]:
    files = [path] if path.is_file() else sorted(p for p in path.rglob(pattern) if p.is_file())
    return [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in files]


def load_or_compute(cfg: RunConfig, files: RunFiles, engine, tokenizer, held_out,
                    eval_batches: list[dict[str, torch.Tensor]]) -> ReferenceLogps:
    """The cached log-probs of this key, else computed with `engine`'s current (starting) weights and written."""
    key = cache_key(cfg)
    name = f"{CACHE_DIR}/{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]}.json"
    text = files.read_text(name)
    if text is not None:
        stored = json.loads(text)
        if stored.get("key") == key:
            log.info("reference log-probs read from %s (%d sequences)", name, len(stored["logps"]))
            return ReferenceLogps(stored["logps"], computed=False)
        log.warning("%s holds another key; computing the reference log-probs again", name)
    logps = compute_reference_logps(cfg, engine, tokenizer, held_out, eval_batches)
    files.write_text(name, json.dumps({"key": key, "logps": logps}))  # written whole, then renamed
    log.info("reference log-probs of %d sequences computed and written to %s", len(logps), name)
    return ReferenceLogps(logps, computed=True)


def compute_reference_logps(cfg: RunConfig, engine, tokenizer, held_out,
                            eval_batches: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """One forward-only pass of `engine`'s weights over every training sequence (a fresh loader, to the end of its
    first epoch's last window; KTO: the run's `training.steps` batches) and the eval split; each sequence's
    log-prob sum by its key."""
    t = cfg.training
    data = cfg.data.model_copy(update={"seed": t.seed})
    loader = build_dataloader(data, tokenizer, t.micro_batch_size, t.grad_accum_steps, held_out=held_out,
                              stage=t.stage)
    logps: dict[str, float] = {}

    def walked(steps: int) -> bool:
        return steps >= t.steps if t.stage == "kto" else loader.epoch >= 1 and loader.window_used_up

    steps = 0
    while not walked(steps):
        _record(engine, split_micro_batches(next(loader), t.micro_batch_size), logps)
        steps += 1
    for i in range(0, len(eval_batches), t.grad_accum_steps):
        _record(engine, eval_batches[i:i + t.grad_accum_steps], logps)
    return logps


def _record(engine, mbs: list[dict[str, torch.Tensor]], logps: dict[str, float]) -> None:
    for mb, s_S in zip(mbs, engine.sequence_logps(mbs), strict=True):
        values = s_S.cpu().tolist()  # waits for the device: once per micro-batch, before training
        for index, key in sequence_keys(mb):
            logps[key] = values[index]
