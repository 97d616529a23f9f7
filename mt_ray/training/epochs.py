"""`training.epochs`: a run's length in passes over its data, turned into optimizer steps before the first one.

The steps follow transformers' Trainer (`set_initial_training_values`), which LLaMA-Factory runs:
an epoch of R rows is ceil(R / micro_batch_size) micro-batches, ceil(that / grad_accum_steps) updates,
and `epochs` of them are ceil(epochs x updates) steps. A row is what the loader yields: one example
(`data.packing: false`, LLaMA-Factory's default for its sft, dpo and kto stages), or one packed row.
"""

from __future__ import annotations

import math

from transformers import PreTrainedTokenizerBase

from mt_ray.config.run import RunConfig
from mt_ray.data import DataConfig, build_dataloader
from mt_ray.data.mm_processor import ImageEncoder
from mt_ray.data.split import HeldOut


def resolve_epochs(cfg: RunConfig, data: DataConfig, tokenizer: PreTrainedTokenizerBase, held_out: HeldOut | None,
                   images: ImageEncoder | None) -> RunConfig:
    """`cfg` with `training.steps` set from `training.epochs` (unchanged without epochs); says what it counted."""
    t = cfg.training
    if t.epochs is None:
        return cfg
    counter = build_dataloader(data, tokenizer, t.micro_batch_size, t.grad_accum_steps, held_out=held_out,
                               images=images, stage=t.stage)
    rows = counter.count_epoch_rows()
    updates = max(math.ceil(math.ceil(rows / t.micro_batch_size) / t.grad_accum_steps), 1)
    steps = math.ceil(t.epochs * updates)
    print(f"training.epochs {t.epochs:g}: an epoch is {rows} rows, {updates} step{'s' * (updates != 1)} of "
          f"{t.micro_batch_size} x {t.grad_accum_steps}; training {steps} steps", flush=True)
    return cfg.model_copy(update={"training": t.model_copy(update={"steps": steps})})
