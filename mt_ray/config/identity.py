"""A run's identity: its name and a fingerprint of the config keys that change what it trains.

Two configs with the same fingerprint train the same weights (whatever the device, worker count
or logging cadence), so a run may resume only from checkpoints written under its own name with
its own fingerprint. The keys that count are listed in `TRAINING_KEYS`: the whole `model`, `data`
and `optimizer` sections and the loop's length, batch shape and seed, and for a preference stage
the stage and the `pref` section, for GRPO the stage and the `grpo` section but its logging cadence (an SFT
run's fingerprint is as before they existed). `engine`, `cluster`,
`checkpoint`, `tracking` and the rest of `training` say how or where the run computes and logs,
not what it learns, and may change across a resume.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mt_ray.config.run import RunConfig

TRAINING_KEYS = ("model", "data", "optimizer", "training.steps", "training.epochs", "training.micro_batch_size",
                 "training.grad_accum_steps", "training.seed")
PREFERENCE_KEYS = ("training.stage", "pref")
GRPO_KEYS = ("training.stage", "grpo")
LOGGING_KEYS = ("grpo.log_completions_every",)  # how often a run logs, not what it learns
# Keys added after runs were named: left out while unset, so an older run's fingerprint stays as it was.
UNSET_LEFT_OUT = ("training.epochs", "optimizer.warmup_ratio", "data.max_samples", "data.image_max_pixels",
                  "data.image_min_pixels")
_UNSAFE = re.compile(r"[^A-Za-z0-9._+=-]+")


@dataclass(frozen=True)
class RunIdentity:
    """Who a run is: `name` (its folder under the storage root), `fingerprint`, and the keys it hashes."""

    name: str
    fingerprint: str
    keys: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunIdentity:
        return cls(name=data["name"], fingerprint=data["fingerprint"], keys=dict(data["keys"]))


def run_identity(cfg: RunConfig) -> RunIdentity:
    """The run's identity; its name is `training.run_name`, else generated from the model, data and fingerprint."""
    keys = training_keys(cfg)
    fingerprint = hashlib.sha256(json.dumps(keys, sort_keys=True).encode()).hexdigest()[:8]
    return RunIdentity(cfg.training.run_name or generated_name(cfg, fingerprint), fingerprint, keys)


def training_keys(cfg: RunConfig) -> dict[str, Any]:
    """`TRAINING_KEYS` as flat dotted keys with their JSON values, e.g. `{"data.max_seq_len": 256, ...}`."""
    flat = _flatten(cfg.model_dump(mode="json"))
    stage = cfg.training.stage
    counted = TRAINING_KEYS + {"sft": (), "grpo": GRPO_KEYS}.get(stage, PREFERENCE_KEYS)
    return {k: v for k, v in flat.items()
            if any(k == p or k.startswith(p + ".") for p in counted) and k not in LOGGING_KEYS
            and not (k in UNSET_LEFT_OUT and v is None)}


def generated_name(cfg: RunConfig, fingerprint: str) -> str:
    """`<model>-<datasets>-<fingerprint>`, e.g. `tiny-demo_alpaca+demo_sharegpt-1a2b3c4d`: readable and unique."""
    model = (Path(cfg.model.path).name if cfg.model.path else cfg.model.preset or "model")[:48]
    names = cfg.data.datasets
    data = "+".join(names) if len("+".join(names)) <= 40 else f"{names[0][:32]}+{len(names) - 1}"
    return _UNSAFE.sub("_", f"{model}-{data}-{fingerprint}").lstrip("._+=-")


def changed_keys(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """One line per key whose value differs, e.g. `data.max_seq_len: 256 -> 512`, sorted by key."""
    missing = "(unset)"
    return [f"{k}: {_show(old.get(k, missing))} -> {_show(new.get(k, missing))}"
            for k in sorted(old.keys() | new.keys()) if old.get(k, missing) != new.get(k, missing)]


def _show(value: Any) -> str:
    return value if value == "(unset)" else json.dumps(value)


def _flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
