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
                    "--variants", "grouped:numba,transformers:torch"],
                   cwd=ROOT, check=True, capture_output=True)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["shape"], r["batch"], r["variant"]) for r in rows] == [
        ("tiny-moe", b, v) for b in (2, 4) for v in ("grouped:numba", "transformers:torch")
    ] + [("tiny", 2, "grouped:numba"), ("tiny", 2, "grouped:torch")]
    for moe in rows[:4]:
        assert moe.keys() >= ROW_KEYS
        assert 0 < moe["active_tflops_nonembed"] <= moe["active_tflops"] < moe["model_tflops"]
        assert all(moe[f"{part}_{phase}_s"] > 0 for part in ("experts", "router", "attention")
                   for phase in ("forward", "backward"))
    assert "active_tflops" not in rows[4] and "experts_forward_s" not in rows[4]
    # The same engine went on training through every switch: one loss curve, no restart.
    assert rows[1]["losses"][0] != rows[0]["losses"][0]
