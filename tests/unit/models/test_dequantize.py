"""Released quantized checkpoints load into the fp32 master exactly as transformers' dequantizing load makes them:
GPT-OSS's MXFP4 experts (`*_blocks`, `*_scales`) and FP8 block-quantized weights (`weight_scale_inv`, DeepSeek-V3 and
the Qwen3 FP8 releases), written tiny in each published layout; the export is plain safetensors transformers loads;
a format mt-ray cannot dequantize is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, FineGrainedFP8Config, Mxfp4Config

from mt_ray.engine import EngineConfig, OptimizerConfig, StreamingEngine
from mt_ray.errors import CheckpointError
from mt_ray.models.discovery import discover
from tests.family_sweep import tiny_config


def _rewrite(folder: Path, model_type: str, quantize, quantization_config: dict) -> None:
    """A tiny random `model_type` saved by transformers, its tensors then stored as `quantize` codes them."""
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config(model_type)).save_pretrained(folder)
    state = load_file(folder / "model.safetensors")
    quantize(state, torch.Generator().manual_seed(1))
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))


def _mxfp4(state: dict, g: torch.Generator) -> None:
    """GPT-OSS's layout: each expert bank [E, in, out] as [E, out, in / 32, 16] bytes of e2m1 pairs, and a biased e8m0
    exponent a 32-value block."""
    for key in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, rows, cols = state.pop(key).shape
        state[f"{key}_blocks"] = torch.randint(0, 256, (experts, cols, rows // 32, 16), dtype=torch.uint8, generator=g)
        state[f"{key}_scales"] = torch.randint(120, 130, (experts, cols, rows // 32), dtype=torch.uint8, generator=g)


def _fp8(state: dict, g: torch.Generator, block: int = 16) -> None:
    """DeepSeek-V3's layout: every projection in float8 e4m3, with the inverse scale of each block x block tile."""
    for key in [k for k in state if k.endswith("proj.weight")]:
        rows, cols = state[key].shape
        scale = torch.rand((rows // block, cols // block), generator=g) * 0.01 + 0.001
        tiles = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
        state[key] = (state[key].float() / tiles).to(torch.float8_e4m3fn)
        state[f"{key}_scale_inv"] = scale


CASES = {
    "mxfp4": ("gpt_oss", _mxfp4, {"quant_method": "mxfp4"}, Mxfp4Config(dequantize=True)),
    "fp8": ("qwen3_moe", _fp8, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                "weight_block_size": [16, 16]}, FineGrainedFP8Config(dequantize=True)),
}


def _engine(folder: Path) -> StreamingEngine:
    return StreamingEngine(discover(str(folder)), EngineConfig(device="cpu"), OptimizerConfig(), total_steps=1)


@pytest.mark.parametrize("layout", sorted(CASES))
def test_a_quantized_release_loads_as_transformers_dequantizes_it_and_exports_plain(layout, tmp_path):
    model_type, quantize, quant, dequantize = CASES[layout]
    _rewrite(tmp_path / "release", model_type, quantize, quant)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "release", dtype=torch.float32,
                                                     quantization_config=dequantize).state_dict()
    engine = _engine(tmp_path / "release")
    try:
        engine.load_pretrained(tmp_path / "release")
        state = engine.state_dict()
        assert state.keys() <= reference.keys()
        for name, value in state.items():  # MXFP4's codes times powers of two: exact in transformers' bf16 too
            torch.testing.assert_close(value, reference[name].float(), rtol=0, atol=0, msg=name)
        engine.export(tmp_path / "out")
    finally:
        engine.close()
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).state_dict()
    for name, value in state.items():
        torch.testing.assert_close(exported[name], value, rtol=0, atol=0, msg=name)


def test_a_format_mt_ray_cannot_dequantize_is_refused_by_name(tmp_path):
    """A GPTQ-style checkpoint (packed integer weights): one line naming the format, a tensor and the fix."""
    def gptq(state: dict, g: torch.Generator) -> None:
        key = next(k for k in state if k.endswith("q_proj.weight"))
        state[key] = torch.randint(0, 2**31 - 1, state[key].shape, dtype=torch.int32, generator=g)

    _rewrite(tmp_path / "gptq", "qwen3", gptq, {"quant_method": "gptq", "bits": 4})
    engine = _engine(tmp_path / "gptq")
    try:
        with pytest.raises(CheckpointError) as e:
            engine.load_pretrained(tmp_path / "gptq")
    finally:
        engine.close()
    message = str(e.value)
    assert len(message.splitlines()) == 1
    assert "'gptq'" in message and "q_proj.weight (torch.int32)" in message and "dequantize=True" in message
