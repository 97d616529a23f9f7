"""The rollout's static-cache decode loop (decode.py) against transformers' `generate` (the path it replaces): the
same completions token for token on the CPU in fp32, greedy and under the group-seeded sampler, with left
padding, rows that end early and rows cut at the limit; a family whose cache cannot be static keeps `generate`."""

from __future__ import annotations

import pytest
import torch

from mt_ray.engine.config import EngineConfig
from mt_ray.engine.grpo import GrpoConfig
from mt_ray.models.discovery import discover
from mt_ray.training.grpo.decode import StaticDecoder, _row_chunks
from mt_ray.training.grpo.rollout import build_copy, cut_completions
from mt_ray.training.grpo.sampling import GroupSeededSampling, group_uniforms
from tests.tiny_models import checkpoint_config, reference_model, tiny_config

PROMPTS = [[5, 9, 11, 3], [7, 8], [20, 21, 22], [4, 5, 6, 7, 8], [30]]  # widths 1 to 5: left padding


def _copy(family: str):
    cfg = checkpoint_config(family) if family == "deepseek_v3" else tiny_config(family)
    copy = build_copy(discover(cfg), EngineConfig(device="cpu", compute_dtype="fp32"), torch.device("cpu"), 10, 24,
                      "resident")
    copy.refresh(dict(reference_model(cfg, 0).named_parameters()))  # a tied head once, as the master holds it
    return copy


@pytest.mark.parametrize(("family", "temperature", "top_p", "seed"), [
    ("llama", 1e-5, 1.0, 3),  # greedy: the warped distribution is the argmax's
    ("llama", 0.9, 0.95, 3),  # the seeded sampler, nucleus on
    ("qwen3", 1e-5, 1.0, 3),
    ("qwen3", 1.0, 1.0, 3),
    ("deepseek_v3", 0.9, 0.95, 3),  # latent attention (key and value heads of other widths), routed experts
])
def test_the_static_decode_samples_what_generate_samples(family, temperature, top_p, seed):
    copy = _copy(family)
    assert copy.decode == "static"  # the CPU's default: no graph to capture
    g = GrpoConfig(num_generations=2, max_completion_length=18, temperature=temperature, top_p=top_p)
    ours = copy.generate(PROMPTS, g, {2}, 0, seed)
    theirs = copy.generate(PROMPTS, g, {2}, 0, seed, decode="generate")
    assert ours == theirs == copy.generate(PROMPTS, g, {2}, 0, seed, decode="graph_sdpa")  # eager on the CPU
    assert any(ours.truncated) and not all(ours.truncated)  # both the end token and the limit were met


def test_every_row_ended_stops_the_loop_and_the_completions_agree():
    """Eight tokens allowed, each row ends within a few: the loop stops at its next check, nothing past an end."""
    copy = _copy("llama")
    g = GrpoConfig(num_generations=2, max_completion_length=40, temperature=1e-5, top_p=1.0)
    ends = {2, *range(3, 96, 2)}  # half the vocabulary ends a row: every row ends early
    ours = copy.generate(PROMPTS, g, ends, 0, 1)
    assert not any(ours.truncated) and ours == copy.generate(PROMPTS, g, ends, 0, 1, decode="generate")


def test_a_sliding_window_family_keeps_generate():
    copy = _copy("mistral")
    assert copy.decode == "generate"
    g = GrpoConfig(num_generations=2, max_completion_length=6, temperature=0.9, top_p=1.0)
    assert copy.generate(PROMPTS, g, {2}, 0, 3, decode="static") == copy.generate(PROMPTS, g, {2}, 0, 3)


def test_a_prefill_in_row_chunks_samples_what_one_prefill_samples():
    """Chunks of at most 12 prompt tokens (two rows of width 5 each): the same completions as one chunk's."""
    copy = _copy("llama")
    g = GrpoConfig(num_generations=2, max_completion_length=10, temperature=0.9, top_p=0.95)
    rows = [p for p in PROMPTS for _ in range(2)]
    ids = torch.tensor([[0] * (5 - len(p)) + p for p in rows])
    mask = (torch.arange(5) >= torch.tensor([5 - len(p) for p in rows])[:, None]).long()
    sampling = GroupSeededSampling(group_uniforms(3, 0, 5, 2, 10), 5, 0.9, 0.95)
    assert _row_chunks(10, 5, 12) == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10)]
    chunked = StaticDecoder(copy.model, capture=False, prefill_tokens=12).run(ids, mask, sampling, 10, [2], 0)
    whole = StaticDecoder(copy.model, capture=False).run(ids, mask, sampling, 10, [2], 0)
    assert torch.equal(chunked, whole)
    assert copy.generate(PROMPTS, g, {2}, 0, 3).completion_ids == cut_completions(whole.tolist(), {2}, 0)[0]
