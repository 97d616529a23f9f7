"""Optimizer state on NVMe across a SIGKILL: a run with `engine.state_placement: nvme`, killed right after a
checkpoint and resumed, ends with the fp32 state (master and moments) and loss of a host-placement run that never
stopped, bit for bit. Checkpoints go to a local folder; the state files leave nothing behind, even after the kill."""

import os
import signal
import sys

import pytest
import torch

from mt_ray.tracking import CheckpointConfig, CheckpointManager
from tests.integration.tracking.test_sigkill_resume import run

STEPS = 4
KILL_AFTER = 2


def command(storage, name: str, state_dir=None, kill_after: int | None = None) -> list[str]:
    entry = ["jobs.train"] if kill_after is None else ["tests.integration.tracking.kill_after_checkpoint",
                                                       str(kill_after)]
    placement = [] if state_dir is None else ["engine.state_placement=nvme", f"engine.nvme_path={state_dir}"]
    return [sys.executable, "-m", *entry, f"training.steps={STEPS}", "checkpoint.every_steps=1",
            f"training.storage={storage}", f"training.run_name={name}", "tracking.enabled=false",
            "training.export=false", "engine.device=cpu", "data.max_seq_len=64", "training.micro_batch_size=2",
            "training.grad_accum_steps=2", *placement]


@pytest.mark.slow  # three training processes (~70 s on 2 loaded cores): the in-process resume tests cover the format
def test_sigkill_and_resume_with_state_on_nvme_is_exact(tmp_path):
    storage, state = tmp_path / "runs", tmp_path / "state"
    state.mkdir()
    done = run(command(storage, "reference"), tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    killed = run(command(storage, "killed", state, kill_after=KILL_AFTER), tmp_path)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert not os.listdir(state)  # unlinked at start: the kill leaves no state files behind
    done = run(command(storage, "killed", state), tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]

    ref, ref_meta = CheckpointManager(CheckpointConfig(uri=str(storage / "reference" / "checkpoints"))).load()
    got, got_meta = CheckpointManager(CheckpointConfig(uri=str(storage / "killed" / "checkpoints"))).load()
    assert got_meta["step"] == ref_meta["step"] == STEPS
    for name in ("master", "exp_avg", "exp_avg_sq"):
        assert torch.equal(ref[name], got[name]), name
    assert got_meta["trainer"]["history"][-1]["loss"] == ref_meta["trainer"]["history"][-1]["loss"]
