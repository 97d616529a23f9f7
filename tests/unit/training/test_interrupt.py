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
