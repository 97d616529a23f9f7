"""The README's first command: the demo trains on CPU, the loss falls, the model is exported."""

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mt_ray.cli.main import main
from tests.conftest import ROOT


def test_demo_job_trains_and_exports(tmp_path):
    out = tmp_path / "runs" / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "jobs.train", "--config", "jobs/configs/demo.yaml", "training.steps=30",
         f"training.storage={tmp_path / 'runs'}", "training.run_name=demo", "engine.device=cpu"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_loss"] < summary["first_loss"] - 1.0
    model = AutoModelForCausalLM.from_pretrained(out / "hf_model")
    tok = AutoTokenizer.from_pretrained(out / "hf_model")
    ids = tok("What is 2 + 3?", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_cli_reports_config_errors_without_traceback(capsys):
    assert main(["train", "training.stepz=3"]) == 2
    err = capsys.readouterr().err
    assert "training.stepz" in err and "Traceback" not in err


def test_cli_info_and_calc(capsys):
    assert main(["info", "--preset", "qwen2.5-7b"]) == 0
    assert "Qwen2DecoderLayer#0: 28 layers" in capsys.readouterr().out
    assert main(["calc", "--preset", "qwen2.5-7b", "--gpu-mem-gb", "80", "--host-mem-gb", "128", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["fits"] and rec["params"] == 7615616512


def test_export_command_matches_trained_export(tmp_path):
    run = tmp_path / "runs" / "export-me"
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"training:\n  steps: 4\n  storage: {tmp_path / 'runs'}\n  run_name: export-me\n"
                   "tracking:\n  enabled: false\nengine:\n  device: cpu\ndata:\n  max_seq_len: 64\n")
    proc = subprocess.run([sys.executable, "-m", "mt_ray.cli.main", "train", "--config", str(cfg)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert main(["export", "--config", str(cfg), "--out", str(tmp_path / "exported")]) == 0
    a = AutoModelForCausalLM.from_pretrained(run / "hf_model").state_dict()
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "exported").state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("entry", [["-m", "mt_ray.cli.main", "train"], ["-m", "jobs.train"]], ids=["mt-ray", "jobs"])
def test_the_first_line_comes_before_the_imports_and_ctrl_c_there_is_one_line(entry):
    """The command says it started before importing torch and transformers; Ctrl-C in those seconds of imports (the
    line is printed, the imports follow) ends it in one line, exit status 130, not an import's traceback."""
    import os
    import signal

    def ctrl_c_as_from_a_shell():
        """The child starts with Ctrl-C's default action, as a terminal starts it, whatever this test process
        inherited: a 4-worker run once had it ignored here, and the command trained to the end."""
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

    proc = subprocess.Popen([sys.executable, *entry, "training.steps=1"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            preexec_fn=ctrl_c_as_from_a_shell)
    first = proc.stdout.readline()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert first.endswith(": starting (loading torch and transformers)\n") and out == ""
    assert proc.returncode == 130 and err.endswith(": interrupted before the run started or after it ended\n")
    assert len(err.splitlines()) == 1, err
