"""A sweep's settings (`SweepConfig`) and its search space, read from a YAML file of dotted run-config keys.

    # space.yaml: each key is a key of the run config, each value one of Ray Tune's samplers
    optimizer.lr: {loguniform: [1.0e-5, 1.0e-3]}
    optimizer.warmup_steps: {choice: [0, 10, 50]}
    training.micro_batch_size: {grid: [4, 8]}

`loguniform` and `uniform` take `[low, high]`; `choice` samples one of a list; `grid` runs every
value of its list (in each sample). Everything is checked before anything runs: the key must be
a run-config key the sweep may vary, and the sampler's bounds (and its midpoint) must make a
valid run config, so a bad space fails at once with the key and the fix, not inside a trial.
"""

from __future__ import annotations

import copy
import difflib
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mt_ray.config.run import RunConfig, set_key, validate_run_config
from mt_ray.errors import ConfigError

SAMPLERS = ("loguniform", "uniform", "choice", "grid")
_EXAMPLE = "e.g. optimizer.lr: {loguniform: [1.0e-5, 1.0e-3]}"
# Keys a trial's identity, outputs or ASHA's clock depend on: the sweep sets them, a space may not vary them.
SET_BY_THE_SWEEP = {
    "training.storage": "each trial is a run under the sweep's storage (--storage)",
    "training.run_name": "each trial is a run named after the sweep and its trial id",
    "training.resume": "a trial resumes its own checkpoints when a sweep is resumed",
    "training.steps": "ASHA measures trials in steps up to training.steps; set it in the run config",
    "training.eval_every": "ASHA compares trials at their evaluations; set it in the run config",
    "tracking": "each trial is an MLflow child run of the sweep's run",
}


class SweepConfig(BaseModel):
    """How a sweep runs: trials, concurrency, early stopping, search and where its state lives."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    name: str = Field("sweep", pattern=r"^[A-Za-z0-9][A-Za-z0-9._+=-]{0,127}$")
    """The sweep's folder under `storage` and its MLflow run name; `--resume` continues the sweep of this name."""
    storage: str | None = None
    """Where Tune's state, every trial's run (checkpoints, outputs) and the best config go: a folder or
    s3://bucket/prefix; default: `<training.storage>/sweeps`."""
    samples: int = Field(4, ge=1)
    """Trials to sample (each `grid` multiplies them by its length)."""
    max_concurrent: int | None = Field(None, ge=1)
    """Trials running at once; default: as many as the cluster's resources fit."""
    grace_steps: int | None = Field(None, ge=1)
    """Steps every trial runs before ASHA may stop it; default: `training.eval_every`, its first evaluation."""
    reduction_factor: float = Field(2.0, gt=1)
    """ASHA keeps the best 1/reduction_factor of the trials at each rung (grace, grace*rf, grace*rf^2, ...)."""
    search: Literal["random", "optuna"] = "random"
    """`random`: Tune's random/grid sampling, seeded with `training.seed`; `optuna`: Optuna's TPE (pip install optuna)."""
    cpus_per_trial: float = Field(1.0, gt=0)
    """CPUs reserved for each trial's own process (its engine, or its data-parallel driver)."""
    gpus_per_trial: float | None = Field(None, ge=0)
    """GPUs of a single-engine trial; default: 1 when the cluster has GPUs and `engine.device` is not cpu."""
    metric: Literal["eval_loss", "eval_rewards/accuracies"] = "eval_loss"
    """What trials are judged on at each evaluation: `eval_loss` (lower is better), or, for `training.stage: dpo`,
    `eval_rewards/accuracies` (higher is better: the held-out pairs whose chosen response earns the larger reward)."""

    @property
    def mode(self) -> Literal["min", "max"]:
        """Whether the best trial has the least or the most of `metric`."""
        return "min" if self.metric == "eval_loss" else "max"

    def checked(self, cfg: RunConfig) -> SweepConfig:
        """This config, refused where it cannot judge `cfg`'s trials; `grace_steps` filled in."""
        t = cfg.training
        if not cfg.data.has_eval_split or t.eval_every is None:
            raise ConfigError(f"a sweep judges trials on {self.metric}: set data.val_size (e.g. 0.1) or "
                              "data.eval_datasets, and training.eval_every (the steps at which ASHA compares trials)")
        if self.metric == "eval_rewards/accuracies" and t.stage != "dpo":
            raise ConfigError(f"--metric eval_rewards/accuracies is reported by training.stage dpo only (this run's is "
                              f"{t.stage}); use --metric eval_loss")
        grace = self.grace_steps or t.eval_every
        if grace > t.steps:
            raise ConfigError(f"--grace-steps {grace} is beyond training.steps ({t.steps}); use at most {t.steps}")
        return self.model_copy(update={"grace_steps": grace})


def load_sweep_config(values: dict[str, Any]) -> SweepConfig:
    """A `SweepConfig` from command-line values (None: the default); errors name the option, e.g. `--samples`."""
    try:
        return SweepConfig(**{k: v for k, v in values.items() if v is not None})
    except ValidationError as e:
        problems = "; ".join(f"--{str(err['loc'][0]).replace('_', '-')}: {err['msg']}" for err in e.errors())
        raise ConfigError(problems) from None


@dataclass(frozen=True)
class Dimension:
    """One swept key: a dotted run-config key and the Tune sampler that draws its values."""

    key: str
    sampler: str
    args: tuple

    def describe(self) -> str:
        """Readable, for the MLflow parent run: `loguniform(1e-05, 0.001)`, `choice([0, 10])`."""
        return f"{self.sampler}({', '.join(map(repr, self.args))})" if self.sampler in ("loguniform", "uniform") \
            else f"{self.sampler}({list(self.args)!r})"

    def to_tune(self) -> Any:
        from ray import tune

        if self.sampler == "loguniform":
            return tune.loguniform(*self.args)
        if self.sampler == "uniform":
            return tune.uniform(*self.args)
        if self.sampler == "choice":
            return tune.choice(list(self.args))
        return tune.grid_search(list(self.args))

    def probes(self) -> list[Any]:
        """Values whose validity stands for the whole range: the bounds and the midpoint, or every listed value."""
        if self.sampler in ("loguniform", "uniform"):
            low, high = self.args
            mid = (low * high) ** 0.5 if self.sampler == "loguniform" else (low + high) / 2
            return [low, mid, high]
        return list(self.args)


def load_space(path: str | Path, base: dict[str, Any]) -> list[Dimension]:
    """Read a space file and check every dimension against the run config `base` (its raw values)."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read space {path}: {e}") from None
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"{path}: a space maps dotted run-config keys to samplers, {_EXAMPLE}")
    return build_space(raw, base)


def build_space(raw: dict[str, Any], base: dict[str, Any]) -> list[Dimension]:
    """`{dotted key: {sampler: args}}` as checked dimensions (`ConfigError` naming the key and the fix)."""
    dims = []
    for key, spec in raw.items():
        check_key(str(key))
        dim = _dimension(str(key), spec)
        for value in dim.probes():
            _check_value(dim, value, base)
        dims.append(dim)
    return dims


def check_key(key: str) -> None:
    """`key` must name one value of the run config (any key under `model.overrides`) that the sweep does not set."""
    for reserved, why in SET_BY_THE_SWEEP.items():
        if key == reserved or key.startswith(reserved + "."):
            raise ConfigError(f"space key '{key}' cannot be swept: {why}")
    model: type[BaseModel] = RunConfig
    parts = key.split(".")
    for i, part in enumerate(parts):
        where = ".".join(parts[:i])
        if part not in model.model_fields:
            close = difflib.get_close_matches(part, list(model.model_fields), n=1)
            hint = f"; did you mean {'.'.join([*parts[:i], close[0], *parts[i + 1:]])}?" if close else ""
            owner = f"section '{where}'" if where else "the top level"
            raise ConfigError(f"space key '{key}' is not in the run config: {owner} has no key '{part}'{hint} "
                              "(`mt-ray train --help-config` lists every key)")
        annotation = model.model_fields[part].annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            model = annotation
        elif typing.get_origin(annotation) is dict and i < len(parts) - 1:
            return  # a free-form mapping such as model.overrides: any key inside it
        elif i < len(parts) - 1:
            raise ConfigError(f"space key '{key}': '{'.'.join(parts[:i + 1])}' is a value, not a section")
        else:
            return
    raise ConfigError(f"space key '{key}' is a whole section; name one of its keys, e.g. {key}.{next(iter(model.model_fields))}")


def _dimension(key: str, spec: Any) -> Dimension:
    if not isinstance(spec, dict) or len(spec) != 1:
        raise ConfigError(f"space key '{key}': give exactly one sampler ({', '.join(SAMPLERS)}), {_EXAMPLE}")
    [(sampler, args)] = spec.items()
    if sampler not in SAMPLERS:
        close = difflib.get_close_matches(str(sampler), SAMPLERS, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise ConfigError(f"space key '{key}': unknown sampler '{sampler}'{hint} (use {', '.join(SAMPLERS)})")
    if sampler in ("choice", "grid"):
        if not isinstance(args, list) or not args:
            raise ConfigError(f"space key '{key}': {sampler} needs a non-empty list of values, e.g. {{{sampler}: [0, 10]}}")
        return Dimension(key, sampler, tuple(args))
    if not (isinstance(args, list) and len(args) == 2 and all(_is_number(a) for a in args)):
        raise ConfigError(f"space key '{key}': {sampler} needs [low, high] as two numbers, e.g. {{{sampler}: [0.1, 0.9]}}")
    low, high = args
    if not low < high:
        raise ConfigError(f"space key '{key}': {sampler} bounds [{low}, {high}] are not increasing; give [low, high] "
                          "with low < high")
    if sampler == "loguniform" and low <= 0:
        raise ConfigError(f"space key '{key}': loguniform needs 0 < low, got [{low}, {high}]; use uniform to include "
                          "zero or negative values")
    return Dimension(key, sampler, (float(low), float(high)))


def _check_value(dim: Dimension, value: Any, base: dict[str, Any]) -> None:
    values = copy.deepcopy(base)
    set_key(values, dim.key, value)
    try:
        validate_run_config(values)
    except ConfigError as e:
        problem = str(e).removeprefix("invalid config:\n  ").replace("\n  ", "; ")
        raise ConfigError(f"space key '{dim.key}': {dim.describe()} can draw {value!r}, which the run config "
                          f"refuses ({problem}); narrow the sampler to valid values") from None


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
