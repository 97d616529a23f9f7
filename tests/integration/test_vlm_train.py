"""`mt-ray train` on the built-in multimodal demo with a tiny Qwen2.5-VL and Qwen3-VL: the loss falls, the tower
stays as it was (frozen by default; Qwen3-VL's deepstack mergers with it), and the export loads in transformers
with its processor."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText

from mt_ray.cli.main import main
from mt_ray.data.mm_processor import load_processor
from tests.vlm_models import QWEN_IMAGE, make_image, save_qwen_vl


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_mt_ray_train_on_the_multimodal_demo_exports_a_loadable_model(tmp_path, family):
    folder = save_qwen_vl(tmp_path / "model", family)
    proc = subprocess.run(
        [sys.executable, "-m", "mt_ray.cli.main", "train", f"model.path={folder}", "data.datasets=demo_mllm",
         "data.max_seq_len=64", "training.steps=16", "training.micro_batch_size=4", "training.log_every=1",
         f"training.storage={tmp_path / 'runs'}", "training.run_name=vlm", "tracking.enabled=false",
         "engine.device=cpu", "optimizer.lr=3e-3", "optimizer.warmup_steps=2"],
        capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "runs" / "vlm"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_loss"] < summary["first_loss"] - 1.0

    exported = out / "hf_model"
    before, after = load_file(folder / "model.safetensors"), load_file(exported / "model.safetensors")
    assert after.keys() == before.keys()  # every tensor, as transformers names it
    tower = [k for k in before if "visual." in k and ".merger." not in k]
    assert len(tower) > 10 and all(torch.equal(before[k], after[k]) for k in tower)  # frozen: bit-identical
    assert any(not torch.equal(before[k], after[k]) for k in before if ".merger." in k)  # the projector trained

    model = AutoModelForImageTextToText.from_pretrained(exported)
    processor = load_processor(exported)  # the processor files were copied with the weights
    inputs = processor(text=[f"{QWEN_IMAGE}What colour is this picture?"], images=[make_image(0)], return_tensors="pt")
    with torch.no_grad():
        assert torch.isfinite(model(**inputs).logits).all()


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_info_and_calc_show_the_vision_tower(tmp_path, capsys, family):
    folder = save_qwen_vl(tmp_path / "model", family)
    assert main(["info", "--path", str(folder)]) == 0
    info = capsys.readouterr().out
    assert "vision tower: 3 blocks" in info and "frozen: no moments, no gradient" in info and "projector:" in info
    assert main(["calc", "--path", str(folder), "--seq", "256", "--global-batch", "8", "--gpu-mem-gb", "80",
                 "--host-mem-gb", "64", "--json"]) == 0
    text_only = json.loads(capsys.readouterr().out)
    assert main(["calc", "--path", str(folder), "--seq", "256", "--global-batch", "8", "--gpu-mem-gb", "80",
                 "--host-mem-gb", "64", "--image-tokens", "64",
                 "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["vision_patches_per_sample"] == 256 and rec["vision_tower_params"] > 0
    assert rec["device_gib"] > text_only["device_gib"]  # the kept vision block outputs
