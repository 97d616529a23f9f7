"""``DataConfig``: what to train on and how to batch it."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from mt_ray.data.templates import TEMPLATES
from mt_ray.errors import ConfigError

MixStrategy = Literal["concat", "interleave_under", "interleave_over"]


class DataConfig(BaseModel):
    """Datasets, mixing, sequence length and packing. Unknown keys are rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    datasets: list[str] = Field(default_factory=lambda: ["demo_alpaca", "demo_sharegpt"], min_length=1)
    """Registry entry names; a comma-separated string (LLaMA-Factory style) is accepted too."""

    mix_strategy: MixStrategy = "concat"
    """``concat``: one dataset after another. ``interleave_under``: sample by weight, an epoch
    ends when any dataset runs out. ``interleave_over``: sample by weight, a dataset that runs
    out restarts (a new epoch of its own), so small datasets are over-sampled."""

    weights: list[float] | None = None
    """Sampling weight of each dataset for the interleave strategies (default: equal)."""

    registry: Path | None = None
    """A ``dataset_info.json`` or the folder holding it; ``None`` = the built-in demo registry."""

    max_samples: int | None = Field(default=None, ge=1)
    """Read only the first this many rows (file order) of each dataset, as LLaMA-Factory's ``max_samples``; the
    held-out split (``val_size``) and ``eval_datasets`` are drawn from those rows too. ``None``: every row."""

    max_seq_len: int = Field(default=1024, ge=2)
    """Tokens per example after truncation, and the length of every packed row."""

    packing: bool = True
    """Pack several examples into each row of exactly ``max_seq_len`` tokens (attention stays
    within each example through position-id resets); otherwise one example per row, padded
    to the step's longest example."""

    packing_window: int = Field(default=256, ge=1)
    """Examples tokenized together and packed first-fit-decreasing; larger packs tighter."""

    shuffle: bool = True
    """Shuffle rows within blocks of ``shuffle_buffer`` rows (whole files smaller than that)."""

    shuffle_buffer: int = Field(default=10_000, ge=1)
    """Rows per shuffle block; these rows are held in memory at once."""

    template: str = "tokenizer"
    """Chat template: ``tokenizer`` for the tokenizer's own, or a name in ``templates.TEMPLATES``."""

    image_max_pixels: int | None = Field(default=None, ge=1)
    """Image-text models: an image of more pixels is scaled down to this many before the processor sees it
    (LLaMA-Factory's ``image_max_pixels``); ``None``: the processor's own limits alone."""

    image_min_pixels: int | None = Field(default=None, ge=1)
    """Image-text models: an image of fewer pixels is scaled up to this many (LLaMA-Factory's ``image_min_pixels``)."""

    on_bad_row: Literal["error", "skip"] = "error"
    """A malformed row raises ``DatasetError`` (``error``) or is skipped and counted (``skip``)."""

    seed: int = 0
    """Seed for shuffling, mixing, packing order and the held-out split; the same seed gives the same batches."""

    val_size: float = Field(default=0, ge=0)
    """Rows held out of ``datasets`` for evaluation (as LLaMA-Factory's ``val_size``): a fraction of all rows
    when below 1 (rounded up), a row count from 1 on; 0 holds out nothing. The rows are drawn with ``seed``,
    in proportion to each dataset's size, and never trained on."""

    eval_datasets: list[str] | None = None
    """Registry entries evaluated whole instead of a ``val_size`` split (LLaMA-Factory's ``eval_dataset``);
    none of them may also be in ``datasets``."""

    @field_validator("datasets", "eval_datasets", mode="before")
    @classmethod
    def _split_names(cls, value: Any) -> Any:
        return [n.strip() for n in value.split(",") if n.strip()] if isinstance(value, str) else value

    @field_validator("weights")
    @classmethod
    def _check_weights(cls, value: list[float] | None, info: ValidationInfo) -> list[float] | None:
        if value is None:
            return value
        if info.data.get("mix_strategy") == "concat":
            raise ValueError("weights apply only to the interleave_* mix strategies")
        if len(value) != len(info.data.get("datasets", [])) or any(w <= 0 for w in value):
            raise ValueError("weights needs one positive number per dataset")
        return value


    @field_validator("template")
    @classmethod
    def _known_template(cls, value: str) -> str:
        """Refused at load time, not after the model has loaded; the closest name is suggested."""
        if value != "tokenizer" and value not in TEMPLATES:
            close = difflib.get_close_matches(value, TEMPLATES, n=1, cutoff=0.6)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ValueError(f"'{value}' is not a template mt-ray knows; {hint}use tokenizer (the model's own chat "
                             f"template) or one of {', '.join(sorted(TEMPLATES))}")
        return value

    @field_validator("val_size")
    @classmethod
    def _count_is_whole(cls, value: float) -> float:
        if value >= 1 and value != int(value):
            raise ValueError(f"{value} is neither a fraction below 1 nor a whole row count; use e.g. 0.1 or 100")
        return value

    @field_validator("eval_datasets")
    @classmethod
    def _eval_apart_from_training(cls, value: list[str] | None, info: ValidationInfo) -> list[str] | None:
        if value is None:
            return value
        if not value:
            raise ValueError("name at least one registry entry, or leave eval_datasets unset")
        shared = sorted(set(value) & set(info.data.get("datasets", [])))
        if shared:
            raise ValueError(f"{shared} would be trained on and evaluated on; evaluate on other entries, or hold "
                             "rows out of the training datasets with data.val_size instead")
        if info.data.get("val_size"):
            raise ValueError("give data.val_size or data.eval_datasets, not both")
        return value

    @property
    def has_eval_split(self) -> bool:
        """Whether the run has rows to evaluate on (a ``val_size`` split or ``eval_datasets``)."""
        return self.val_size > 0 or bool(self.eval_datasets)


def load_data_config(values: Mapping[str, Any], key: str = "data") -> DataConfig:
    """Build a ``DataConfig``, turning validation errors into ``ConfigError`` with dotted keys."""
    try:
        return DataConfig.model_validate(dict(values))
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join([key, *map(str, err['loc'])])}: {err['msg']}" for err in e.errors())
        raise ConfigError(problems) from None
