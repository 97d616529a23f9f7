"""`engine.auto_fit: true` trains with the calculator's configuration, and stops before the first step,
with the calculator's reason, when nothing fits."""

import math

import pytest
import torch

from jobs.train import main
from mt_ray.config.run import load_run_config
from mt_ray.engine.activations import HostActivationStore
from mt_ray.training import Trainer


def overrides(tmp_path, *extra: str) -> list[str]:
    return [f"training.storage={tmp_path / 'runs'}", "training.run_name=fit", "tracking.enabled=false",
            "training.steps=2", "training.export=false", "engine.device=cpu", "engine.auto_fit=true", *extra]


def test_auto_fit_trains_with_the_checkpoints_in_host_memory(tmp_path, capsys):
    """10.75 MiB of 'GPU' (planned for on CPU) leaves the demo's checkpoints no room on the device (10 MiB, before
    the device model counted the MLP's backward gradients, no longer fits at all)."""
    cfg = load_run_config(None, overrides(tmp_path, "engine.gpu_memory_limit_gb=0.0105"))
    trainer = Trainer(cfg)
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
    engine, training = trainer.cfg.engine, trainer.cfg.training
    assert (engine.checkpoint_placement, engine.checkpoint_every, engine.prefetch_units) == ("host", 1, None)
    assert (training.micro_batch_size, training.grad_accum_steps) == (1, 8)  # the global batch (4 x 2) kept
    assert isinstance(trainer.engine.activations, HostActivationStore)
    assert summary["steps"] == 2 and math.isfinite(summary["final_loss"])
    out = capsys.readouterr().out
    assert "auto_fit for a 0.0105 GiB GPU" in out
    assert "engine.checkpoint_placement=host" in out and "training.micro_batch_size=1" in out


def error_line(tmp_path, capsys, *extra: str) -> str:
    code = main(overrides(tmp_path, *extra))
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "runs" / "fit" / "checkpoints").exists()  # stopped before the first step
    return err.strip()


def test_a_gpu_too_small_for_any_configuration_gets_the_calculators_reason(tmp_path, capsys):
    err = error_line(tmp_path, capsys, "engine.gpu_memory_limit_gb=0.001")
    assert err.startswith("error: engine.auto_fit: nothing fits a 0.001 GiB GPU")
    assert "GPU: the leanest configuration (K=1, checkpoints on the host" in err


def test_a_host_too_small_for_any_configuration_gets_the_calculators_reason(tmp_path, capsys):
    """The limit is below what this process already holds: nothing is left for the training state."""
    err = error_line(tmp_path, capsys, "engine.gpu_memory_limit_gb=1", "engine.host_memory_limit_gb=0.1")
    assert "GiB of host memory. host: the leanest state (" in err and "B/param) needs" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: auto_fit reads its memory")
def test_auto_fit_without_a_gpu_asks_for_a_limit(tmp_path, capsys):
    err = error_line(tmp_path, capsys)
    assert "engine.auto_fit: there is no GPU to fit; set engine.gpu_memory_limit_gb" in err


def test_auto_fit_is_for_a_single_engine(tmp_path, capsys):
    err = error_line(tmp_path, capsys, "engine.gpu_memory_limit_gb=1", "cluster.num_workers=2")
    assert "engine.auto_fit: fits a single engine" in err


def test_without_auto_fit_a_context_nothing_fits_is_refused_before_the_first_step(tmp_path, capsys):
    """The message says which memory runs out and the longest sequence that fits at this global batch."""
    err = error_line(tmp_path, capsys, "engine.auto_fit=false", "engine.gpu_memory_limit_gb=0.05",
                     "data.max_seq_len=65536")
    assert err.startswith("error: data.max_seq_len 65536 x 8 sequences a step cannot train on a 0.05 GiB GPU")
    assert "whatever the engine settings. GPU: the leanest configuration" in err
    seq = int(err.split("; seq ")[1].split(" fits at global batch 8")[0])
    assert 0 < seq < 65536 and seq % 128 == 0


def test_auto_fit_says_when_the_host_optimizer_bounds_the_step(capsys):
    """A tiny mixture of experts computes in microseconds while the host's Adam updates every expert: auto_fit's
    line names the step optimizer-bound and what batch (if any) would hide it."""
    from mt_ray.training import build_model_spec
    from mt_ray.training.auto_fit import apply_auto_fit

    cfg = load_run_config(None, ["model.preset=tiny-moe", "engine.device=cpu", "engine.auto_fit=true",
                                 "engine.gpu_memory_limit_gb=8", "engine.host_memory_limit_gb=16"])
    apply_auto_fit(cfg, build_model_spec(cfg))
    out = capsys.readouterr().out
    assert "auto_fit for a 8 GiB GPU" in out and "; optimizer-bound" in out
