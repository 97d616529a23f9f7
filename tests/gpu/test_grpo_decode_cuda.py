"""The rollout's static-cache decode on CUDA, each token step replayed from a CUDA graph (decode.py): the same
completions as transformers' `generate` (today's path) token for token in fp32, greedy and under the group-seeded
sampler, with left padding; and the memory it takes within the device model's `rollout_bytes`
(tests/unit/training/test_grpo_decode.py checks the CPU's eager loop)."""

import pytest
import torch

from mt_ray.engine.config import EngineConfig
from mt_ray.engine.grpo import GrpoConfig
from mt_ray.engine.sizing import kv_cache_bytes, rollout_bytes
from mt_ray.models.discovery import discover
from mt_ray.training.grpo.rollout import build_copy
from tests.tiny_models import reference_model, tiny_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = [[5, 9, 11, 3], [7, 8], [20, 21, 22], [4, 5, 6, 7, 8], [30]]  # widths 1 to 5: left padding


def _copy(config, dtype: str, rows: int, tokens: int):
    cuda = torch.device("cuda")
    copy = build_copy(discover(config), EngineConfig(device="cuda", compute_dtype=dtype), cuda, rows, tokens,
                      "resident")
    copy.refresh(reference_model(config, 0).state_dict())
    return copy


@pytest.mark.parametrize(("family", "temperature", "top_p"), [
    ("llama", 1e-5, 1.0),  # greedy
    ("llama", 0.9, 0.95),  # the seeded sampler, nucleus on (a sort inside the graph)
    ("qwen2", 1.0, 1.0),
    ("qwen3", 1e-5, 1.0),
])
def test_the_graph_decode_samples_what_generate_samples_on_cuda(family, temperature, top_p):
    copy = _copy(tiny_config(family), "fp32", 10, 30)
    assert copy.decode == "graph"
    g = GrpoConfig(num_generations=2, max_completion_length=24, temperature=temperature, top_p=top_p)
    ours = copy.generate(PROMPTS, g, {2}, 0, 3)
    assert copy.decode == "graph" and copy.captured_steps > 0  # captured, not fallen back to the eager loop
    assert ours == copy.generate(PROMPTS, g, {2}, 0, 3, decode="generate")
    assert ours == copy.generate(PROMPTS, g, {2}, 0, 3, decode="static")
    assert ours == copy.generate(PROMPTS, g, {2}, 0, 3, decode="graph_sdpa") and copy.captured_steps > 0


def test_the_copy_and_its_graph_decode_take_what_the_device_model_counts():
    """64 completions of up to 16 + 96 tokens, a 32k vocabulary (the sampler's fp64 rows dominate a step): the copy
    takes `rollout_bytes`' weights (and a rounding), and the memory generation takes beyond it is at least its
    static cache and at most what `rollout_bytes` counts for generation."""
    config = tiny_config("llama", hidden_size=256, intermediate_size=512, num_attention_heads=8,
                         num_key_value_heads=2, head_dim=32, vocab_size=32000, num_hidden_layers=2,
                         max_position_embeddings=256)
    spec, cfg = discover(config), EngineConfig(device="cuda", compute_dtype="bf16")
    weights, predicted = rollout_bytes(spec, cfg, 64, 16 + 96)
    start = torch.cuda.memory_allocated()
    copy = _copy(config, "bf16", 64, 112)
    assert weights <= torch.cuda.memory_allocated() - start <= weights + 2**20
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 32000, (int(n),), generator=gen).tolist()
               for n in torch.randint(4, 17, (8,), generator=gen)]
    g = GrpoConfig(num_generations=8, max_completion_length=96)
    copy.generate(prompts[:1], g, {2}, 0, 1)  # kernels loaded outside the measure
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    rollout = copy.generate(prompts, g, {2}, 0, 1)
    taken = torch.cuda.max_memory_allocated() - before
    width = max(len(p) for p in prompts)
    assert copy.captured_steps > 0 and len(rollout.completion_ids) == 64
    assert kv_cache_bytes(config, 64, width + 96, 2) <= taken <= predicted
