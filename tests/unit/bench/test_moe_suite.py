"""The MoE suite of bench/engine_gpu.py, run on the CPU with tiny shapes: its rows carry what issue 38 asks for
(active beside model TFLOPS, the optimizer's time and wait, the calculator's step) and the experts / router /
attention split, forward and backward."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
ROW_KEYS = {"batch", "seq", "step_s", "active_tflops", "active_tflops_nonembed", "model_tflops", "optimizer_s",
            "optimizer_wait_s", "calc_step_s"}


def test_the_moe_suite_writes_its_rows(tmp_path):
    out = tmp_path / "moe.json"
    subprocess.run([sys.executable, "bench/engine_gpu.py", "--suite", "moe", "--device", "cpu", "--moe-shape",
                    "tiny-moe", "--moe-layers", "2", "--moe-batches", "2,4", "--dense-shape", "tiny", "--batch", "2",
                    "--micro", "2", "--seq", "32", "--module-times", "--warmup", "1", "--steps", "1", "--out", str(out),
                    "--variants", "grouped:numba:0,grouped:numba:2,transformers:torch:0"],
                   cwd=ROOT, check=True, capture_output=True)
    rows = json.loads(out.read_text())["rows"]
    variants = ("grouped:numba:0", "grouped:numba:2", "transformers:torch:0")
    assert [(r["shape"], r["batch"], r["variant"]) for r in rows] == [
        ("tiny-moe", b, v) for b in (2, 4) for v in variants
    ] + [("tiny", 2, "grouped:numba:0"), ("tiny", 2, "grouped:numba:2"), ("tiny", 2, "grouped:torch:0")]
    # The embedding and layer 0 updated on the "device" (a second host copy here) in the second variant only.
    assert [r["device_optimizer_units"] for r in rows] == [0, 2, 0] * 3
    assert rows[1]["device_optimizer_s"] > 0 and rows[1]["device_params_b"] > 0 and rows[0]["device_optimizer_s"] == 0
    for moe in rows[:6]:
        assert moe.keys() >= ROW_KEYS
        assert 0 < moe["active_tflops_nonembed"] <= moe["active_tflops"] < moe["model_tflops"]
        assert all(moe[f"{part}_{phase}_s"] > 0 for part in ("experts", "router", "attention")
                   for phase in ("forward", "backward"))
    assert "active_tflops" not in rows[6] and "experts_forward_s" not in rows[6]
    # The same engine went on training through every switch: one loss curve, no restart.
    assert rows[1]["losses"][0] != rows[0]["losses"][0]
