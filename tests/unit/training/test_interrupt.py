"""SIGTERM (a scheduler's, `kill`) ends a run as Ctrl-C does: one line naming the step, the newest checkpoint and
the command that resumes it, exit status 143; the resumed run finishes."""

import os
import shlex
import signal

import mt_ray.training.launch as launch
from jobs.train import main
from mt_ray.training.callbacks import Callback


class TermAt(Callback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, trainer, step):
        if step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_ends_the_run_in_one_line_and_it_resumes(tmp_path, capsys, monkeypatch):
    args = ["training.steps=4", "checkpoint.every_steps=2", f"training.storage={tmp_path}", "training.run_name=r",
            "engine.device=cpu", "tracking.enabled=false", "data.max_seq_len=64", "training.export=false"]
    build, outer = launch.build_callbacks, signal.getsignal(signal.SIGTERM)  # Ray's, where a test before ran ray.init
    monkeypatch.setattr(launch, "build_callbacks", lambda cfg, run: [*build(cfg, run), TermAt(3)])
    assert main(args) == 128 + signal.SIGTERM
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the progress bar's
    assert err.startswith("interrupted (SIGTERM) after step 3 of 4; last checkpoint ")
    assert f"{tmp_path}/r/checkpoints/step-00000002" in err
    assert err.endswith(f"; resume: python -m jobs.train {shlex.join(args)}")
    assert signal.getsignal(signal.SIGTERM) is outer  # the handler lived as long as the run
    monkeypatch.setattr(launch, "build_callbacks", build)
    assert main(args) == 0 and "resuming run r from" in capsys.readouterr().out


def test_an_epoch_based_runs_numbers_count_what_it_trained(tmp_path, capsys, monkeypatch):
    """One epoch of 10 examples, 5 steps: the interrupt line counts the 5 steps the epoch came to (not the default
    60), the done line has one loss (5 steps, log_every 10: one logged point, no change to show), and the summary's
    epoch and cut examples count the rows trained, not the packing window of 256 examples the loader read."""
    import json

    rows = [{"instruction": f"q{i}", "output": "a " * (80 if i < 3 else 3)} for i in range(10)]
    (tmp_path / "d.json").write_text(json.dumps(rows))
    (tmp_path / "dataset_info.json").write_text(json.dumps({"d": {"file_name": "d.json"}}))
    args = ["training.epochs=1", "training.micro_batch_size=2", "training.grad_accum_steps=1", "data.packing=false",
            f"data.registry={tmp_path}", "data.datasets=[d]", "data.max_seq_len=64", "training.log_every=10",
            "checkpoint.every_steps=1", f"training.storage={tmp_path}", "training.run_name=r", "engine.device=cpu",
            "tracking.enabled=false", "training.export=false"]
    build = launch.build_callbacks
    monkeypatch.setattr(launch, "build_callbacks", lambda cfg, run: [*build(cfg, run), TermAt(2)])
    assert main(args) == 128 + signal.SIGTERM
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("interrupted (SIGTERM) after step 2 of 5; ")
    monkeypatch.setattr(launch, "build_callbacks", build)
    assert main(args) == 0  # resumed at step 2: the counts carry on from the checkpoint
    done = capsys.readouterr().out.strip().splitlines()[-1]
    assert done.startswith("done: 5 steps, loss ") and "->" not in done
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["data"]["epoch"] == 1.0 and summary["data"]["cut_examples"] == 3
