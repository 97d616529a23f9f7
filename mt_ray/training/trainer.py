"""The training loop: config -> model spec, tokenizer, backend, loader; then step, log, export.

The backend is one streaming engine, or Ray workers around a coordinator when
`cluster.num_workers > 1` (see `backend.py`); the loop is the same. It reads device values only
every `log_every` steps (each read is a sync point); in between, a single engine's `train_step`
returns as soon as the step's work is queued. With a held-out split it evaluates (forward only)
every `eval_every` steps and at the end.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from mt_ray.config.run import RunConfig
from mt_ray.data import (
    build_dataloader,
    build_eval_batches,
    load_tiny_tokenizer,
    plan_split,
    split_micro_batches,
)
from mt_ray.models.discovery import ModelSpec, discover, load_config
from mt_ray.models.presets import preset_config
from mt_ray.training.backend import TrainingBackend, build_backend
from mt_ray.training.callbacks import Callback


def build_model_spec(cfg: RunConfig, vocab_size: int | None = None) -> ModelSpec:
    """Discover the configured model (local folder or preset shape, with overrides)."""
    overrides = dict(cfg.model.overrides)
    if cfg.model.path:
        config = load_config(cfg.model.path)
        for k, v in overrides.items():
            setattr(config, k, v)
    else:
        if vocab_size is not None and cfg.model.preset == "tiny":
            overrides.setdefault("vocab_size", vocab_size)
        config = preset_config(cfg.model.preset, **overrides)
    return discover(config)


def load_tokenizer(cfg: RunConfig):
    source = cfg.model.tokenizer or cfg.model.path
    if source is None:
        return load_tiny_tokenizer()
    return AutoTokenizer.from_pretrained(source, local_files_only=True)


def load_model_and_tokenizer(cfg: RunConfig) -> tuple[ModelSpec, object]:
    """The tokenizer, then the model spec (the tiny preset's vocabulary sized to that tokenizer)."""
    tokenizer = load_tokenizer(cfg)
    return build_model_spec(cfg, vocab_size=_padded_vocab(tokenizer)), tokenizer


class Trainer:
    """Runs `cfg.training.steps` optimizer steps on the configured data (one engine, or a Ray cluster)."""

    def __init__(self, cfg: RunConfig, callbacks: list[Callback] | None = None):
        self.cfg = cfg
        self.callbacks = list(callbacks or [])
        self.spec, self.tokenizer = load_model_and_tokenizer(cfg)
        t = cfg.training
        data = cfg.data.model_copy(update={"seed": t.seed})
        held_out = plan_split(data)  # drawn once: the loader skips exactly the rows the eval set scores
        self.loader = build_dataloader(data, self.tokenizer, t.micro_batch_size, t.grad_accum_steps, held_out=held_out)
        self.eval_batches = build_eval_batches(data, self.tokenizer, t.micro_batch_size, held_out=held_out)
        self.engine: TrainingBackend = build_backend(cfg, self.spec)
        self.history: list[dict[str, float]] = []
        self.eval_history: list[dict[str, float]] = []
        self.stop_reason: str | None = None
        self._postfix: dict[str, str] = {}

    @property
    def step(self) -> int:
        return self.engine.step_idx

    def fit(self) -> dict[str, Any]:
        """Train to the configured step count (resuming first if asked); returns the run summary."""
        t = self.cfg.training
        self._maybe_resume()
        for cb in self.callbacks:
            cb.on_train_start(self)
        bar = tqdm(total=t.steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True)
        window_start, window_tokens = time.perf_counter(), 0
        try:
            while self.step < t.steps:
                batch = next(self.loader)
                result = self.engine.train_step(split_micro_batches(batch, t.micro_batch_size))
                window_tokens += result.num_tokens
                bar.update(1)
                if self.step % t.log_every == 0 or self.step == t.steps:
                    elapsed = time.perf_counter() - window_start
                    metrics = self._metrics(result, window_tokens / elapsed)
                    self._show(bar, loss=f"{metrics['loss']:.3f}", tok_s=f"{metrics['tokens_per_s']:.0f}")
                    for cb in self.callbacks:
                        cb.on_log(self, self.step, metrics)
                    window_start, window_tokens = time.perf_counter(), 0
                if t.eval_every and self.step % t.eval_every == 0:
                    self._evaluate(bar)
                for cb in self.callbacks:
                    cb.on_step_end(self, self.step)
                if self.stop_reason is not None:
                    break
            if self.eval_batches and (not self.eval_history or self.eval_history[-1]["step"] != self.step):
                self._evaluate(bar)  # every run with a split ends with its eval loss
        finally:
            bar.close()
        summary = self._finish()
        for cb in self.callbacks:
            cb.on_train_end(self, summary)
        return summary

    def request_stop(self, reason: str) -> None:
        """End the run after this step (a sweep's scheduler cut it short): summary, checkpoint and tracking as
        usual, `reason` in the summary, but no export (nobody asked for this model)."""
        self.stop_reason = reason

    def evaluate(self) -> dict[str, float]:
        """Loss and perplexity on the held-out split under the current weights (forward only; training state unchanged).

        The split is scored `grad_accum_steps` micro-batches at a time (one weight pass each), so
        an evaluation holds no more activations than a training step.
        """
        group = self.cfg.training.grad_accum_steps
        results = [self.engine.evaluate(self.eval_batches[i:i + group]) for i in range(0, len(self.eval_batches), group)]
        # .item() waits for the device: once per evaluation.
        loss_sum = torch.stack([r.loss_sum.double().cpu() for r in results]).sum().item()
        tokens = sum(r.num_loss_tokens for r in results)
        loss = loss_sum / tokens
        return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 700.0)), "eval_tokens": tokens}

    def _evaluate(self, bar) -> None:
        metrics = self.evaluate()
        self.eval_history.append({"step": self.step, **metrics})
        self._show(bar, eval_loss=f"{metrics['eval_loss']:.3f}")
        for cb in self.callbacks:
            cb.on_evaluate(self, self.step, metrics)

    def _show(self, bar, **values: str) -> None:
        """Update the progress bar's postfix, keeping the values not given (the last loss, the last eval loss)."""
        self._postfix.update(values)
        bar.set_postfix(self._postfix)

    def _maybe_resume(self) -> None:
        mode = self.cfg.training.resume
        if mode == "never":
            return
        for cb in self.callbacks:
            if hasattr(cb, "maybe_resume"):
                cb.maybe_resume(self, None if mode == "auto" else mode)

    def _metrics(self, result, tokens_per_s: float) -> dict[str, float]:
        # .item() syncs with the device: only here, on the logging cadence.
        metrics = {
            "loss": result.loss.item(),
            "grad_norm": result.grad_norm.item(),
            "lr": result.lr,
            "tokens_per_s": tokens_per_s,
            "model_tflops": 6 * self.spec.num_params * tokens_per_s / 1e12,
            **self.engine.memory_metrics(),
        }
        self.history.append({"step": self.step, **metrics})
        return metrics

    def _finish(self) -> dict[str, Any]:
        self.engine.synchronize()
        out = Path(self.cfg.training.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        summary: dict[str, Any] = {
            "steps": self.step,
            "params": self.spec.num_params,
            "first_loss": self.history[0]["loss"] if self.history else None,
            "final_loss": self.history[-1]["loss"] if self.history else None,
            "data": self.loader.stats(),
        }
        if self.stop_reason is not None:
            summary["stopped_early"] = self.stop_reason
        if self.eval_history:
            last = self.eval_history[-1]
            summary.update({k: last[k] for k in ("eval_loss", "eval_perplexity", "eval_tokens")})
        if self.cfg.training.export and self.stop_reason is None:
            summary["exported_model"] = str(self.engine.export(out / "hf_model", self.tokenizer))
        (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        return summary

    def close(self) -> None:
        self.engine.close()


def _padded_vocab(tokenizer) -> int:
    """Vocabulary rounded up to a multiple of 64 (tensor-core friendly), covering every token id."""
    return (len(tokenizer) + 63) // 64 * 64
