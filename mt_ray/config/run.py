"""The run configuration: one typed object per section, loaded from YAML with key=value overrides.

Every section is owned by its component (EngineConfig by the engine, DataConfig by the data
pipeline, ...); this module only composes them and turns any validation failure into a
`ConfigError` whose message starts with the dotted key, e.g. `training.steps: ...`.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from mt_ray.cluster.config import ClusterConfig
from mt_ray.config.llamafactory import describe_mapping, is_llamafactory, translate
from mt_ray.data import DataConfig
from mt_ray.engine.config import EngineConfig, OptimizerConfig
from mt_ray.engine.grpo import GrpoConfig, RolloutConfig
from mt_ray.engine.preference import PreferenceConfig, check_stage
from mt_ray.errors import ConfigError
from mt_ray.tracking import CheckpointConfig, TrackingConfig
from mt_ray.tracking.ckpt_config import check_storage_uri

RUN_NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._+=-]{0,127}"


# Keys of the component configs that a run derives from its own identity and storage.
SET_BY_THE_RUN = {
    ("checkpoint", "uri"): "checkpoints go to <training.storage>/<run name>/checkpoints; set training.storage "
                           "(a folder or s3://bucket/prefix) instead",
    ("tracking", "run_name"): "the MLflow run is named after the run; set training.run_name instead",
}


# Where the embedded demo's defaults differ from the components' own.
DEMO_DEFAULTS: dict[str, dict[str, Any]] = {
    "data": {"max_seq_len": 256},
    "optimizer": {"lr": 1e-3, "warmup_steps": 5},
    "checkpoint": {"every_steps": 50},
}


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class ModelConfig(_Section):
    """Which model to train and where its weights and tokenizer come from."""

    preset: str | None = "tiny"
    """Built-in shape (`tiny`, `qwen2.5-7b`, ...; see `mt_ray.models.presets`) used when `path` is unset."""
    path: str | None = None
    """Local Hugging Face folder (config.json, safetensors, tokenizer); nothing is downloaded."""
    overrides: dict[str, Any] = Field(default_factory=dict)
    """Config fields to change, e.g. `{num_hidden_layers: 2}`."""
    init: Literal["auto", "random", "pretrained"] = "auto"
    """`auto`: pretrained weights when `path` holds safetensors, else random init."""
    tokenizer: str | None = None
    """Tokenizer folder; default: `path`, else the built-in tiny tokenizer."""
    freeze_vision_tower: bool = True
    """Image-text models: the vision tower (patch embedding, blocks, norms) is not trained: no Adam moments, no
    gradient, no update (LLaMA-Factory's option of the same name and default)."""
    freeze_multi_modal_projector: bool = False
    """Image-text models: the projector from the tower into the language model is not trained either
    (LLaMA-Factory's option of the same name and default)."""


class TrainingConfig(_Section):
    """Loop length, batch shape and outputs."""

    stage: Literal["sft", "dpo", "kto", "grpo"] = "sft"
    """What to train, as LLaMA-Factory names its stages: `sft` (supervised, on SFT and text datasets), `dpo`
    (preference pairs of ranking datasets, with `pref.loss`), `kto` (KTO on datasets with a kto_tag); or `grpo`
    (RL on completions sampled from the prompts of SFT datasets, scored by `grpo.rewards`)."""
    steps: int = Field(60, ge=1)
    """Optimizer steps to run."""
    epochs: float | None = Field(None, gt=0)
    """Passes over the data instead of `steps` (LLaMA-Factory's num_train_epochs): the run counts an epoch's rows
    (tokenized and packed, one pass before the first step) and runs ceil(epochs x ceil(ceil(rows /
    micro_batch_size) / grad_accum_steps)) steps, as transformers' Trainer does."""
    micro_batch_size: int = Field(4, ge=1)
    """Rows per micro-batch (what the device computes at once)."""
    grad_accum_steps: int = Field(2, ge=1)
    """Micro-batches per optimizer step; the loss is normalised over all of them."""
    seed: int = 0
    """Seed for weight init and data order."""
    log_every: int = Field(5, ge=1)
    """Read metrics from the device every N steps (reading forces a sync)."""
    eval_every: int | None = Field(None, ge=1)
    """Evaluate on the held-out split (`data.val_size` or `data.eval_datasets`) every N steps; a run with a split
    is always evaluated at its end."""
    run_name: str | None = None
    """The run's name and folder under `storage`; default: `<model>-<datasets>-<fingerprint of the training keys>`."""
    storage: str = "runs"
    """Storage root: a folder (absolute under a Ray job) or `s3://bucket/prefix`. The run writes its checkpoints,
    exported model, summary and config to `<storage>/<run name>/`, and the default MLflow store to `<storage>/`."""
    export: bool = True
    """Export the trained model as a Hugging Face folder at the end."""
    resume: str = "auto"
    """`auto`: continue this run (same name and training keys) from its newest valid checkpoint, if it has one;
    `never`: refuse to start over a run that has checkpoints; or a checkpoint URI to start from."""

    _check_storage = field_validator("storage")(lambda cls, value: check_storage_uri(value))

    @model_validator(mode="after")
    def _steps_or_epochs(self) -> TrainingConfig:
        if self.epochs is not None and "steps" in self.model_fields_set:
            raise ValueError("give training.steps or training.epochs, not both")
        return self

    @field_validator("run_name")
    @classmethod
    def _name_is_a_folder_name(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(RUN_NAME_PATTERN, value):
            raise ValueError(f"{value!r} names a folder: use up to 128 letters, digits and . _ + = -, "
                             "starting with a letter or digit")
        return value


class ClusterRunConfig(ClusterConfig):
    """The `cluster` section: how many engine workers share each step; the rest is `ClusterConfig`."""

    num_workers: int = Field(
        1, ge=1, description="Engine workers (one per GPU) that split each global batch; 1: a single engine in this "
        "process, no Ray. Above 1: Ray workers and a coordinator holding the fp32 state (mt_ray.cluster)."
    )

    @model_validator(mode="after")
    def _whole_nodes(self) -> ClusterRunConfig:
        if self.num_workers % self.num_nodes:
            raise ValueError(f"num_workers ({self.num_workers}) must be a multiple of num_nodes ({self.num_nodes})")
        return self


class RunConfig(_Section):
    """Everything one training run needs; every key has a default (the embedded demo)."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=lambda: DataConfig(**DEMO_DEFAULTS["data"]))
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    optimizer: OptimizerConfig = Field(default_factory=lambda: OptimizerConfig(**DEMO_DEFAULTS["optimizer"]))
    checkpoint: CheckpointConfig = Field(default_factory=lambda: CheckpointConfig(**DEMO_DEFAULTS["checkpoint"]))
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    cluster: ClusterRunConfig = Field(default_factory=ClusterRunConfig)
    pref: PreferenceConfig = Field(default_factory=PreferenceConfig)
    grpo: GrpoConfig = Field(default_factory=GrpoConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)

    @model_validator(mode="before")
    @classmethod
    def _demo_defaults_under_given_keys(cls, values: Any) -> Any:
        """A section given in part keeps the demo's defaults for its other keys (`data.datasets=x` alone must
        not turn `data.max_seq_len` from the demo's 256 into the component's 1024)."""
        if not isinstance(values, dict):
            return values
        return {**values, **{section: {**defaults, **values[section]} for section, defaults in DEMO_DEFAULTS.items()
                             if isinstance(values.get(section), dict)}}

    @model_validator(mode="after")
    def _no_keys_the_run_sets(self) -> RunConfig:
        """Where checkpoints go and what the MLflow run is called follow from the run, never set apart (a key
        written at its default, as a run folder's `config.yaml` from an earlier version has it, sets nothing)."""
        for section, key in SET_BY_THE_RUN:
            part = getattr(self, section)
            if key in part.model_fields_set and getattr(part, key) != type(part).model_fields[key].get_default(
                    call_default_factory=True):
                raise ValueError(f"{section}.{key}: {SET_BY_THE_RUN[section, key]}")
        return self

    def to_yaml(self) -> str:
        """The config as a run folder's `config.yaml` keeps it, which `mt-ray train --config` and `mt-ray export
        --config` take as it is: every key, less those the run derives (`SET_BY_THE_RUN`, and an epoch-based
        run's `training.steps`, which it counts again from `training.epochs`)."""
        values = self.model_dump(mode="json")
        for section, key in SET_BY_THE_RUN:
            del values[section][key]
        if self.training.epochs is not None:
            del values["training"]["steps"]
        return yaml.safe_dump(values, sort_keys=False)

    @model_validator(mode="after")
    def _eval_needs_a_split(self) -> RunConfig:
        if self.training.eval_every is not None and not self.data.has_eval_split:
            raise ValueError("training.eval_every: there is nothing to evaluate on; hold out rows with data.val_size "
                             "(e.g. 0.1 or 200) or name data.eval_datasets, or unset training.eval_every")
        return self

    @model_validator(mode="after")
    def _preference_stage_fits(self) -> RunConfig:
        stage = self.training.stage
        check_stage(stage, self.pref)
        return self

    @model_validator(mode="after")
    def _grpo_steps_hold_whole_groups(self) -> RunConfig:
        """A GRPO step's completions (micro_batch_size x grad_accum_steps, as TRL's generation batch) are whole
        groups of G; it has no held-out evaluation yet."""
        t, g = self.training, self.grpo.num_generations
        if t.stage != "grpo":
            return self
        if (t.micro_batch_size * t.grad_accum_steps) % g:
            raise ValueError(f"training.micro_batch_size: a GRPO step samples micro_batch_size x grad_accum_steps = "
                             f"{t.micro_batch_size * t.grad_accum_steps} completions, which must be whole groups of "
                             f"grpo.num_generations ({g}); make it a multiple of {g}")
        if self.data.has_eval_split:
            raise ValueError("data.val_size: training.stage grpo has no held-out evaluation yet; unset data.val_size "
                             "and data.eval_datasets")
        if t.epochs is not None:
            raise ValueError("training.epochs: training.stage grpo samples its prompts step by step; give "
                             "training.steps")
        return self

    @model_validator(mode="after")
    def _workers_can_share_the_batch(self) -> RunConfig:
        """Mirror `shard_batch`: whole micro-batches per worker (always for kto), or every micro-batch cut into
        rows."""
        n, t = self.cluster.num_workers, self.training
        if t.stage in ("kto", "grpo") and t.grad_accum_steps < n:
            why = "estimates its KL term over" if t.stage == "kto" else "normalises its loss by"
            raise ValueError(f"cluster.num_workers: stage {t.stage} {why} each whole micro-batch, so each of the {n} "
                             f"workers needs whole ones; use a training.grad_accum_steps of at least {n}")
        if t.grad_accum_steps % n and n > t.micro_batch_size:
            raise ValueError(
                f"cluster.num_workers: {n} workers cannot share a step of {t.grad_accum_steps} micro-batches of "
                f"{t.micro_batch_size} rows; use at most {t.micro_batch_size} workers, or a "
                f"training.grad_accum_steps that is a multiple of {n}"
            )
        return self


def load_run_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Read YAML (or nothing: the defaults), apply `a.b=value` overrides, validate."""
    return validate_run_config(load_run_values(path, overrides))


def load_run_values(path: str | Path | None = None, overrides: list[str] | None = None) -> dict[str, Any]:
    """The YAML's values with `a.b=value` overrides applied, not yet validated (a sweep varies them per trial)."""
    values: dict[str, Any] = {}
    if path is not None:
        try:
            values = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"cannot read config {path}: {e}") from None
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
        if is_llamafactory(values):
            values, mapping = translate(values, set(RunConfig.model_fields))
            print(describe_mapping(str(path), mapping), flush=True)
    given = {}
    for item in overrides or []:
        given.update([apply_override(values, item)])
    _length_from_the_command_line(values, given, path)
    return values


def _length_from_the_command_line(values: dict[str, Any], given: dict[str, Any], path: str | Path | None) -> None:
    """A run's length given on the command line (`training.steps=3`) replaces the other measure the file gives
    (`training.epochs`, or LLaMA-Factory's num_train_epochs and its default of 3), saying so in one line."""
    training = values.get("training")
    for key, other in (("steps", "epochs"), ("epochs", "steps")):
        if f"training.{key}" in given and f"training.{other}" not in given and isinstance(training, dict) \
                and training.get(other) is not None:
            print(f"training.{key}={given[f'training.{key}']} from the command line replaces training.{other} "
                  f"{training.pop(other)} of {path}", flush=True)


def apply_override(values: dict[str, Any], item: str) -> tuple[str, Any]:
    """Set `a.b.c=value` in a nested dict; the value is parsed as YAML (numbers, lists, null). Returns the key
    and value set."""
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"override '{item}' must look like section.key=value")
    value = yaml.safe_load(raw)
    set_key(values, key.strip(), value)
    return key.strip(), value


def set_key(values: dict[str, Any], key: str, value: Any) -> None:
    """Set dotted `key` (e.g. `optimizer.lr`) in a nested dict, making the sections it passes through."""
    node = values
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{key}: '{part}' is not a section")
    node[parts[-1]] = value


def validate_run_config(values: dict[str, Any]) -> RunConfig:
    try:
        return RunConfig.model_validate(values)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            key = ".".join(str(p) for p in err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                msg = _unknown_key(err["loc"])
            lines.append(f"{key}: {msg}" if key else msg)  # a cross-section check names its own keys
        raise ConfigError("invalid config:\n  " + "\n  ".join(lines)) from None


def _unknown_key(loc: tuple[Any, ...]) -> str:
    """`unknown key; did you mean 'lr'?` for a misspelled key, naming the closest key of its section."""
    model: Any = RunConfig
    for part in loc[:-1]:
        field = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        model = field.annotation if field is not None else None
    known = list(model.model_fields) if isinstance(model, type) and issubclass(model, BaseModel) else []
    close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
    return f"unknown key; did you mean '{close[0]}'?" if close else "unknown key (mt-ray train --help-config lists them)"


def describe_config() -> str:
    """Every key with its default and description, for `mt-ray train --help-config`."""
    out = []
    for section, field in RunConfig.model_fields.items():
        model = field.annotation
        out.append(f"{section}:")
        for name, f in model.model_fields.items():
            if (section, name) in SET_BY_THE_RUN:
                continue
            default = f.default_factory() if f.default_factory else f.default
            out.append(f"  {name}: {default!r}  # {(f.description or '').strip()}")
    return "\n".join(out)
