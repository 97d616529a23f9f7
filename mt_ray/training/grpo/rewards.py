"""Reward functions and group advantages, as TRL's `GRPOTrainer` computes them.

A reward function has TRL's signature, `f(prompts, completions, **columns) -> list[float | None]`: the
prompt and completion texts of every sampled completion (a prompt repeated G times), and each extra
column of the prompt's dataset row (`answer`, ...) as a list of the same length. None means "cannot
score this one" (NaN below, as TRL). A completion's reward is the weighted sum of its functions'
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
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from mt_ray.engine.grpo import RewardConfig
from mt_ray.errors import ConfigError

RewardFn = Callable[..., list]
FINAL_ANSWER = re.compile(r"####\s*(-?\d+(?:\.\d+)?)\s*$")


class RewardError(RuntimeError):
    """A reward function failed or returned something unusable; the step is not applied."""


def accuracy(prompts: list[str], completions: list[str], answer: list, **_) -> list[float | None]:
    """1 where the completion's final answer equals the row's `answer` (math-verify), else 0; None where the
    answer itself cannot be parsed."""
    from math_verify import parse, verify  # checked present by `load_rewards`

    out: list[float | None] = []
    for completion, gold in zip(completions, answer, strict=True):
        parsed_gold = parse(str(gold))
        out.append(float(verify(parsed_gold, parse(completion))) if parsed_gold else None)
    return out


def format_reward(prompts: list[str], completions: list[str], **_) -> list[float]:
    """1 where the completion ends with `#### <number>`, else 0."""
    return [1.0 if FINAL_ANSWER.search(c.strip()) else 0.0 for c in completions]


BUILT_IN: dict[str, RewardFn] = {"accuracy": accuracy, "format": format_reward}


@dataclass
class Rewards:
    """The run's reward functions, their names (TRL's metric names use them) and weights."""

    names: list[str]
    funcs: list[RewardFn]
    weights: torch.Tensor  # [F]

    def score(self, prompts: list[str], completions: list[str], columns: dict[str, list]) -> torch.Tensor:
        """Each function's reward of each completion [B, F] (NaN for None); `RewardError` names the function and
        the completion's prompt index when one raises or returns the wrong number of rewards."""
        out = torch.full((len(completions), len(self.funcs)), math.nan)
        for f, (name, func) in enumerate(zip(self.names, self.funcs, strict=True)):
            out[:, f] = torch.tensor(_call(name, func, prompts, completions, columns), dtype=torch.float32)
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
    module, _, attr = path.partition(":")
    try:
        func = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"grpo.rewards: cannot import {path!r} ({e}); give an importable 'module:function'") from None
    if not callable(func):
        raise ConfigError(f"grpo.rewards: {path!r} is not callable")
    return func


def _call(name: str, func: RewardFn, prompts: list[str], completions: list[str], columns: dict[str, list]) -> list:
    """The function's rewards as floats (None -> NaN), or `RewardError` naming what went wrong and where."""
    try:
        values = list(func(prompts=prompts, completions=completions, **columns))
    except Exception as e:  # a user function may raise anything: find the completion it fails on
        index = _first_failing(func, prompts, completions, columns)
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


def _first_failing(func: RewardFn, prompts, completions, columns) -> int | None:
    for i in range(len(completions)):
        try:
            func(prompts=prompts[i:i + 1], completions=completions[i:i + 1],
                 **{k: v[i:i + 1] for k, v in columns.items()})
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
