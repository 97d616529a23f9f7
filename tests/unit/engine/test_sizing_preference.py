"""What the calculator adds for a preference stage: the streamed reference's host buffer (as the engine allocates
it), its weights on the device under the resident schedule, its forward and upload in the step time; nothing for
a reference-free loss but the policy's head run forward once more. GRPO: its rollout copy on the device, and
generation in the memory an update frees."""

import json

import pytest

from mt_ray.cli.main import main
from mt_ray.engine import EngineConfig, OptimizerConfig, StreamingEngine
from mt_ray.engine.calculator import GPU_HEADROOM
from mt_ray.engine.grpo import GrpoConfig
from mt_ray.engine.kept_blocks import kept_within
from mt_ray.engine.preference import PreferenceConfig
from mt_ray.engine.sizing import (
    ROLLOUT_SLOT_BYTES,
    SFT,
    Stage,
    activation_bytes_per_token,
    device_bytes,
    host_bytes,
    max_kept,
    rollout_bytes,
)
from mt_ray.engine.step_time import Machine, attention_flops, predicted_step_seconds
from mt_ray.models.discovery import discover
from mt_ray.models.presets import preset_config
from tests.conftest import ROOT
from tests.tiny_models import tiny_config

DPO, ORPO, KTO = ("dpo", PreferenceConfig()), ("dpo", PreferenceConfig(loss="orpo")), ("kto", PreferenceConfig())


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize(("stage", "pref"), [DPO, ORPO, KTO])
def test_host_bytes_equal_engine_allocation_with_the_reference(dtype, stage, pref):
    spec = discover(tiny_config("llama"))
    cfg, opt = EngineConfig(device="cpu", compute_dtype=dtype), OptimizerConfig()
    engine = StreamingEngine(spec, cfg, opt, 1, stage=stage, pref=pref)
    try:
        store, gb, ref = engine.store, engine.grad_buffers, engine.pref.reference
        bufs = [store.master, store.exp_avg, store.exp_avg_sq] + ([store.copy] if store.copy is not None else [])
        bufs += ([gb._buf] if gb.per_unit else gb._slabs) + ([ref.buf] if ref is not None else [])
        allocated = sum(b.numel() * b.element_size() for b in bufs)
    finally:
        engine.close()
    sizing = Stage.of(stage, pref)
    assert sizing.reference == (ref is not None)
    assert not Stage.of(stage, pref.model_copy(update={"reference": "precompute"})).reference  # nothing held
    assert host_bytes(spec, cfg, opt, stage=sizing) == allocated
    per_param = (host_bytes(spec, cfg, opt, stage=sizing) - host_bytes(spec, cfg, opt)) / spec.num_params
    assert per_param == ((2 if dtype == "bf16" else 4) if ref is not None else 0)


def test_host_placed_checkpoints_park_the_reference_in_one_more_slot():
    spec = discover(tiny_config("llama"))
    cfg = EngineConfig(device="cpu", compute_dtype="bf16", checkpoint_placement="host", checkpoint_every=2)
    hidden = 12 * 4 * spec.text_config.hidden_size * 2  # 4 sequences of 12 tokens, bf16
    extra = host_bytes(spec, cfg, OptimizerConfig(), 12, 4, Stage.of(*DPO)) - host_bytes(spec, cfg, OptimizerConfig(), 12, 4)
    assert extra == 2 * spec.num_params + hidden


def test_step_time_grows_by_the_reference_forward_and_the_head_forward():
    spec = discover(preset_config("qwen2.5-1.5b"))
    cfg = EngineConfig(device="cpu", compute_dtype="bf16")
    compute_bound = Machine(layer_tflops=1.0, h2d_gbps=1e6, adam_gparams_per_s=1e9)
    seq, batch, tokens = 1024, 8, 8192
    t = {s: predicted_step_seconds(spec, cfg, seq, batch, compute_bound, stage=s)
         for s in (SFT, Stage.of(*ORPO), Stage.of(*DPO))}
    head = 2 * spec.unit("embed" if spec.tied else "head").numel * tokens
    forward = 2 * (spec.text_params * tokens + attention_flops(spec.text_config, tokens, seq) / 6)
    assert t[Stage.of(*ORPO)] - t[SFT] == pytest.approx(head / 1e12)
    assert t[Stage.of(*DPO)] - t[Stage.of(*ORPO)] == pytest.approx(forward / 1e12)
    link_bound = Machine(layer_tflops=1e9, h2d_gbps=1.0, adam_gparams_per_s=1e9)
    sft, dpo = (predicted_step_seconds(spec, cfg, seq, batch, link_bound, stage=s) for s in (SFT, Stage.of(*DPO)))
    assert dpo - sft == pytest.approx(2 * spec.num_params / 1e9)  # the reference crosses once, in bf16


def test_device_holds_the_reference_as_the_engine_does():
    spec = discover(preset_config("qwen2.5-1.5b"))
    resident = EngineConfig(device="cpu", compute_dtype="bf16", schedule="resident")
    sft, dpo = (device_bytes(spec, resident, 4, 1024, 16, stage=s) for s in (SFT, Stage.of(*DPO)))
    assert dpo["total"] - sft["total"] == dpo["reference_weights"] == 2 * spec.num_params
    stream = EngineConfig(device="cpu", compute_dtype="bf16", checkpoint_every=4)
    sft, dpo, orpo = (device_bytes(spec, stream, 1, 1024, 16, stage=s) for s in (SFT, Stage.of(*DPO), Stage.of(*ORPO)))
    assert dpo["weights"] == sft["weights"]  # the reference's units go through the streamer's buffers
    assert dpo["total"] >= sft["total"] and orpo["total"] == sft["total"]


def test_calc_counts_the_reference_of_the_dpo_demo(tmp_path, capsys):
    args = ["calc", "--gpu-mem-gb", "80", "--host-mem-gb", "64", "--json"]
    assert main([*args, "--config", "jobs/configs/dpo_demo.yaml"]) == 0
    dpo = json.loads(capsys.readouterr().out)
    sft_yaml = tmp_path / "sft.yaml"
    sft_yaml.write_text("model:\n  preset: tiny\ndata:\n  max_seq_len: 256\ntraining:\n  micro_batch_size: 4\n"
                        "  grad_accum_steps: 2\noptimizer:\n  max_grad_norm: 1.0\n")
    assert main([*args, "--config", str(sft_yaml)]) == 0
    sft = json.loads(capsys.readouterr().out)
    assert dpo["reference"] == "stream" and "reference" not in sft
    assert dpo["host_bytes_per_param"] == pytest.approx(sft["host_bytes_per_param"] + 2)
    assert dpo["reference_host_gib"] * 2**30 == 2 * dpo["params"]


def test_calc_counts_the_reference_once_per_node_of_a_cluster(tmp_path, capsys):
    """`--workers N`: the reference is in each node's arena once, so it adds its 2 B/param to a node whatever N."""
    simpo = tmp_path / "simpo.yaml"
    simpo.write_text((ROOT / "jobs/configs/dpo_demo.yaml").read_text().replace("loss: sigmoid", "loss: simpo"))
    args = ["calc", "--gpu-mem-gb", "80", "--host-mem-gb", "64", "--json", "--config"]
    nodes = {}
    for workers, config in ((2, "jobs/configs/dpo_demo.yaml"), (4, "jobs/configs/dpo_demo.yaml"), (4, str(simpo))):
        assert main([*args, config, "--workers", str(workers)]) == 0
        nodes[workers, config] = json.loads(capsys.readouterr().out)["cluster"]
    two, four, free = nodes.values()
    assert two["reference_bytes"] == four["reference_bytes"] >= 2 * two["params"] and free["reference_bytes"] == 0
    assert four["node_host_bytes"] - free["node_host_bytes"] == four["reference_bytes"]
    assert four["node_host_bytes"] - two["node_host_bytes"] == 2 * two["per_worker_bytes"]


def test_grpo_holds_its_rollout_copy_and_generates_in_what_the_update_frees():
    """The 7B bench's shape: 64 prompts x G=8, 64 + 256 tokens, micro-batches of 16 completions."""
    spec = discover(preset_config("qwen2.5-7b"))
    cfg = EngineConfig(device="cpu", compute_dtype="bf16")
    grpo = Stage.of("grpo", grpo=GrpoConfig(max_prompt_length=64, max_completion_length=256))
    sft, ours = (device_bytes(spec, cfg, 16, 320, 512, stage=s) for s in (SFT, grpo))
    copy, generation = rollout_bytes(spec, cfg, 512, 320)
    assert copy == ours["rollout_copy"] == 2 * spec.num_params + 2 * ROLLOUT_SLOT_BYTES  # and the refresh's slots
    cache = 2 * 28 * 512 * 320 * 4 * 128 * 2  # the static key/value cache
    prefill = 2 * 28 * 25 * 320 * 4 * 128 * 2 + 8192 * activation_bytes_per_token(spec, 2)  # a chunk of 25 rows
    step = 512 * 152064 * 32 + 2 * 512 * 28 * 320 * 4 + 512 * 3584 * 8  # sampling, the attention's scores
    assert generation == cache + max(prefill, step) and prefill > step  # the prefill peaks higher
    assert ours["total"] == copy + max(sft["total"], generation)
    long = Stage.of("grpo", grpo=GrpoConfig(max_prompt_length=512, max_completion_length=4096))
    on_host = cfg.model_copy(update={"checkpoint_placement": "host"})  # an update far smaller than generation
    longer = device_bytes(spec, on_host, 1, 4608, 512, stage=long)
    assert longer["rollout_generation_extra"] > 0
    assert longer["total"] == copy + sum(rollout_bytes(spec, cfg, 512, 4608)[1:])
    assert grpo.preference and not grpo.head_again and Stage.of(*DPO).head_again  # GRPO's head: one forward


def test_grpo_keeps_as_many_block_graphs_as_fit_beside_its_copy():
    spec = discover(preset_config("qwen2.5-7b"))
    cfg = EngineConfig(device="cpu", compute_dtype="bf16")
    budget = 80 * 2**30 * GPU_HEADROOM
    grpo = Stage.of("grpo", grpo=GrpoConfig(max_prompt_length=64, max_completion_length=256))
    sft_kept, grpo_kept = (max_kept(spec, cfg, 16, 320, 512, budget, stage=s) for s in (SFT, grpo))
    assert 0 < grpo_kept < sft_kept
    kept = cfg.model_copy(update={"keep_activations": grpo_kept})
    more = cfg.model_copy(update={"keep_activations": grpo_kept + 1})
    assert device_bytes(spec, kept, 16, 320, 512, stage=grpo)["total"] <= budget
    assert device_bytes(spec, more, 16, 320, 512, stage=grpo)["total"] > budget
    assert kept_within(spec, cfg, 80, 16, 320, 32, grpo) == grpo_kept  # what the engine's `auto` resolves to


def test_calc_of_the_grpo_demo_counts_its_rollout_copy(capsys):
    assert main(["calc", "--gpu-mem-gb", "80", "--host-mem-gb", "64", "--json", "--config",
                 "jobs/configs/grpo_demo.yaml"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["seq"] == 64 + 24 and rec["global_batch"] == 16  # the demo's prompt + completion, its completions
    assert rec["rollout_copy_gib"] * 2**30 == 2 * rec["params"] + 2 * ROLLOUT_SLOT_BYTES  # bf16, as on a GPU
    assert rec["device_gib"] >= rec["rollout_copy_gib"] + rec["rollout_generation_gib"] - 1e-9
