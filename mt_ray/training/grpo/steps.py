"""GRPO's step source: what the trainer draws instead of an SFT loader's batches.

Every `num_iterations` steps it makes a rollout batch, as TRL's generation batch (one step's completions:
micro_batch_size x grad_accum_steps, so prompts = that / G): refresh the device copy from the master
weights (all updates so far landed; on the Ray cluster, each rollout replica's copy from its node's arena),
sample G completions per prompt, score them, turn rewards into
advantages, and build the engine's micro-batches. The steps in between train on the same batch, with the
log-probs the rollout's first step computed as the old policy's (`keep_old_logps`).
Each rollout's metrics (TRL's names, plus the refresh's and generation's times) ride along to the logs, and its
completions to the MLflow completions table. A checkpoint between a rollout's iterations keeps the rollout
(`ScoredRollout`), so a resume trains on the same completions.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase, TrainerState

from mt_ray.config.run import RunConfig
from mt_ray.data.loader import pad_token_id
from mt_ray.engine import StreamingEngine
from mt_ray.models.discovery import ModelSpec
from mt_ray.training.auto_fit import rollout_placement
from mt_ray.training.grpo.old_logps import keep_old_logps
from mt_ray.training.grpo.prompts import PromptStream, cut_prompts_line, read_prompts
from mt_ray.training.grpo.rewards import RewardLogs, advantages_and_metrics, load_rewards, trl_arguments
from mt_ray.training.grpo.rollout import LocalSampler, Rollout, completion_batches
from mt_ray.training.grpo.scored import ScoredRollout

log = logging.getLogger(__name__)


class GrpoSteps:
    """Each step's micro-batches (`next`), its rollout's metrics (`metrics`) and completions (`completions_table`),
    and the prompt position and rollout in flight (state)."""

    def __init__(self, cfg: RunConfig, engine, spec: ModelSpec, tokenizer: PreTrainedTokenizerBase):
        self.cfg, self.g = cfg, cfg.grpo
        self.engine = engine
        self.tokenizer = tokenizer
        t = cfg.training
        self.completions = t.micro_batch_size * t.grad_accum_steps
        prompts = read_prompts(cfg.data, tokenizer, self.g.max_prompt_length)
        if line := cut_prompts_line(prompts, self.g.max_prompt_length):
            print(line, flush=True)  # once, before the banner: summary.json's data.cut_prompts counts the draws
        self.stream = PromptStream(prompts, t.seed)
        self.rewards = load_rewards(self.g.rewards)  # a missing library or function is refused before the copy
        self.sampler = build_sampler(cfg, engine, spec, self.completions,
                                     self.g.max_prompt_length + self.g.max_completion_length)
        self.pad_id = pad_token_id(tokenizer)
        self.eos_ids = {tokenizer.eos_token_id, *self.sampler.generation_eos()}
        self.scored: ScoredRollout | None = None
        self.batches: list[dict] | None = None
        self._step = 0

    @property
    def metrics(self) -> dict[str, float]:
        """The current rollout's metrics: TRL's rewards and completion lengths, and the rollout's times."""
        return self.scored.metrics if self.scored is not None else {}

    def __next__(self) -> list[dict]:
        if self._step % self.g.num_iterations == 0 or self.batches is None:
            self._rollout()
        else:
            self._keep_old_logps()
        self._step += 1
        return self.batches

    def _rollout(self) -> None:
        g = self.g
        refresh_s = self.sampler.refresh()  # waits for every update so far
        prompts = self.stream.take(self.completions // g.num_generations)
        start = time.perf_counter()
        rollout = self.sampler.generate([p.ids for p in prompts], g, self.eos_ids, self.pad_id,
                                     seed=self.cfg.training.seed * 1_000_003 + self._step)
        generate_s = time.perf_counter() - start
        texts = self.tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)
        grouped = [p for p in prompts for _ in range(g.num_generations)]
        logs = RewardLogs()
        per_func = self.rewards.score(*trl_arguments(grouped, texts, rollout.completion_ids, self._trainer_state(),
                                                     logs))
        advantages, metrics = advantages_and_metrics(per_func, self.rewards, g.num_generations, g.scale_rewards)
        new_tokens = sum(rollout.lengths)
        metrics = {**metrics, **logs.means(), **completion_metrics(rollout), "rollout/refresh_s": refresh_s,
                   "rollout/generate_s": generate_s, "rollout/tokens_per_s": new_tokens / max(generate_s, 1e-9)}
        self.scored = ScoredRollout(rollout, [p.text for p in grouped], texts, per_func, advantages, metrics,
                                    dict(logs.columns))
        self.batches = self._micro_batches(self.scored)

    def _trainer_state(self) -> TrainerState:
        """What TRL hands reward functions as `trainer_state` (for shaping rewards by training progress)."""
        epoch = self.stream.epoch + self.stream.index / len(self.stream.prompts)
        return TrainerState(global_step=self._step, max_steps=self.cfg.training.steps, epoch=epoch)

    def _micro_batches(self, scored: ScoredRollout) -> list[dict]:
        return completion_batches(scored.rollout, scored.advantages, self.g.mask_truncated_completions,
                                  self.cfg.training.micro_batch_size, self.pad_id)

    def _keep_old_logps(self) -> None:
        """After the rollout's first step: its log-probs become the old policy's for the steps after it."""
        if "old_logps" not in self.batches[0]:
            keep_old_logps(self.engine, self.batches)

    def completions_table(self, step: int) -> dict[str, list]:
        """The current rollout's completions as the table of `step`: prompt, completion, each reward function's
        reward, advantage."""
        return self.scored.table(step, self.rewards.names)

    def stats(self) -> dict[str, Any]:
        s = self.stream.state_dict()
        return {"prompts": s["drawn"], "cut_prompts": s["cut"], "epochs": s["epoch"]}

    def state_dict(self) -> dict[str, Any]:
        """The prompt position and step; between the iterations of a rollout, the rollout too (call after a step)."""
        state: dict[str, Any] = {"prompts": self.stream.state_dict(), "step": self._step}
        if self.batches is not None and self._step % self.g.num_iterations != 0:
            self._keep_old_logps()
            old = [b["old_logps"] for b in self.batches]
            state["rollout"] = self.scored.state_dict(self.g.num_generations, old)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint: the rollout it was training on, if its iterations were not done, else a
        new rollout from the prompts after the saved ones."""
        self.stream.load_state_dict(state["prompts"])
        self._step = state["step"]
        self.scored, self.batches = None, None
        if "rollout" in state:
            self.scored, old_logps = ScoredRollout.from_state(state["rollout"], self.g.num_generations)
            self.batches = self._micro_batches(self.scored)
            for batch, logp_N in zip(self.batches, old_logps, strict=True):
                batch["old_logps"] = logp_N

    def close(self) -> None:
        self.sampler.close()


def build_sampler(cfg: RunConfig, engine, spec: ModelSpec, rows: int, tokens: int):
    """The rollout's sampler: a copy in this process beside a single engine (placed by the device model), or a
    rollout replica beside each of the Ray cluster's workers (Ray is imported only then). Either way the GPU's
    plan (the copy's placement, the kept block graphs beside it) is made first: what cannot fit is refused before
    step 1."""
    t = cfg.training
    if isinstance(engine, StreamingEngine):
        placement = rollout_placement(cfg, spec)
        log.info("grpo rollouts: the %s copy (rollout.placement %s)", placement, cfg.rollout.placement)
        engine.kept.plan(cfg.engine, t.micro_batch_size, tokens, t.grad_accum_steps)
        return LocalSampler(engine, spec, rows, tokens, placement)
    from mt_ray.training.grpo.remote import RemoteSampler

    return RemoteSampler(engine, rows, tokens, cfg.grpo.num_generations, cfg.rollout.placement, t.micro_batch_size)


def completion_metrics(rollout: Rollout) -> dict[str, float]:
    """TRL's completions/* metrics: lengths of all completions, of those that ended, and the share truncated."""
    lengths = torch.tensor(rollout.lengths, dtype=torch.float32)
    truncated = torch.tensor(rollout.truncated)
    ended = lengths[~truncated] if (~truncated).any() else torch.zeros(1)
    return {"completions/mean_length": lengths.mean().item(), "completions/min_length": lengths.min().item(),
            "completions/max_length": lengths.max().item(), "completions/clipped_ratio": truncated.float().mean().item(),
            "completions/mean_terminated_length": ended.mean().item(),
            "completions/min_terminated_length": ended.min().item(),
            "completions/max_terminated_length": ended.max().item()}
