"""Sampling that does not depend on how a rollout's prompts are split among samplers.

Each prompt group (a prompt's G completions) draws from a random stream of its own, seeded from the step's seed
and the group's index in the rollout (numpy's `SeedSequence`, so nearby seeds give unrelated streams): row j of
group g at new token t takes the uniform `u[g][j, t]`. A token is sampled by inverting the cumulative distribution
of the warped probabilities (temperature, then top-p, as transformers orders its warpers) at that uniform: exact
sampling from the same distribution as `torch.multinomial`, but a function of the group's own stream alone. One
engine generating every group in one batch and the Ray cluster's rollout replicas each generating a share of them
therefore draw the same tokens from the same logits.

What stays batch-dependent is the logits themselves: both sides pad every prompt to the rollout's widest
(`width`), so positions and masks agree, but a GPU's kernels may round differently for another row count (bf16
GEMMs pick tiles and split-K by shape), and a logit moved by a rounding can flip a sample. On the CPU in fp32 the
rows come out equal (tested); on a GPU the bench reports how many completions agree.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import LogitsProcessor, TemperatureLogitsWarper, TopPLogitsWarper


def group_uniforms(seed: int, first_group: int, groups: int, group_size: int, tokens: int) -> torch.Tensor:
    """[groups x group_size, tokens] uniforms in [0, 1): rows of group `first_group + i` from its own stream."""
    out = []
    for g in range(first_group, first_group + groups):
        state = np.random.SeedSequence([seed, g]).generate_state(2, dtype=np.uint32)
        gen = torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))
        out.append(torch.rand(group_size, tokens, generator=gen, dtype=torch.float64))
    return torch.cat(out)


class GroupSeededSampling(LogitsProcessor):
    """The last of `generate`'s processors, run greedy: samples each row's next token from its own uniform and
    leaves a score of 0 on it and -inf elsewhere, so the greedy pick is the sample."""

    def __init__(self, uniforms_BT: torch.Tensor, width: int, temperature: float, top_p: float):
        """`uniforms_BT`: one per row and new token (on the device); `width`: the padded prompts' length."""
        self.u_BT = uniforms_BT
        self.width = width
        self.warpers = [TemperatureLogitsWarper(temperature)] + ([TopPLogitsWarper(top_p)] if top_p < 1 else [])

    def __call__(self, input_ids: torch.LongTensor, scores_BV: torch.FloatTensor) -> torch.FloatTensor:
        t = input_ids.shape[1] - self.width  # the new token's index
        token_B1 = self.sample(scores_BV, self.u_BT[:, t : t + 1])
        return torch.full_like(scores_BV, float("-inf")).scatter_(1, token_B1, 0.0)

    def sample(self, scores_BV: torch.Tensor, u_B1: torch.Tensor) -> torch.Tensor:
        """Each row's token [B, 1] at its uniform `u_B1` from fp32 `scores_BV` (no host sync: a CUDA graph
        captures it in the static decode loop, decode.py)."""
        for warp in self.warpers:
            scores_BV = warp(None, scores_BV)  # neither warper reads the ids
        # fp64: the cumulative sum of 10^5 probabilities keeps every token's share, and u x total < total
        cdf_BV = torch.softmax(scores_BV.double(), dim=-1).cumsum_(dim=-1)
        target_B1 = u_B1 * cdf_BV[:, -1:]
        # the first token whose cumulative probability exceeds the target: a token of probability 0 never is
        return torch.searchsorted(cdf_BV, target_B1, right=True).clamp_(max=cdf_BV.shape[1] - 1)
