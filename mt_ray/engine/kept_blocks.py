"""Kept activations (`engine.keep_activations`): block graphs the stream schedule's backward uses
instead of recomputing them.

A kept block graph is one block of K layers run for one micro-batch with autograd during the
forward (the same `_run_layers` the backward's recompute calls, on the same weights), its segments
held until the backward reaches them. Which ones: the first `n` in the backward's order, which is
the last block first and, within a block, micro-batch 0 first. So the graphs the forward makes last
are the first the backward frees, and within a partly kept block the kept graphs drain before the
others are recomputed, so a recompute never runs beside them. All kept graphs live together at the
head (the device model's `kept_activations` part). A block kept for every micro-batch needs no
backward upload: its forward weights, which the graphs hold, serve its backward too.

Parity: the backward of a kept graph runs the same operations on the same inputs and weights as the
recompute it replaces, so on CPU losses and weights are bit-identical to full recompute.

GRPO's rollout copy shares the GPU (`Stage`): the engine's own in its process, or the cluster's replica in
another (`rollout_apart`). `plan_beside_rollout` places the copy (resident or streamed) and resolves the count
for the rollout's step shape before step 1, so a copy or a number that cannot fit is refused with the sizes
and the key to change, never as an out-of-memory error mid-step.

How many: a number as given, refused (`InsufficientMemoryError`) on a GPU whose budget (the
calculator's: `gpu_memory_limit_gb` or the device's memory, times its headroom) holds fewer beside
the schedule's own peak; `auto` as many as that budget holds, and none on CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch

from mt_ray.engine.calculator import GPU_HEADROOM
from mt_ray.engine.config import EngineConfig
from mt_ray.engine.sizing import GIB, SFT, Stage, device_bytes, max_kept, rollout_bytes
from mt_ray.engine.transfer import StreamSet
from mt_ray.errors import InsufficientMemoryError
from mt_ray.models.discovery import ModelSpec


class KeptBlocks:
    """The step's kept block graphs: which (block, micro-batch) pairs, their segments and the forward's weights."""

    def __init__(self, spec: ModelSpec, streams: StreamSet, stage: Stage = SFT):
        """`stage`: what the run's stage holds on the device beside the step (GRPO's rollout copy), which `auto`
        leaves room for."""
        self.spec, self.streams, self.stage = spec, streams, stage
        self._counts: dict[tuple, int] = {}  # `keep_activations` resolved, by setting and step shape
        self._keys: set[tuple[int, int]] = set()
        self._whole: set[int] = set()
        self._graphs: dict[tuple[int, int], list] = {}
        self._weights: dict[int, dict[int, Any]] = {}
        self.last_count = 0  # graphs the latest step kept (for benchmarks and logs)

    def start(self, cfg: EngineConfig, n_blocks: int, n_micro: int, micro_batch: int, seq: int) -> None:
        """Begin a step of `n_micro` micro-batches of `micro_batch` x `seq` tokens: resolve `keep_activations`
        (refused where it cannot fit, before anything runs) once per shape, then keep that many graphs."""
        key = (cfg.keep_activations, cfg.schedule, n_micro, micro_batch, seq)
        if key not in self._counts:
            self._counts[key] = resolve_kept(self.spec, cfg, self.streams.device, micro_batch, seq, n_micro,
                                             self.stage)
        self.keep(n_blocks, n_micro, self._counts[key])

    def plan(self, cfg: EngineConfig, micro_batch: int, seq: int, n_micro: int, stage: Stage | None = None) -> Stage:
        """Before step 1: take `stage` (what shares this GPU: a GRPO rollout copy and its rows), place its copy and
        resolve `keep_activations` for steps of `n_micro` micro-batches of `micro_batch` x up to `seq` tokens,
        refused (`InsufficientMemoryError`) where either cannot fit. Returns the stage planned."""
        stage, kept = plan_beside_rollout(self.spec, cfg, stage or self.stage, _budget_gb(cfg, self.streams.device),
                                          micro_batch, seq, n_micro)
        if stage != self.stage:
            self.stage = stage
            self._counts.clear()  # planned for what no longer shares the GPU
        self._counts[(cfg.keep_activations, cfg.schedule, n_micro, micro_batch, seq)] = kept
        return stage

    def hold_state(self, device_state_bytes: int) -> None:
        """From the next step on, plan beside the optimizer state the run keeps on the GPU (`device_plan.py`)."""
        self.stage = replace(self.stage, device_state_bytes=device_state_bytes)
        self._counts.clear()

    def budget_gb(self, cfg: EngineConfig) -> float | None:
        """The GPU's GiB the calculator plans for; None on the CPU."""
        return _budget_gb(cfg, self.streams.device)

    def keep(self, n_blocks: int, n_micro: int, kept: int) -> None:
        """Keep the first `kept` graphs in backward order (last block first, micro-batch 0 first)."""
        self.clear()  # a step that failed midway may have left graphs behind
        order = [(b, j) for b in reversed(range(n_blocks)) for j in range(n_micro)]
        self._keys = set(order[:kept])
        self.last_count = len(self._keys)
        self._whole = {b for b in range(n_blocks) if all((b, j) in self._keys for j in range(n_micro))}

    @contextlib.contextmanager
    def misses_reported(self, cfg: EngineConfig, n_micro: int, micro_batch: int, seq: int) -> Iterator[None]:
        """A step that runs out of GPU memory with graphs kept under `auto` is the calculator's miss: reported
        with its predicted and measured peaks and what to set instead, not as a bare CUDA error."""
        try:
            yield
        except torch.OutOfMemoryError as e:
            if cfg.keep_activations != "auto" or not self.last_count:
                raise
            kept = cfg.model_copy(update={"keep_activations": self.last_count})
            predicted = device_bytes(self.spec, kept, micro_batch, seq, micro_batch * n_micro,
                                     stage=self.stage)["total"] / GIB
            cuda = self.streams.device.type == "cuda"
            measured = f"{torch.cuda.max_memory_allocated(self.streams.device) / GIB:.3g} GiB" if cuda else "unknown"
            raise InsufficientMemoryError(
                f"engine.keep_activations: auto kept {self.last_count} block graphs and the step ran out of GPU "
                f"memory: the calculator's miss (predicted peak {predicted:.3g} GiB, measured {measured} when it ran "
                f"out). Set engine.keep_activations to fewer (e.g. {self.last_count // 2}) or 0; the miss is worth "
                "reporting") from e

    def clear(self) -> None:
        self._keys, self._whole = set(), set()
        self._graphs.clear()
        self._weights.clear()

    def keeps(self, b: int, j: int) -> bool:
        return (b, j) in self._keys

    def whole(self, b: int) -> bool:
        """Kept for every micro-batch: the backward uploads none of the block's layers."""
        return b in self._whole

    def put(self, b: int, j: int, segments: list, weights: dict[int, Any]) -> None:
        self._graphs[(b, j)] = segments
        self._weights[b] = weights

    def take(self, b: int, j: int) -> tuple[list, dict[int, Any]]:
        return self._graphs.pop((b, j)), self._weights[b]

    def release(self, b: int) -> None:
        """Drop block b's forward weights once its backward is queued. They were allocated on the upload
        stream, so that stream waits for the compute queued so far before their memory can be reused."""
        if self._weights.pop(b, None) is not None:
            self.streams.wait(self.streams.h2d, self.streams.record(self.streams.compute))


def resolve_kept(spec: ModelSpec, cfg: EngineConfig, device: torch.device, micro_batch: int, seq: int,
                 n_micro: int, stage: Stage = SFT) -> int:
    """The block graphs a step of `n_micro` micro-batches of `micro_batch` x `seq` tokens keeps."""
    if cfg.schedule != "stream" or cfg.keep_activations == 0:
        return 0
    if device.type != "cuda":
        return 0 if cfg.keep_activations == "auto" else cfg.keep_activations
    return kept_within(spec, cfg, _budget_gb(cfg, device), micro_batch, seq, n_micro, stage)


def _budget_gb(cfg: EngineConfig, device: torch.device) -> float | None:
    """The GPU's GiB the calculator plans for (`gpu_memory_limit_gb` or the device's memory); None on the CPU."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    total_gb = torch.cuda.get_device_properties(index).total_memory / GIB
    return min(total_gb, cfg.gpu_memory_limit_gb or total_gb)


def plan_beside_rollout(spec: ModelSpec, cfg: EngineConfig, stage: Stage, gpu_gb: float | None, micro_batch: int,
                        seq: int, n_micro: int) -> tuple[Stage, int]:
    """`stage` with its rollout copy placed on a `gpu_gb` GiB GPU (None: the CPU, no GPU to plan for), and the kept
    block graphs beside it. `auto` takes the resident copy where the step without kept graphs fits beside it, else
    the streamed one; a copy that cannot fit even streamed, or a `keep_activations` number above the largest that
    fits, is refused with the sizes and the key to change."""
    if stage.rollout_tokens and stage.rollout_placement == "auto":
        resident = replace(stage, rollout_placement="resident")
        fits = gpu_gb is None or _planned(spec, cfg, micro_batch, seq, n_micro, resident) <= _budget(gpu_gb)
        stage = resident if fits else replace(stage, rollout_placement="streamed")
    if gpu_gb is None:
        return stage, 0 if cfg.keep_activations == "auto" else cfg.keep_activations
    if stage.rollout_tokens and _planned(spec, cfg, micro_batch, seq, n_micro, stage) > _budget(gpu_gb):
        raise InsufficientMemoryError(_copy_refusal(spec, cfg, stage, gpu_gb, micro_batch, seq, n_micro))
    if cfg.schedule != "stream" or cfg.keep_activations == 0:
        return stage, 0
    return stage, kept_within(spec, cfg, gpu_gb, micro_batch, seq, n_micro, stage)


def _budget(gpu_gb: float) -> float:
    return gpu_gb * GIB * GPU_HEADROOM


def _planned(spec: ModelSpec, cfg: EngineConfig, micro_batch: int, seq: int, n_micro: int, stage: Stage) -> int:
    """The device model's peak of a step with no kept graphs, with what `stage` holds beside it."""
    base = cfg.model_copy(update={"keep_activations": 0})
    return device_bytes(spec, base, micro_batch, seq, micro_batch * n_micro, stage=stage)["total"]


def _copy_refusal(spec: ModelSpec, cfg: EngineConfig, stage: Stage, gpu_gb: float, micro_batch: int, seq: int,
                  n_micro: int) -> str:
    rows = stage.rollout_rows or micro_batch * n_micro
    copy, generation = rollout_bytes(spec, cfg, rows, stage.rollout_tokens, stage.rollout_streamed)
    step = _planned(spec, cfg, micro_batch, seq, n_micro, replace(stage, rollout_tokens=0))
    where = "a rollout replica in its own process" if stage.rollout_apart else "the rollout copy"
    advice = ("fewer completions per step (training.micro_batch_size x grad_accum_steps), a shorter "
              "grpo.max_completion_length or max_prompt_length, cluster.rollout_gpus (a GPU of the replica's own) or "
              "a larger GPU" if stage.rollout_streamed else "rollout.placement: streamed (or auto)")
    return (f"grpo rollouts: {where} ({stage.rollout_placement}: {copy / GIB:.1f} GiB of weights, {generation / GIB:.1f} "
            f"GiB of key/value cache and workspace for {rows} completions of up to {stage.rollout_tokens} tokens) does "
            f"not fit beside the update ({step / GIB:.1f} GiB, {n_micro} micro-batches of {micro_batch} x {seq} tokens) "
            f"in {GPU_HEADROOM:.0%} of a {gpu_gb:.3g} GiB GPU; use {advice}")


def kept_within(spec: ModelSpec, cfg: EngineConfig, gpu_gb: float, micro_batch: int, seq: int, n_micro: int,
                stage: Stage = SFT) -> int:
    """`keep_activations` on a `gpu_gb` GiB GPU (the calculator's budget: its headroom of it): `auto` as many
    graphs as fit beside the stream schedule's peak (and what `stage` holds), a number as given, or refused where
    more than fit."""
    largest = max_kept(spec, cfg, micro_batch, seq, micro_batch * n_micro, gpu_gb * GIB * GPU_HEADROOM, stage=stage)
    if cfg.keep_activations == "auto":
        return largest
    if cfg.keep_activations > largest:
        raise InsufficientMemoryError(
            f"engine.keep_activations {cfg.keep_activations} block graphs do not fit a {gpu_gb:.3g} GiB GPU beside "
            f"the stream schedule ({n_micro} micro-batches of {micro_batch} x {seq} tokens)"
            + (" and GRPO's rollout copy" if stage.rollout_tokens else "") + ": the largest that fits "
            f"is {largest}; set engine.keep_activations: {largest} (or auto)")
    return cfg.keep_activations


__all__ = ["KeptBlocks", "kept_within", "plan_beside_rollout", "resolve_kept"]
