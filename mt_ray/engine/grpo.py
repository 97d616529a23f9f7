"""GRPO's loss on per-token log-probs, as TRL's `GRPOTrainer._compute_loss` computes it.

A GRPO step trains on completions sampled from the policy (G per prompt), each with an advantage `A`
(its reward against its group's, mt_ray/training/grpo/rewards.py). Per completion token, with `p` the
policy's log-prob of the token under logits / temperature, `o` the old policy's (the policy that
sampled the rollout; `p` itself, without gradient, when each rollout is trained on once) and `r` the
reference's:

  ratio = exp(p - o),  l = -min(ratio·A, clip(ratio, 1 - ε, 1 + ε_high)·A) + β·k·(exp(r - p) - (r - p) - 1)

(k = ratio with `use_bias_correction_kl`, TRL's default, else 1.)

`loss_type` says how each micro-batch's token losses add up to the step's (M micro-batches):

  grpo     mean over its completions of each one's token mean, / M
  bnpo     its token mean, / M
  dr_grpo  its token sum / (completions · max_completion_length), / M
  dapo     its token sum / the step's loss tokens

Each token's term is a function of its own log-prob, so the engine's head (reference.py's `PreferenceSteps`)
asks this loss for dL/dp of a chunk's tokens within the chunked forward that gives their log-probs, and
weights each token's log-prob by it in that chunk's backward: one head forward a micro-batch, where the
preference losses (functions of whole sequences) need one more without a graph first. Metrics carry TRL's
names and are means over the step's micro-batches, as TRL averages what each of its micro-batches logged.

Shape key: N loss tokens of a micro-batch, S its sequence slots (rows x segments).
"""

from __future__ import annotations

import importlib.util
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
BUILT_IN_REWARDS = ("accuracy", "format")


class RewardConfig(BaseModel):
    """One reward function and its weight in the summed reward."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    name: str
    """`accuracy` (the completion's final answer equals the row's `answer`, through math-verify), `format`
    (the completion ends with its answer after `####`, in the form the demo task asks for), or a user function
    as `module:function` with TRL's signature `f(prompts, completions, **columns) -> list[float]`."""
    weight: float = 1.0
    """Its weight in the reward (TRL's reward_weights)."""

    @model_validator(mode="before")
    @classmethod
    def _a_name_alone(cls, value: Any) -> Any:
        """`grpo.rewards=[format, my_rewards:len_reward]`: a name alone is that reward at weight 1, as TRL's
        `reward_funcs` lists them."""
        return {"name": value} if isinstance(value, str) else value

    @field_validator("name")
    @classmethod
    def _known_or_importable(cls, value: str) -> str:
        if value not in BUILT_IN_REWARDS and value.count(":") != 1:
            raise ValueError(f"{value!r} is neither a built-in reward ({', '.join(BUILT_IN_REWARDS)}) nor a "
                             "'module:function' path")
        return value


class GrpoConfig(BaseModel):
    """The `grpo` section (`training.stage: grpo`): TRL's GRPOConfig options under their TRL names and defaults."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    num_generations: int = 8
    """G: completions sampled per prompt; the step's completions (micro_batch_size x grad_accum_steps) are
    prompts x G."""
    max_prompt_length: int = Field(512, ge=1)
    """Prompt tokens kept (the end of a longer prompt is cut, and counted as SFT counts cut examples)."""
    max_completion_length: int = Field(512, ge=1)
    """New tokens sampled at most per completion (and dr_grpo's normaliser)."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature; the loss's log-probs are taken of logits / temperature, as TRL's."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling: the smallest set of tokens whose probability reaches top_p."""
    beta: float = Field(0.0, ge=0)
    """KL coefficient against the reference (the starting weights, streamed as a preference stage's); 0 holds
    no reference."""
    use_bias_correction_kl: bool = True
    """The KL term times the ratio, so that its gradient is the unbiased reverse-KL gradient (DeepSeek-V3.2;
    TRL's default)."""
    epsilon: float = Field(0.2, gt=0, lt=1)
    """Lower clipping range of the ratio: clip(ratio, 1 - epsilon, 1 + epsilon_high)."""
    epsilon_high: float | None = Field(None, gt=0)
    """Upper clipping range; default: epsilon (DAPO recommends 0.28)."""
    num_iterations: int = Field(1, ge=1)
    """Optimizer steps per rollout batch (TRL's μ); above 1, the sampling policy's log-probs are kept for the
    ratio."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Advantages divided by the std of their group's rewards (`group`), of the whole batch's (`batch`), or not."""
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "dapo"
    """How token losses add up to the step's loss (see mt_ray/engine/grpo.py)."""
    mask_truncated_completions: bool = False
    """Completions cut at max_completion_length (no end-of-sequence token) carry no loss."""
    rewards: list[RewardConfig] = Field(default_factory=lambda: [RewardConfig(name="accuracy")])
    """Reward functions, each with a weight; a completion's reward is their weighted sum."""
    log_completions_every: int = Field(10, ge=0)
    """With MLflow tracking: every this many steps, the completions the step trained on as an MLflow table
    (`completions/step-<step>.json`: step, prompt, completion, each reward function's reward, advantage; TRL's
    `log_completions` columns), one file a step so that logging one never rewrites the others; 0: never."""

    @field_validator("num_generations")
    @classmethod
    def _a_group(cls, value: int) -> int:
        if value < 2:
            raise ValueError(f"{value}: a group of one completion has advantage 0 and trains nothing; use 2 or more")
        return value

    @field_validator("scale_rewards", mode="before")
    @classmethod
    def _trl_booleans(cls, value: Any) -> Any:
        return {True: "group", False: "none"}.get(value, value) if isinstance(value, bool) else value

    @model_validator(mode="after")
    def _some_reward(self) -> GrpoConfig:
        if not self.rewards:
            raise ValueError("grpo.rewards: name at least one reward function")
        return self

    @property
    def epsilon_upper(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


class RolloutConfig(BaseModel):
    """The `rollout` section (`training.stage: grpo`): what samples the completions."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    engine: Literal["transformers", "vllm"] = "transformers"
    """`transformers`: a copy of the policy (a transformers module) on the GPU, refreshed from the master weights
    after each update, decoding on a static key/value cache with each token step replayed from a CUDA graph
    (`generate`'s semantics; `generate` itself for a family whose cache cannot be static). TRL's `use_vllm` has no
    equivalent: vLLM and SGLang are not supported. `vllm` is refused for now: where vLLM is installed the weight push is not built yet, and where it
    is not, the refusal says how to install it."""

    placement: Literal["auto", "resident", "streamed"] = "auto"
    """Where the copy's weights are while it generates. `resident`: all on the GPU. `streamed`: the decoder
    layers in page-locked host memory (2 B/param of them in bf16), brought to the GPU one at a time as each
    token step runs them, the next one's copy overlapping the current one's compute; only the embedding, the
    head, two layer buffers and the key/value cache stay on the GPU, and each token step of the whole batch
    (every prompt x G) crosses the link once. `auto`: resident where the device model says the copy fits beside
    the step on this GPU (`engine.gpu_memory_limit_gb`, or the device's memory), else streamed."""

    @field_validator("engine")
    @classmethod
    def _built_and_installed(cls, value: str) -> str:
        if value == "vllm":
            if importlib.util.find_spec("vllm") is None:
                raise ValueError("vllm is not installed here: pip install vllm (on a CUDA machine; its wheels pin their "
                                 "own torch), or use rollout.engine: transformers")
            raise ValueError("vllm: mt-ray does not push its weights into vLLM yet; use rollout.engine: transformers")
        return value


class GroupObjective:
    """GRPO's loss of a micro-batch as a function of its token log-probs (the engine's head drives it).

    Each token's loss depends on its own log-prob alone (`token_wise`): the head takes each token's
    coefficient dL/dp from the same chunked forward that gives its log-prob, with no forward without a graph
    first, and (`keeps_logps`, above one iteration) keeps the log-probs of a rollout's first step as the old
    policy's for the steps after it, as TRL's separate forward would have computed them, without that pass.
    """

    token_wise = True
    prompt_nll = False  # the head selects the loss tokens alone

    def __init__(self, cfg: GrpoConfig):
        self.cfg = cfg
        self.needs_reference = cfg.beta != 0.0
        self.temperature = cfg.temperature
        self.keeps_logps = cfg.num_iterations > 1

    def examples(self, counts: dict[str, int]) -> int:
        return counts["completions"]

    def reference_of(self, logp_N: torch.Tensor, mb) -> torch.Tensor:
        """What the reference contributes: its token log-probs as they are."""
        return logp_N

    def token_coefficients(self, logp_n: torch.Tensor, part: slice, mb, norm: dict[str, int]) -> torch.Tensor:
        """dL/dp of the tokens `part` of the micro-batch, whose log-probs are `logp_n` (no graph)."""
        logp_n = logp_n.detach().requires_grad_()
        with torch.enable_grad():
            loss_n, _, _ = self._token_terms(logp_n, mb, part)
            (coef_n,) = torch.autograd.grad((loss_n * self._token_weights(mb, norm, part)).sum(), [logp_n])
        return coef_n

    def token_loss(self, logp_N: torch.Tensor, mb, norm: dict[str, int]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """This micro-batch's share of the step's loss, and its metric sums (each a mean over its tokens)."""
        cfg, seqs = self.cfg, mb.seqs
        whole = slice(0, mb.num_loss_tokens)
        loss_N, ratio_N, kl_N = self._token_terms(logp_N, mb, whole)
        adv_N = mb.advantages.index_select(0, seqs.index)
        sums: dict[str, torch.Tensor] = {}
        n_tokens = max(1, mb.num_loss_tokens)
        if kl_N is not None:
            sums["kl"] = kl_N.detach().sum() / n_tokens
        loss = (loss_N * self._token_weights(mb, norm, whole)).sum()
        low_N = ((ratio_N < 1 - cfg.epsilon) & (adv_N < 0)).float()
        high_N = ((ratio_N > 1 + cfg.epsilon_upper) & (adv_N > 0)).float()
        for name, x_N in (("low", low_N), ("high", high_N), ("region", torch.maximum(low_N, high_N))):
            sums[f"clip_ratio/{name}_mean"] = x_N.sum() / n_tokens
        scored = seqs.tokens > 0  # completions with loss tokens (a masked truncated one has none: TRL's NaN)
        low_S, high_S = (_per_sequence(x_N, seqs)[scored] for x_N in (low_N, high_N))
        sums["clip_ratio/low_min"] = low_S.min() if low_S.numel() else low_N.new_zeros(())
        sums["clip_ratio/high_max"] = high_S.max() if high_S.numel() else high_N.new_zeros(())
        sums["loss"] = loss.detach()
        return loss, sums

    def _token_terms(self, logp_n: torch.Tensor, mb,
                     part: slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The clipped surrogate plus β times the KL of the tokens `part` (module docstring), their ratios, and
        their KL (None without a reference)."""
        cfg = self.cfg
        adv_n = mb.advantages.index_select(0, mb.seqs.index[part])
        old_n = logp_n.detach() if mb.old_logps is None else mb.old_logps[part]
        ratio_n = torch.exp(logp_n - old_n)
        clipped_n = torch.clamp(ratio_n, 1 - cfg.epsilon, 1 + cfg.epsilon_upper)
        loss_n = -torch.min(ratio_n * adv_n, clipped_n * adv_n)
        if not self.needs_reference:
            return loss_n, ratio_n, None
        d_n = mb.ref_logps[part] - logp_n
        kl_n = torch.exp(d_n) - d_n - 1
        if cfg.use_bias_correction_kl:
            kl_n = kl_n * ratio_n
        return loss_n + cfg.beta * kl_n, ratio_n, kl_n

    def _token_weights(self, mb, norm: dict[str, int], part: slice) -> torch.Tensor | float:
        """Each token's weight in the step's loss, as `loss_type` sums them (module docstring)."""
        per_mb = max(1, norm["micro_batches"])
        completions = mb.seqs.counts["completions"]
        if self.cfg.loss_type == "grpo":  # each completion's token mean
            return 1.0 / mb.seqs.tokens.index_select(0, mb.seqs.index[part]) / max(1, completions) / per_mb
        if self.cfg.loss_type == "bnpo":
            return 1.0 / max(1, mb.num_loss_tokens) / per_mb
        if self.cfg.loss_type == "dr_grpo":
            return 1.0 / (completions * self.cfg.max_completion_length) / per_mb
        return 1.0 / max(1, norm["loss_tokens"])  # dapo

    def metrics(self, sums: dict[str, torch.Tensor], counts: dict[str, int]) -> dict[str, torch.Tensor]:
        """The step's loss, and the means over its micro-batches of what each measured (TRL's log averages)."""
        per_mb = max(1, counts["micro_batches"])
        return {k: (v if k == "loss" else v / per_mb) for k, v in sums.items()}


def _per_sequence(x_N: torch.Tensor, seqs) -> torch.Tensor:
    """Each sequence slot's mean of a token value (0 where it has no loss token)."""
    total_S = torch.zeros(seqs.num, dtype=x_N.dtype, device=x_N.device).index_add(0, seqs.index, x_N)
    return total_S / seqs.tokens.clamp(min=1)
