"""The calculator searches every memory knob, returns a config that runs as written, and when nothing
fits says which memory binds and what would fit."""

import json

import pytest
import torch

from mt_ray.cli.main import main
from mt_ray.config.run import load_run_config
from mt_ray.engine.calculator import SEARCHED, config_snippet, longest_context, recommend
from mt_ray.engine.config import EngineConfig, OptimizerConfig
from mt_ray.engine.sizing import GIB, Stage, device_bytes, host_bytes
from mt_ray.engine.step_time import Machine, step_time
from mt_ray.models.discovery import discover
from mt_ray.models.presets import preset_config


@pytest.fixture(scope="module")
def qwen7b():
    return discover(preset_config("qwen2.5-7b"))


def chosen_engine(rec: dict) -> EngineConfig:
    return EngineConfig(device="cpu", compute_dtype="bf16", **{k: rec[k] for k in SEARCHED})


def test_7b_on_a_12gb_card_finds_a_configuration(qwen7b):
    """The issue's case: 64 x 1k on 12 GB said 'even one sequence per micro-batch does not fit'."""
    rec = recommend(qwen7b, 1024, 64, gpu_mem_gb=12, host_mem_gb=128)
    assert rec["fits"], rec.get("reason")
    cfg = chosen_engine(rec)
    assert device_bytes(qwen7b, cfg, rec["micro_batch_size"], 1024, 64)["total"] <= 12 * 0.9 * GIB
    assert host_bytes(qwen7b, cfg, OptimizerConfig(), 1024, 64) <= 128 * GIB
    assert rec["micro_batch_size"] * rec["grad_accum_steps"] == 64
    # The checkpoints of 64k tokens alone would take most of the card: they wait in host memory.
    assert rec["checkpoint_placement"] == "host"
    on_device = cfg.model_copy(update={"checkpoint_placement": "device"})
    assert device_bytes(qwen7b, on_device, rec["micro_batch_size"], 1024, 64)["total"] > 12 * 0.9 * GIB


def test_a_tight_host_gets_the_lean_state(qwen7b):
    """18 B/param (bf16 copy, fp32 gradients held for clipping) does not fit 110 GiB; 14 does."""
    rec = recommend(qwen7b, 1024, 64, gpu_mem_gb=24, host_mem_gb=110)
    assert rec["fits"] and rec["stream_master"] and rec["grad_dtype"] == "compute"
    assert rec["host_bytes_per_param"] == pytest.approx(14.0, abs=0.05)
    roomy = recommend(qwen7b, 1024, 64, gpu_mem_gb=24, host_mem_gb=256)
    assert not roomy["stream_master"] and roomy["grad_dtype"] == "fp32"  # the defaults, where they fit


def test_smaller_cards_trade_checkpoints_k_and_loss_chunk_for_memory(qwen7b):
    choices = {gb: recommend(qwen7b, 1024, 128, gpu_mem_gb=gb, host_mem_gb=1024) for gb in (80, 16, 10)}
    knobs = {gb: tuple(r[k] for k in ("checkpoint_every", "checkpoint_placement", "loss_chunk_tokens"))
             for gb, r in choices.items()}
    # (the MLP's backward gradients, counted since the long-context knobs, leave 16 GB no room for K=2)
    assert knobs == {80: (4, "device", 4096), 16: (1, "host", 2048), 10: (1, "host", 1024)}
    assert all(r["device_gib"] <= 0.9 * gb for gb, r in choices.items())


def test_the_link_bandwidth_enters_the_step_time(qwen7b):
    """At 8 x 1k the weights' two passes outweigh the compute on a 25 GB/s PCIe 4.0 link (full recompute: a block
    kept for every micro-batch would also save its backward upload), on a host whose Adam keeps up (at 2 G params/s
    the optimizer would bound so short a step)."""
    cfg = EngineConfig(device="cpu", compute_dtype="bf16", keep_activations=0)
    fast = recommend(qwen7b, 1024, 8, gpu_mem_gb=24, host_mem_gb=128, cfg=cfg,
                     machine=Machine(h2d_gbps=50, adam_gparams_per_s=50))
    slow = recommend(qwen7b, 1024, 8, gpu_mem_gb=24, host_mem_gb=128, cfg=cfg,
                     machine=Machine(h2d_gbps=25, adam_gparams_per_s=50))
    assert slow["bound"] == "link" and fast["bound"] == "compute"
    assert slow["predicted_step_s"] > 1.15 * fast["predicted_step_s"]
    assert not slow["stream_master"]  # streaming the fp32 master would double the bytes on the slow link


def test_too_small_a_host_names_the_host_and_the_largest_model(qwen7b):
    rec = recommend(qwen7b, 1024, 64, gpu_mem_gb=12, host_mem_gb=64)
    assert not rec["fits"] and rec["binding"] == "host"
    assert rec["reason"].startswith("host:") and "14.0 B/param" in rec["reason"]
    assert "max_grad_norm: 0" in rec["reason"]  # without clipping the gradients are not held
    # 61 GiB (3 kept for the process) at 14 B/param
    assert rec["max_params"] == pytest.approx(61 * GIB / 14, rel=0.01)
    assert rec["max_seq"] is None and rec["max_global_batch"] is None  # no shape fits: the state does not


def test_too_small_a_gpu_names_the_gpu_and_the_longest_sequence(qwen7b):
    rec = recommend(qwen7b, 32768, 64, gpu_mem_gb=8, host_mem_gb=128)
    assert not rec["fits"] and rec["binding"] == "gpu" and rec["reason"].startswith("GPU:")
    seq = rec["max_seq"]
    assert seq % 128 == 0
    assert recommend(qwen7b, seq, 64, gpu_mem_gb=8, host_mem_gb=128)["fits"]
    assert not recommend(qwen7b, seq + 128, 64, gpu_mem_gb=8, host_mem_gb=128)["fits"]


def test_gpu_and_host_together_name_the_largest_global_batch(qwen7b):
    """The GPU needs the checkpoints in host memory, where 512 x 4k of them do not fit beside the state."""
    rec = recommend(qwen7b, 4096, 512, gpu_mem_gb=24, host_mem_gb=128)
    assert not rec["fits"] and rec["binding"] == "gpu and host"
    batch = rec["max_global_batch"]
    assert recommend(qwen7b, 4096, batch, gpu_mem_gb=24, host_mem_gb=128)["fits"]
    assert not recommend(qwen7b, 4096, batch + 1, gpu_mem_gb=24, host_mem_gb=128)["fits"]


def test_long_contexts_run_the_mlp_in_chunks_and_short_ones_never(qwen7b):
    """At 256k tokens a layer's MLP activations alone would be 40 GiB: they run in sequence chunks."""
    rec = recommend(qwen7b, 262144, 1, gpu_mem_gb=80, host_mem_gb=128)
    assert rec["fits"] and rec["mlp_chunk_tokens"] is not None
    assert device_bytes(qwen7b, chosen_engine(rec), 1, 262144, 1)["total"] <= 80 * 0.9 * GIB
    unchunked = chosen_engine(rec).model_copy(update={"mlp_chunk_tokens": None})
    assert device_bytes(qwen7b, unchunked, 1, 262144, 1)["total"] > 80 * 0.9 * GIB
    assert recommend(qwen7b, 1024, 128, gpu_mem_gb=80, host_mem_gb=128)["mlp_chunk_tokens"] is None


def test_the_longest_context_fits_and_one_step_longer_does_not(qwen7b):
    rec = longest_context(qwen7b, gpu_mem_gb=80, host_mem_gb=128)
    seq = rec["seq"]
    assert rec["fits"] and seq % 128 == 0 and seq >= 131072  # the target for 7B on one H100
    assert not recommend(qwen7b, seq + 128, 1, gpu_mem_gb=80, host_mem_gb=128)["fits"]
    assert rec["longer_binding"] in ("gpu", "host", "gpu and host") and rec["longer_reason"]
    assert longest_context(qwen7b, gpu_mem_gb=24, host_mem_gb=128)["seq"] < seq


def test_calc_max_seq_prints_the_longest_context_and_its_config(capsys):
    assert main(["calc", "--preset", "tiny", "--gpu-mem-gb", "0.05", "--host-mem-gb", "16", "--max-seq", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["global_batch"] == 1 and out["longer_binding"] == "gpu"
    assert f"max_seq_len: {out['seq']}" in out["config"]


def test_the_snippet_is_a_run_config_with_the_recommendation(qwen7b, tmp_path):
    rec = recommend(qwen7b, 1024, 64, gpu_mem_gb=12, host_mem_gb=128)
    path = tmp_path / "fit.yaml"
    path.write_text(config_snippet(rec, {"preset": "qwen2.5-7b"}))
    cfg = load_run_config(path)
    assert {k: getattr(cfg.engine, k) for k in SEARCHED} == {k: rec[k] for k in SEARCHED}
    assert (cfg.training.micro_batch_size, cfg.training.grad_accum_steps) == (rec["micro_batch_size"],
                                                                             rec["grad_accum_steps"])
    assert cfg.data.max_seq_len == 1024 and cfg.model.preset == "qwen2.5-7b"


def test_calc_command_prints_the_config_or_the_reason(capsys):
    assert main(["calc", "--preset", "qwen2.5-7b", "--seq", "1024", "--global-batch", "64", "--gpu-mem-gb", "12",
                 "--host-mem-gb", "128", "--h2d-gbps", "25", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] and out["h2d_gbps"] == 25 and "checkpoint_placement: host" in out["config"]
    assert main(["calc", "--preset", "qwen2.5-7b", "--gpu-mem-gb", "12", "--host-mem-gb", "64"]) == 1
    assert "nothing fits. host:" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: calc reads its memory")
def test_calc_without_a_gpu_asks_for_its_memory(capsys):
    assert main(["calc", "--preset", "qwen2.5-7b", "--host-mem-gb", "128"]) == 2
    assert "--gpu-mem-gb" in capsys.readouterr().err


def test_bad_calc_input_is_one_clear_error(capsys):
    assert main(["calc", "--preset", "qwen2.5-7b", "--gpu-mem-gb", "-1", "--host-mem-gb", "128"]) == 2
    assert "--gpu-mem-gb must be positive" in capsys.readouterr().err


def test_calc_takes_the_shape_of_the_step_from_a_config(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  preset: qwen2.5-7b\ndata:\n  max_seq_len: 2048\ntraining:\n  micro_batch_size: 2\n"
                    "  grad_accum_steps: 12\nengine:\n  stream_master: true\n")
    assert main(["calc", "--config", str(path), "--gpu-mem-gb", "24", "--host-mem-gb", "128", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["seq"], out["global_batch"]) == (2048, 24)
    assert "preset: qwen2.5-7b" in out["config"] and "max_seq_len: 2048" in out["config"]


def test_state_moves_to_nvme_only_when_the_host_cannot_hold_it():
    """7B on a 10 GiB card: 64 GiB of RAM holds nothing with the state in RAM; with a 3 GB/s disk the moments go
    there and the step pays for the disk traffic. A host that holds the state keeps it, disk or not."""
    spec = discover(preset_config("qwen2.5-7b"))
    disk = Machine(nvme_read_gbps=3.0, nvme_write_gbps=3.0)
    assert not recommend(spec, 1024, 64, 10, 64)["fits"]
    home = recommend(spec, 1024, 64, 10, 64, machine=disk)
    assert home["fits"] and home["state_placement"] == "nvme_moments" and "cannot hold" in home["placement_reason"]
    assert home["predicted_step_s"] > 2 * home["disk_gib"] * 2**30 / 3e9 * 0.99
    big = recommend(spec, 1024, 64, 10, 256, machine=disk)
    assert big["fits"] and big["state_placement"] == "host"


def test_calc_counts_a_mixture_of_experts_active_parameters_and_names_what_bounds_it(capsys):
    """Qwen3-30B-A3B cut to 2 layers at 16 x 1k: compute follows the 8 of 128 experts a token uses, the host's Adam
    every parameter, so the optimizer bounds the step; the batch the calculator proposes hides it."""
    args = ["calc", "--preset", "qwen3-30b-a3b", "--layers", "2", "--gpu", "h200", "--host-mem-gb", "128", "--json"]
    assert main([*args, "--global-batch", "16"]) == 0
    out = json.loads(capsys.readouterr().out)
    spec = discover(preset_config("qwen3-30b-a3b", layers=2))
    assert (out["params"], out["active_params"]) == (spec.num_params, spec.active_text_params)
    assert out["active_params"] < out["params"] / 2  # embedding and head (622 M) are most of a 2-layer cut
    # throughput of the parameters a token computes with; the total's would count every expert for every token
    assert "model_tflops" not in out and 0 < out["active_tflops"] < 600
    assert out["bound"] == "optimizer" and out["optimizer_exposed_s"] > 0.05 * out["predicted_step_s"]
    batch = out["hiding_batch"]
    assert f"a global batch of {batch} sequences with engine.schedule: stream hides it" in out["optimizer_advice"]
    assert "num_hidden_layers: 2" in out["config"]
    # the resident schedule (16k-token micro-batches) exposes the whole pass; streamed, the batch hides it, one
    # micro-batch fewer does not
    cfg = chosen_engine(out).model_copy(update={"schedule": "stream", "keep_activations": 0})
    h200 = Machine(layer_tflops=600, h2d_gbps=50)
    assert step_time(spec, cfg, 1024, batch, h200).bound == "compute"
    assert step_time(spec, cfg, 1024, batch - out["micro_batch_size"], h200).bound == "optimizer"


def test_calc_for_a_named_card_prints_the_assumptions_it_used(capsys):
    """An RTX 3080: its 10 GiB, the layer TFLOPS estimated from its bf16 peak and its PCIe 4.0 link, always printed."""
    assert main(["calc", "--preset", "qwen2.5-1.5b", "--gpu", "RTX 3080", "--host-mem-gb", "64"]) == 0
    out = capsys.readouterr().out
    assumed = out.splitlines()[0]
    assert assumed.startswith("assumed: GPU rtx3080 (--gpu; estimated")
    assert "GPU memory 10 GiB; layer TFLOPS 36 bf16; host link 25 GB/s each way; host memory 64 GiB" in assumed
    assert main(["calc", "--preset", "qwen2.5-1.5b", "--gpu", "rtx3080", "--gpu-tflops", "50", "--host-mem-gb", "64",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["gpu_mem_gb"] == 10 and out["assumptions"]["layer TFLOPS"] == "50 bf16 (--gpu-tflops)"
    assert main(["calc", "--preset", "tiny", "--gpu", "rtx9090", "--host-mem-gb", "64"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--gpu rtx9090: not a card the calculator knows" in err and "rtx3080" in err


# Measured on one H200 (bench/engine_gpu.py --suite moe, bench/RESULTS.md, eleventh session, one call): the 12-layer
# Qwen3-30B-A3B cut and the 7B at 1024-token rows, K=4, full recompute, clip 1.0, stream_master, bf16 gradients,
# mt-ray's grouped experts and the numba AdamW; every update on the host (0 units on the GPU), or the units
# `device_optimizer_units: auto` kept there (by parameters).
H200_ROWS = [("qwen3-30b-a3b", 12, 128, 0, 5.00), ("qwen3-30b-a3b", 12, 512, 0, 13.86), ("qwen2.5-7b", None, 128, 0, 13.37),
             ("qwen3-30b-a3b", 12, 128, 6.542e9, 3.77), ("qwen3-30b-a3b", 12, 512, 6.542e9, 12.77),
             ("qwen2.5-7b", None, 128, 7.071e9, 12.72)]


@pytest.mark.parametrize(("preset", "layers", "batch", "on_device", "measured_s"), H200_ROWS)
def test_the_step_model_is_within_15_percent_of_the_measured_h200_rows(preset, layers, batch, on_device, measured_s):
    cfg = EngineConfig(device="cuda", compute_dtype="bf16", stream_master=True, grad_dtype="compute",
                       keep_activations=0, checkpoint_every=4)
    spec = discover(preset_config(preset, layers=layers))
    stage = Stage(device_state_bytes=int(on_device) * 14)  # fp32 master and moments, and the bf16 gradient
    predicted = step_time(spec, cfg, 1024, batch, Machine(layer_tflops=600, h2d_gbps=50), micro_batch=16,
                          opt=OptimizerConfig(max_grad_norm=1.0), stage=stage)
    assert abs(predicted.total / measured_s - 1) < 0.15, predicted
