"""The training loop: config -> model spec, tokenizer, backend, loader; then step, log, export.

The backend is one streaming engine, or Ray workers around a coordinator when
`cluster.num_workers > 1` (see `backend.py`); the loop is the same. It reads device values only
every `log_every` steps (each read is a sync point); in between, a single engine's `train_step`
returns as soon as the step's work is queued. With a held-out split it evaluates (forward only)
every `eval_every` steps and at the end.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch
from tqdm.auto import tqdm

from mt_ray.config.run import RunConfig
from mt_ray.data import build_dataloader, build_eval_batches, plan_split, split_micro_batches
from mt_ray.data.mm_processor import processor_files
from mt_ray.data.prefetch import BackgroundLoader
from mt_ray.engine.preference import Objective, add_counts, add_sums
from mt_ray.tracking.run_files import open_run_files
from mt_ray.training.auto_fit import apply_auto_fit, refuse_what_cannot_fit
from mt_ray.training.backend import TrainingBackend, build_backend
from mt_ray.training.callbacks import Callback, ResumePoint
from mt_ray.training.console import banner, interactive, progress_line
from mt_ray.training.epochs import resolve_epochs
from mt_ray.training.export import generation_config, trained_tokenizer
from mt_ray.training.grpo.steps import GrpoSteps
from mt_ray.training.model_source import load_image_encoder, load_model_and_tokenizer
from mt_ray.training.reference_cache import ReferenceLogps, load_or_compute
from mt_ray.training.run_dir import ANOTHER_NAME, EXPORT_DIR, RunDir

log = logging.getLogger(__name__)

# The last logged value of these (TRL's names) goes into a preference or GRPO run's summary.
STAGE_METRICS = ("reward", "frac_reward", "logps/", "completions/", "kl", "clip_ratio/", "rollout/", "nll_loss",
                 "sft_loss", "log_odds_")


class Trainer:
    """Runs `cfg.training.steps` optimizer steps on the configured data (one engine, or a Ray cluster).

    The run's outputs go to its directory (`run`, by default `RunDir(cfg)`): a different config under the same
    run name is refused before anything is built, and the name is claimed as the first step is about to run.
    """

    def __init__(self, cfg: RunConfig, callbacks: list[Callback] | None = None, run: RunDir | None = None):
        self.cfg = cfg
        self.callbacks = list(callbacks or [])
        self.run = run if run is not None else RunDir(cfg)
        self.run.check()
        self.history: list[dict[str, float]] = []
        self.eval_history: list[dict[str, float]] = []
        self.stop_reason: str | None = None
        self._postfix: dict[str, str] = {}
        self.resumed_from: ResumePoint | None = None
        # A finished run (its summary is written last) has nothing to continue, so nothing is built for it.
        self.finished = self.run.read_summary() if cfg.training.resume == "auto" else None
        if self.finished is None:
            self._build()

    def _build(self) -> None:
        self.spec, self.tokenizer = load_model_and_tokenizer(self.cfg)
        # Before anything is allocated: a run that cannot fit stops here.
        if self.cfg.engine.auto_fit:
            self.cfg = apply_auto_fit(self.cfg, self.spec)
        else:
            refuse_what_cannot_fit(self.cfg, self.spec)
        images = load_image_encoder(self.cfg, self.spec)
        data = self.cfg.data.model_copy(update={"seed": self.cfg.training.seed})
        held_out = self._held_out = plan_split(data)  # drawn once: the loader skips exactly the rows the eval set scores
        self.cfg = resolve_epochs(self.cfg, data, self.tokenizer, held_out, images)
        cfg, t = self.cfg, self.cfg.training
        self.reference_logps: ReferenceLogps | None = None  # pref.reference: precompute, read or computed in `fit`
        if t.stage == "grpo":  # completions sampled from the policy, from the datasets' prompts (no held-out split)
            self.objective, self.eval_batches = None, []
            self.engine: TrainingBackend = build_backend(cfg, self.spec)
            self.loader = GrpoSteps(cfg, self.engine, self.spec, self.tokenizer)
            return
        # Its worker thread tokenizes and decodes images ahead of the steps, off the engine's thread.
        self.loader = BackgroundLoader(build_dataloader(data, self.tokenizer, t.micro_batch_size, t.grad_accum_steps,
                                                        held_out=held_out, images=images, stage=t.stage))
        self.eval_batches = build_eval_batches(data, self.tokenizer, t.micro_batch_size, held_out=held_out,
                                               images=images, stage=t.stage)
        self.objective = Objective(t.stage, cfg.pref) if t.stage != "sft" else None
        self.engine = build_backend(cfg, self.spec)

    @property
    def step(self) -> int:
        return self.engine.step_idx

    def fit(self) -> dict[str, Any]:
        """Train to the configured step count (resuming first if asked); returns the run summary.

        A run that already finished (its summary written at the end) trains nothing and returns that summary.
        """
        t = self.cfg.training
        if self.finished is not None:
            print(f"run {self.run.name} already finished ({self.finished['steps']} steps); its outputs are in "
                  f"{self.run.uri}. To train it again, give it {ANOTHER_NAME} or delete that folder.",
                  flush=True)
            return self.finished
        self._maybe_precompute_reference()  # with the starting weights: before a resume restores the policy
        self._maybe_resume()
        self.run.claim(self.cfg)
        print(banner(self.cfg, self.spec, self.run, self.step), flush=True)
        for cb in self.callbacks:
            cb.on_train_start(self)
        # A bar redrawn in place on a terminal; in a file (a Ray job's log, a pipe) one line per log_every steps.
        bar = tqdm(total=t.steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True,
                   disable=not interactive())
        window_start, window_tokens = time.perf_counter(), 0
        try:
            while self.step < t.steps:
                result = self.engine.train_step(self._next_micro_batches())
                window_tokens += result.num_tokens
                bar.update(1)
                if self.step % t.log_every == 0 or self.step == t.steps:
                    elapsed = time.perf_counter() - window_start
                    metrics = self._metrics(result, window_tokens / elapsed)
                    self._show(bar, loss=f"{metrics['loss']:.3f}", tok_s=f"{metrics['tokens_per_s']:.0f}",
                               **({"acc": f"{metrics['rewards/accuracies']:.2f}"} if "rewards/accuracies" in metrics else {}),
                               **({"reward": f"{metrics['reward']:.3f}"} if "reward" in metrics else {}))
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
        self.run.write_summary(summary)  # last: a run with a summary is complete
        return summary

    def _next_micro_batches(self) -> list[dict[str, torch.Tensor]]:
        """The step's micro-batches: GRPO's rollout (its own micro-batches), else the loader's batch, split."""
        if self.cfg.training.stage == "grpo":
            return next(self.loader)
        batch = next(self.loader)
        if self.reference_logps is not None:
            batch = self.reference_logps.attach(batch)
        return split_micro_batches(batch, self.cfg.training.micro_batch_size)

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
        if self.objective is not None:
            return self._preference_eval(results)
        # .item() waits for the device: once per evaluation.
        loss_sum = torch.stack([r.loss_sum.double().cpu() for r in results]).sum().item()
        tokens = sum(r.num_loss_tokens for r in results)
        loss = loss_sum / tokens
        return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 700.0)), "eval_tokens": tokens}

    def _preference_eval(self, results) -> dict[str, float]:
        """A preference stage's eval metrics: its loss and TRL's rewards and log-probs over the whole split."""
        sums, counts = {}, {}
        for r in results:
            add_sums(sums, r.pref_sums)
            counts = add_counts(counts, r.pref_counts)
        metrics = {f"eval_{k}": v.item() for k, v in self.objective.metrics(sums, counts).items()}  # one sync each
        return {**metrics, "eval_examples": self.objective.examples(counts)}

    def _evaluate(self, bar) -> None:
        metrics = self.evaluate()
        self.eval_history.append({"step": self.step, **metrics})
        self._show(bar, eval_loss=f"{metrics['eval_loss']:.3f}")
        for cb in self.callbacks:
            cb.on_evaluate(self, self.step, metrics)

    def _show(self, bar, **values: str) -> None:
        """Update the progress bar's postfix, keeping the values not given (the last loss, the last eval loss);
        without a bar (not a terminal), print the new values as one line."""
        self._postfix.update(values)
        if bar.disable:
            print(progress_line(self.step, self.cfg.training.steps, values), flush=True)
        else:
            bar.set_postfix(self._postfix)

    def _maybe_precompute_reference(self) -> None:
        """`pref.reference: precompute`: the reference's log-probs from the storage's cache, else computed now."""
        if self.objective is None or self.cfg.pref.reference != "precompute" or not self.objective.needs_reference:
            return
        files = open_run_files(self.run.root, self.cfg.checkpoint)
        self.reference_logps = load_or_compute(self.cfg, files, self.engine, self.tokenizer, self._held_out,
                                               self.eval_batches)
        self.eval_batches = [self.reference_logps.attach(b) for b in self.eval_batches]

    def _maybe_resume(self) -> None:
        """Let the checkpoint callback restore the state; say where from, on the console and in the log."""
        for cb in self.callbacks:
            point = cb.maybe_resume(self, self.cfg.training.resume) if hasattr(cb, "maybe_resume") else None
            if point is not None:
                self.resumed_from = point
                message = (f"resuming run {self.run.name} from {point.uri} "
                           f"(step {point.step} of {self.cfg.training.steps})")
                print(message, flush=True)
                log.info(message)

    def _metrics(self, result, tokens_per_s: float) -> dict[str, float]:
        # .item() syncs with the device: only here, on the logging cadence.
        metrics = {
            "loss": result.loss.item(),
            "grad_norm": result.grad_norm.item(),
            "lr": result.lr,
            "tokens_per_s": tokens_per_s,
            "model_tflops": 6 * self.spec.text_params * tokens_per_s / 1e12,
            **self.engine.memory_metrics(),
        }
        if result.aux_loss is not None:  # the MoE router's load-balancing loss, when configured
            metrics["aux_loss"] = result.aux_loss.item()
        for name, value in (result.metrics or {}).items():  # a preference stage's rewards and log-probs
            if name != "loss":
                metrics[name] = value.item()
        if isinstance(self.loader, GrpoSteps):  # the rollout's rewards, lengths and times (host numbers)
            metrics.update(self.loader.metrics)
        self.history.append({"step": self.step, **metrics})
        return metrics

    def _finish(self) -> dict[str, Any]:
        self.engine.synchronize()
        summary: dict[str, Any] = {
            "run": self.run.name,
            "run_dir": self.run.uri,
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
            summary.update({k: v for k, v in last.items() if k != "step"})
        if self.cfg.training.stage != "sft" and self.history:  # TRL's names: rewards, log-probs, completions, kl
            summary.update({k: v for k, v in self.history[-1].items() if k.startswith(STAGE_METRICS)})
        if self.cfg.training.export and self.stop_reason is None:
            extra = {"extra_files": processor_files(self.cfg.model.path)} if self.spec.vision is not None else {}
            self.engine.export(self.run.staging / EXPORT_DIR, trained_tokenizer(self.cfg, self.tokenizer),
                               generation=generation_config(self.cfg, self.spec, self.tokenizer), **extra)
            summary["exported_model"] = self.run.publish(EXPORT_DIR)
        return summary

    def close(self) -> None:
        try:
            if self.finished is None:
                self.loader.close()
                self.engine.close()
        finally:
            self.run.close()

