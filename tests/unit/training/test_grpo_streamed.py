"""GRPO's streamed rollout copy (`rollout.placement: streamed`): decoder layers in host memory, brought to the
device layer by layer as `generate` runs. On the CPU the "device" slots are host tensors, through the same hooks:
the streamed copy samples exactly the resident copy's tokens and computes its log-probs."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mt_ray.config.run import load_run_config
from mt_ray.engine.calculator import GPU_HEADROOM, config_snippet, recommend
from mt_ray.engine.config import EngineConfig, OptimizerConfig
from mt_ray.engine.grpo import GrpoConfig
from mt_ray.engine.host_store import GIB
from mt_ray.engine.sizing import ROLLOUT_SLOT_BYTES, Stage, device_bytes, host_bytes
from mt_ray.errors import ConfigError, ModelNotSupportedError
from mt_ray.models.discovery import discover
from mt_ray.training.auto_fit import rollout_placement
from mt_ray.training.backend import build_backend
from mt_ray.training.grpo.rollout import build_copy
from mt_ray.training.grpo.steps import GrpoSteps
from mt_ray.training.grpo.streamed_copy import LayerStreamer
from mt_ray.training.model_source import load_model_and_tokenizer
from tests.tiny_models import reference_model, tiny_config

GRPO = ["training.stage=grpo", "training.micro_batch_size=4", "training.grad_accum_steps=2",
        "grpo.num_generations=4", "data.datasets=[demo_math_prompts]", "engine.device=cpu"]
PROMPTS = [[5, 9, 11, 3], [7, 8], [20, 21, 22]]


def weights(family: str, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The weights as the engine's master gives them: a tied head once, as its embedding."""
    cfg = tiny_config(family)
    state = {k: v.to(dtype) for k, v in reference_model(cfg, seed).state_dict().items()}
    if cfg.tie_word_embeddings:
        del state["lm_head.weight"]
    return state


def copies(family: str, dtype: torch.dtype):
    spec = discover(tiny_config(family))
    cfg = EngineConfig(device="cpu", compute_dtype="bf16" if dtype == torch.bfloat16 else "fp32")
    return spec, [build_copy(spec, cfg, torch.device("cpu"), 12, 24, p) for p in ("resident", "streamed")]


@pytest.mark.parametrize("family, dtype", [("gemma3_text", torch.float32), ("qwen3_moe", torch.bfloat16)])
def test_streamed_copy_samples_the_resident_copys_tokens(family, dtype):
    """Sampled and greedy, after a second refresh (a slot still holding the first weights would show), with the
    same seed: the same tokens, and the same logits of every position."""
    spec, (resident, streamed) = copies(family, dtype)
    assert streamed.placement == "streamed" and resident.placement == "resident"
    layer_bytes = sum(u.numel for u in spec.layer_units) * dtype.itemsize
    assert streamed.streamer.host_bytes == layer_bytes
    streamed.refresh(weights(family, 1, dtype))
    first = streamed.generate(PROMPTS, GrpoConfig(num_generations=4, max_completion_length=8), {2}, 0, seed=3)
    state = weights(family, 0, dtype)
    resident.refresh(state), streamed.refresh(state)
    g = GrpoConfig(num_generations=4, max_completion_length=8, temperature=0.9, top_p=0.95)
    ours, theirs = (c.generate(PROMPTS, g, {2}, 0, seed=3) for c in (streamed, resident))
    assert ours == theirs and ours != first
    ids = torch.tensor([[5, 9, 11, 3], [7, 8, 20, 21]])
    greedy = [c.model.generate(input_ids=ids, do_sample=False, max_new_tokens=6, pad_token_id=0) for c in
              (streamed, resident)]
    assert torch.equal(*greedy)
    logits = [c.model(input_ids=greedy[0]).logits for c in (streamed, resident)]
    assert torch.equal(*logits)
    for p in streamed.streamer.layers[0].parameters():  # between forwards, the layers' weights are the host copy's
        assert p.data_ptr() >= streamed.streamer.host_flat.data_ptr()
    streamed.close()


def grpo_cfg(*extra: str):
    return load_run_config(None, [*GRPO, "model.preset=tiny", *extra])


def test_a_grpo_step_samples_the_same_completions_streamed():
    """The trainer's path: the copy placed as configured, refreshed from the engine's host weights (a tied head
    held once), the same rollout and micro-batches from either copy."""
    rollouts = []
    for placement in ("resident", "streamed"):
        cfg = grpo_cfg(f"rollout.placement={placement}", "grpo.max_completion_length=8")
        spec, tokenizer = load_model_and_tokenizer(cfg)
        engine = build_backend(cfg, spec)
        steps = GrpoSteps(cfg, engine, spec, tokenizer)
        try:
            batches = next(steps)
            assert steps.sampler.copy.placement == placement
            rollouts.append((steps.scored.rollout, batches))
        finally:
            steps.close()
            engine.close()
    (ours, our_batches), (theirs, their_batches) = rollouts
    assert ours == theirs and max(ours.lengths) > 1
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(our_batches, their_batches, strict=True))


def test_auto_streams_where_the_device_model_says_the_copy_does_not_fit():
    """A 'GPU' (engine.gpu_memory_limit_gb, planned for on the CPU) between the streamed and the resident plans
    takes the streamed copy; a larger one the resident; the CPU with no limit keeps it resident."""
    cfg = grpo_cfg()
    spec, _ = load_model_and_tokenizer(cfg)
    stage = Stage.of("grpo", grpo=cfg.grpo, rollout=cfg.rollout)
    plans = {p: device_bytes(spec, cfg.engine, 4, stage.rollout_tokens, 8,
                             stage=Stage.of("grpo", grpo=cfg.grpo, rollout=cfg.rollout.model_copy(
                                 update={"placement": p})))["total"] for p in ("resident", "streamed")}
    assert plans["streamed"] < plans["resident"]
    between = (plans["streamed"] + plans["resident"]) / 2 / GPU_HEADROOM / GIB
    assert rollout_placement(grpo_cfg(f"engine.gpu_memory_limit_gb={between}"), spec) == "streamed"
    assert rollout_placement(grpo_cfg(f"engine.gpu_memory_limit_gb={2 * between}"), spec) == "resident"
    assert rollout_placement(cfg, spec) == "resident"
    assert rollout_placement(grpo_cfg("rollout.placement=streamed"), spec) == "streamed"


def test_the_calculator_says_which_copy_and_what_it_costs():
    """`mt-ray calc`'s search: the streamed copy where the resident one fits no configuration, its layers counted
    in host memory (2 B/param in bf16) and only the rest and two layer buffers on the GPU."""
    spec = discover(tiny_config("llama", hidden_size=256, intermediate_size=1024))  # the copy outweighs the step
    cfg = EngineConfig(device="cpu", compute_dtype="bf16")
    auto = Stage.of("grpo", grpo=GrpoConfig(max_prompt_length=16, max_completion_length=16))
    streamed = replace(auto, rollout_placement="streamed")
    big = recommend(spec, 32, 8, 1.0, 64.0, cfg=cfg, stage=auto)
    assert big["fits"] and big["rollout_placement"] == "resident" and big["rollout_host_gib"] == 0
    gb = big["device_gib"]
    while recommend(spec, 32, 8, gb, 64.0, cfg=cfg, stage=replace(auto, rollout_placement="resident"))["fits"]:
        gb *= 0.95
    small = recommend(spec, 32, 8, gb, 64.0, cfg=cfg, stage=auto)
    layers = sum(u.numel for u in spec.layer_units)
    assert small["fits"] and small["rollout_placement"] == "streamed"
    assert small["rollout_host_gib"] * GIB == layers * 2
    assert small["rollout_link_s_per_token_step"] == layers * 2 / 50e9  # the default machine's 50 GB/s link
    assert "rollout:\n  placement: streamed" in config_snippet(small)
    assert small["rollout_copy_gib"] * GIB == (spec.num_params - layers + 2 * layers // 5) * 2 + 2 * ROLLOUT_SLOT_BYTES
    c = cfg.model_copy(update={"schedule": "stream"})
    assert host_bytes(spec, c, OptimizerConfig(), 32, 8, streamed) - host_bytes(spec, c, OptimizerConfig(), 32, 8, auto) == layers * 2


def test_a_bad_placement_is_refused_by_its_key():
    with pytest.raises(ConfigError) as e:
        grpo_cfg("rollout.placement=sideways")
    assert "rollout.placement: Input should be 'auto', 'resident' or 'streamed'" in str(e.value)


def test_layers_with_weights_of_another_dtype_are_refused_by_name():
    """One host buffer in the compute dtype would cast a module the model keeps in fp32: refused, not cast."""
    layers = torch.nn.ModuleList([torch.nn.Linear(4, 4).to(torch.bfloat16), torch.nn.Linear(4, 4)])
    with pytest.raises(ModelNotSupportedError, match="the decoder layers hold torch.float32 weights beside "
                       "torch.bfloat16; use rollout.placement: resident"):
        LayerStreamer(layers, torch.device("cpu"), torch.bfloat16)
