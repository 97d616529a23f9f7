"""GRPO's sampling by prompt group (each group its own seeded stream, a token by the inverse of the warped
distribution) and the rollout copy's refresh through the staging slots (upload.py; on the CPU the same path)."""

from __future__ import annotations

import pytest
import torch

from mt_ray.engine.config import EngineConfig
from mt_ray.engine.grpo import GrpoConfig
from mt_ray.models.discovery import discover
from mt_ray.training.grpo.rollout import Rollout, build_copy, group_shares
from mt_ray.training.grpo.sampling import GroupSeededSampling, group_uniforms
from mt_ray.training.grpo.upload import PinnedUpload
from tests.tiny_models import reference_model, tiny_config


def test_a_token_is_where_its_uniform_falls_in_the_warped_distribution():
    """Probabilities 0.1, 0.2, 0.3, 0.4: each uniform picks the token whose share of [0, 1) holds it; top-p 0.5
    keeps the two likeliest (renormalised to 3/7, 4/7), and a token of probability 0 is never drawn."""
    scores = torch.tensor([[0.1, 0.2, 0.3, 0.4]]).log().repeat(4, 1)
    u = torch.tensor([[0.05], [0.15], [0.31], [0.95]], dtype=torch.float64)
    ids = torch.zeros(4, 3, dtype=torch.long)
    picked = GroupSeededSampling(u, 3, 1.0, 1.0)(ids, scores.clone())
    assert picked.argmax(-1).tolist() == [0, 1, 2, 3]
    assert (picked == 0).sum() == 4 and torch.isinf(picked).sum() == 12
    assert GroupSeededSampling(u, 3, 1.0, 0.5)(ids, scores.clone()).argmax(-1).tolist() == [2, 2, 2, 3]
    zero = scores.clone()
    zero[:, 1] = float("-inf")
    assert GroupSeededSampling(u, 3, 1.0, 1.0)(ids, zero).argmax(-1).tolist() == [0, 2, 2, 3]


def test_each_group_draws_from_its_own_stream():
    """A group's uniforms depend on the step's seed and its index alone: the same in any share."""
    whole = group_uniforms(7, 0, 5, 3, 4)
    assert torch.equal(torch.cat([group_uniforms(7, lo, hi - lo, 3, 4) for lo, hi in group_shares(5, 2)]), whole)
    assert not torch.equal(group_uniforms(8, 0, 5, 3, 4), whole)
    assert group_shares(5, 2) == [(0, 3), (3, 5)] and group_shares(1, 3) == [(0, 1)]


def test_a_rollout_split_in_shares_samples_what_one_batch_samples():
    """Every prompt padded to the rollout's widest, each group from its stream: three shares of the groups (as
    three replicas generate them) give one batch's completions, in prompt order."""
    cfg = tiny_config("llama")
    copy = build_copy(discover(cfg), EngineConfig(device="cpu", compute_dtype="fp32"), torch.device("cpu"), 10, 16,
                      "resident")
    copy.refresh(reference_model(cfg, 0).state_dict())
    prompts = [[5, 9, 11, 3], [7, 8], [20, 21, 22], [4, 5, 6, 7, 8], [30]]
    g = GrpoConfig(num_generations=2, max_completion_length=6, temperature=0.9, top_p=0.95)
    whole = copy.generate(prompts, g, {2}, 0, seed=3)
    shares = [copy.generate(prompts[lo:hi], g, {2}, 0, 3, lo, 5) for lo, hi in group_shares(len(prompts), 3)]
    assert Rollout.join(shares) == whole and whole != copy.generate(prompts, g, {2}, 0, seed=4)


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_the_refresh_casts_each_weight_through_the_slots_in_pieces(src_dtype):
    """Slots of 24 bytes: fp32 weights of 1 to 13 elements go in pieces of at most 6 elements, cast to bf16, equal
    to the cast of the whole; bf16 ones are copied as they are."""
    upload = PinnedUpload(torch.device("cpu"), slot_bytes=24)
    srcs = [torch.randn(n, generator=torch.Generator().manual_seed(n)).to(src_dtype) for n in (1, 6, 7, 13)]
    dsts = [torch.zeros(s.shape, dtype=torch.bfloat16) for s in srcs]
    upload.load(zip(dsts, srcs, strict=True))
    for d, s in zip(dsts, srcs, strict=True):
        assert torch.equal(d, s.to(torch.bfloat16))
    assert upload.pieces == (1 + 1 + 2 + 3 if src_dtype == torch.float32 else 0)
    with pytest.raises(ValueError, match="shape"):
        upload.load([(torch.zeros(2, 3), torch.zeros(6))])
