"""Reward functions and group advantages, as TRL's `GRPOTrainer` computes them.

A reward function is called as TRL's `GRPOTrainer` calls it (`trl_arguments`), so one written for TRL runs
unchanged: `f(prompts=..., completions=..., completion_ids=..., **columns, trainer_state=..., log_extra=...,
log_metric=...) -> list[float | None]`, one entry per sampled completion (a prompt repeated G times). For
standard (alpaca) data the prompts and completions are strings (the prompt as rendered for the model); for
conversational (sharegpt) data, message lists: each prompt its messages, each completion
`[{"role": "assistant", "content": text}]`. Each other column of the prompt's row (`answer`, ...) comes as a
list of the same length; `trainer_state` is transformers' `TrainerState` (`global_step`, `max_steps`, `epoch`);
`log_metric(name, value)` adds a metric to the step's logs and `log_extra(column, values)` a column to its
completions table. None means "cannot score this one" (NaN below, as TRL). A completion's reward is the weighted sum of its functions'
rewards; its advantage is that reward minus its group's mean, divided by the group's (or the batch's)
standard deviation + 1e-4 (`scale_rewards`).

Built in: `accuracy` (math-verify's parse and verify of the completion against the row's `answer`,
the library TRL and open-r1 use) and `format` (the completion ends with `#### <number>`, the form the
demo task asks for). Users name theirs as `module:function`.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import re
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mt_ray.engine.grpo import RewardConfig
from mt_ray.errors import ConfigError, MtRayError
from mt_ray.training.grpo.prompts import Prompt

RewardFn = Callable[..., list]
FINAL_ANSWER = re.compile(r"####\s*(-?\d+(?:\.\d+)?)\s*$")


class RewardError(MtRayError, RuntimeError):
    """A reward function failed or returned something unusable; the step is not applied, and the command ends
    with this one line (an `MtRayError`), as the README promises."""


def accuracy(prompts: list, completions: list, answer: list, **_) -> list[float | None]:
    """1 where the completion's final answer equals the row's `answer` (math-verify), else 0; None where the
    answer itself cannot be parsed."""
    from math_verify import parse, verify  # checked present by `load_rewards`

    out: list[float | None] = []
    for completion, gold in zip(completions, answer, strict=True):
        parsed_gold = parse(str(gold))
        out.append(float(verify(parsed_gold, parse(_text(completion)))) if parsed_gold else None)
    return out


def format_reward(prompts: list, completions: list, **_) -> list[float]:
    """1 where the completion ends with `#### <number>`, else 0."""
    return [1.0 if FINAL_ANSWER.search(_text(c).strip()) else 0.0 for c in completions]


def _text(completion: str | list[dict[str, Any]]) -> str:
    """A completion's text, standard (a string) or conversational (`[{"role": "assistant", "content": ...}]`)."""
    return completion if isinstance(completion, str) else completion[0]["content"]


@dataclass
class RewardLogs:
    """What reward functions logged through TRL's `log_metric` and `log_extra` while scoring one rollout."""

    metrics: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    columns: dict[str, list] = field(default_factory=lambda: defaultdict(list))

    def log_metric(self, name: str, value: float) -> None:
        self.metrics[name].append(float(value))

    def log_extra(self, column: str, values: list) -> None:
        self.columns[column].extend(values)

    def means(self) -> dict[str, float]:
        """Each logged metric's mean over the rollout, as TRL averages them over a logging step."""
        return {name: sum(v) / len(v) for name, v in self.metrics.items() if v}


def trl_arguments(prompts: list[Prompt], texts: list[str], completion_ids: list[list[int]], state: Any,
                  logs: RewardLogs) -> tuple[list, list, dict[str, list], dict[str, Any]]:
    """The arguments TRL's `GRPOTrainer` passes a reward function for these completions of `prompts` (each
    repeated G times): (prompts, completions, per-completion columns, shared keyword arguments)."""
    if prompts[0].messages is not None:  # conversational, as TRL's `is_conversational` finds it
        prompt_args: list = [p.messages for p in prompts]
        completions: list = [[{"role": "assistant", "content": t}] for t in texts]
    else:
        prompt_args, completions = [p.text for p in prompts], list(texts)
    columns = {k: [p.columns.get(k) for p in prompts] for k in prompts[0].columns}
    columns["completion_ids"] = completion_ids
    shared = {"trainer_state": state, "log_extra": logs.log_extra, "log_metric": logs.log_metric}
    return prompt_args, completions, columns, shared


BUILT_IN: dict[str, RewardFn] = {"accuracy": accuracy, "format": format_reward}


@dataclass
class Rewards:
    """The run's reward functions, their names (TRL's metric names use them) and weights."""

    names: list[str]
    funcs: list[RewardFn]
    weights: torch.Tensor  # [F]

    def score(self, prompts: list, completions: list, columns: dict[str, list],
              shared: dict[str, Any] | None = None) -> torch.Tensor:
        """Each function's reward of each completion [B, F] (NaN for None), called with `prompts`, `completions`,
        the per-completion `columns` and the `shared` keyword arguments (`trl_arguments`); `RewardError` names the
        function and the completion's prompt index when one raises or returns the wrong number of rewards."""
        out = torch.full((len(completions), len(self.funcs)), math.nan)
        for f, (name, func) in enumerate(zip(self.names, self.funcs, strict=True)):
            out[:, f] = torch.tensor(_call(name, func, prompts, completions, columns, shared or {}),
                                     dtype=torch.float32)
        return out


def load_rewards(configs: Sequence[RewardConfig]) -> Rewards:
    """Resolve `grpo.rewards`: built-ins by name, others imported as `module:function`."""
    names, funcs = [], []
    for cfg in configs:
        if cfg.name == "accuracy" and importlib.util.find_spec("math_verify") is None:
            raise ConfigError("grpo.rewards: accuracy needs the math-verify package; pip install math-verify, or "
                              "use another reward")
        func = BUILT_IN.get(cfg.name) or _import(cfg.name)
        names.append(cfg.name.rsplit(":", 1)[-1])
        funcs.append(func)
    return Rewards(names, funcs, torch.tensor([c.weight for c in configs], dtype=torch.float32))


def _import(path: str) -> RewardFn:
    """`module:function`, the module found as `python train.py` finds a TRL user's: in the folder the run was
    started from as well (the `mt-ray` script, unlike `python -m`, does not put it on `sys.path`)."""
    module, _, attr = path.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())  # after the installed packages, so a reward module shadows none of them
    try:
        func = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"grpo.rewards: cannot import {path!r} ({e}); give an importable 'module:function'") from None
    if not callable(func):
        raise ConfigError(f"grpo.rewards: {path!r} is not callable")
    return func


def _call(name: str, func: RewardFn, prompts: list, completions: list, columns: dict[str, list],
          shared: dict[str, Any]) -> list:
    """The function's rewards as floats (None -> NaN), or `RewardError` naming what went wrong and where."""
    try:
        values = list(func(prompts=prompts, completions=completions, **columns, **shared))
    except Exception as e:  # a user function may raise anything: find the completion it fails on
        index = _first_failing(func, prompts, completions, columns, shared)
        where = f" on completion {index} (prompt {prompts[index]!r})" if index is not None else ""
        raise RewardError(f"reward '{name}' raised{where}: {type(e).__name__}: {e}") from e
    if len(values) != len(completions):
        raise RewardError(f"reward '{name}' returned {len(values)} rewards for {len(completions)} completions; "
                          "return one per completion")
    for i, v in enumerate(values):
        if v is not None and not isinstance(v, (int, float)):
            raise RewardError(f"reward '{name}' returned {v!r} for completion {i} (prompt {prompts[i]!r}); "
                              "return a number or None")
    return [math.nan if v is None else float(v) for v in values]


def _first_failing(func: RewardFn, prompts, completions, columns, shared) -> int | None:
    for i in range(len(completions)):
        try:
            func(prompts=prompts[i:i + 1], completions=completions[i:i + 1],
                 **{k: v[i:i + 1] for k, v in columns.items()}, **shared)
        except Exception:  # the same failure, now located
            return i
    return None


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Standard deviation ignoring NaNs, with Bessel's correction (NaN below two values), as TRL's."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    variance = variance * torch.where(count > 1, count / (count - 1), torch.full_like(variance, math.nan))
    std = variance.sqrt()
    return std.squeeze(dim) if dim is not None else std.reshape(())


def advantages_and_metrics(per_func: torch.Tensor, rewards: Rewards, group: int,
                           scale: str) -> tuple[torch.Tensor, dict[str, float]]:
    """Each completion's advantage [B] from the functions' rewards [B, F] (completions in groups of `group`),
    and TRL's reward metrics."""
    unscorable = torch.isnan(per_func).all(dim=1)
    total = (per_func * rewards.weights).nansum(dim=1)
    total[unscorable] = math.nan
    mean = torch.nanmean(total.view(-1, group), dim=1).repeat_interleave(group)
    if scale == "batch":
        std = nanstd(total).expand_as(total)
    else:  # group, and `none`, which reads it for frac_reward_zero_std only
        std = nanstd(total.view(-1, group), dim=1).repeat_interleave(group)
    advantages = total - mean
    if scale != "none":
        advantages = advantages / (std + 1e-4)
    metrics: dict[str, float] = {}
    for f, name in enumerate(rewards.names):
        metrics[f"rewards/{name}/mean"] = torch.nanmean(per_func[:, f]).item()
        metrics[f"rewards/{name}/std"] = nanstd(per_func[:, f]).item()
    metrics["reward"] = torch.nanmean(total).item()
    metrics["reward_std"] = nanstd(total).item()
    metrics["frac_reward_zero_std"] = torch.isclose(std, torch.zeros_like(std)).float().mean().item()
    return torch.nan_to_num(advantages, nan=0.0), metrics
