"""The next step runs while the previous step's optimizer is still updating, and that changes nothing.

A step returns once its work is queued; its units are updated by the optimizer thread afterwards (with
clipping only once the global norm is known, in forward order). The next step uploads each unit once that unit
is updated, and waits for nothing else of the optimizer. These tests hold one unit's update back until the next
step's embedding has run its forward, so they fail (on the gate's bound) where the next step waits for more
than its own units: for every update before it starts, or, with the prefetch ahead of it, for the updates of
units it does not need yet. Every result must equal the serial run's to the bit: losses, weights, Adam state,
an evaluation and a checkpoint taken with updates pending.
"""

from __future__ import annotations

import threading

import pytest
import torch

from mt_ray.engine import EngineConfig, OptimizerConfig, StreamingEngine
from mt_ray.engine.optimizer import UnitOptimizer
from mt_ray.models.discovery import discover
from tests.tiny_models import reference_model, tiny_batches, tiny_config

STEPS = 4
GATE_S = 20.0  # far above a tiny step on a loaded CPU; only a schedule that never opens the gate waits this long


class UpdateGate:
    """Holds each update of one unit back until the engine's next step (or evaluation) has embedded a
    micro-batch: the update of step s waits until the embedding runs with `step_idx` above s."""

    def __init__(self, engine: StreamingEngine, unit: str):
        self.engine = engine
        self.reached = -1  # the highest step_idx the embedding has run under
        self.timed_out: list[int] = []
        self._cond = threading.Condition()
        engine.templates["embed"].module.register_forward_pre_hook(lambda *_: self._embedded())
        engine.optimizers[unit] = _Gated(engine.optimizers[unit], self)  # the worker reads this same dict

    def _embedded(self) -> None:
        with self._cond:
            self.reached = max(self.reached, self.engine.step_idx)
            self._cond.notify_all()

    def open_all(self) -> None:
        """No next step comes: let the last updates through."""
        with self._cond:
            self.reached = 1 << 30
            self._cond.notify_all()

    def wait(self, update: int) -> None:
        with self._cond:  # bounded: a schedule that needs this update first never gets there
            if not self._cond.wait_for(lambda: self.reached > update, timeout=GATE_S):
                self.timed_out.append(update)


class _Gated:
    """A unit's optimizer whose every update first waits at the gate."""

    def __init__(self, inner: UnitOptimizer, gate: UpdateGate):
        self.inner, self.gate, self.updates = inner, gate, 0

    def step(self, *args, **kwargs) -> None:
        self.gate.wait(self.updates)
        self.updates += 1
        self.inner.step(*args, **kwargs)

    def step_count(self) -> int:
        return self.inner.step_count()

    def span_lags(self) -> dict:
        return self.inner.span_lags()

    def set_step(self, step: int, lags: dict | None = None) -> None:
        self.inner.set_step(step, lags)


def run(engine_kw: dict, clip: float, serial: bool, gated: str | None = None) -> dict:
    """`STEPS` steps on one batch; with `serial` every update is waited for after each step (the old order).
    An evaluation and a checkpoint are taken after the second step, with its updates still pending."""
    cfg = tiny_config("llama")
    opt = OptimizerConfig(lr=2e-3, weight_decay=0.1, max_grad_norm=clip, warmup_steps=1, schedule="cosine")
    ecfg = EngineConfig(device="cpu", compute_dtype="fp32", checkpoint_every=2, prefetch_units=2, **engine_kw)
    engine = StreamingEngine(discover(cfg), ecfg, opt, total_steps=STEPS)
    try:
        engine.load_state_dict(reference_model(cfg).state_dict())
        gate = UpdateGate(engine, gated) if gated else None
        mbs, out = tiny_batches(n_micro=2), {"losses": []}
        for step in range(STEPS):
            out["losses"].append(engine.train_step(mbs).loss.item())  # the loss only: the CPU waits for no update
            if serial:
                engine.synchronize()
            if step == 1:
                out["eval"] = engine.evaluate(tiny_batches(n_micro=1, seed=5)).loss_sum.item()
                out["checkpoint"] = {k: v.clone() for k, v in engine.checkpoint_state()[0].items()}
        if gate:
            gate.open_all()
            out["timed_out"] = gate.timed_out
        out["state"] = {k: v.clone() for k, v in engine.checkpoint_state()[0].items()}
        return out
    finally:
        engine.close()


def assert_equal_runs(got: dict, want: dict) -> None:
    assert got["losses"] == want["losses"]
    assert got["eval"] == want["eval"]
    for key in ("checkpoint", "state"):
        assert got[key].keys() == want[key].keys()
        for name, t in want[key].items():
            assert torch.equal(got[key][name], t), f"{key}: {name}"


@pytest.mark.parametrize("gated", ["head", "layers.1"])
@pytest.mark.parametrize("schedule", ["resident", "stream"])
def test_next_step_runs_while_the_clipped_update_goes_on(schedule, gated):
    """With clipping the updates start once the backward has ended, in forward order. The next step embeds its
    first micro-batch while `gated` (the last unit, or one just past the prefetch of 2) is not yet updated, and
    the run equals the serial one."""
    serial = run({"schedule": schedule}, clip=1.0, serial=True)
    overlapped = run({"schedule": schedule}, clip=1.0, serial=False, gated=gated)
    assert overlapped["timed_out"] == []  # every update of `gated` waited for a later step, and got it
    assert_equal_runs(overlapped, serial)


@pytest.mark.parametrize("schedule", ["resident", "stream"])
def test_unclipped_steps_without_waits_equal_serial_steps(schedule):
    """Without clipping each unit is updated as its gradient lands; the next step's uploads wait per unit."""
    assert_equal_runs(run({"schedule": schedule}, clip=0.0, serial=False), run({"schedule": schedule}, clip=0.0,
                                                                                  serial=True))


def test_a_wait_for_an_update_that_never_comes_is_bounded():
    cfg = tiny_config("llama")
    engine = StreamingEngine(discover(cfg), EngineConfig(device="cpu", compute_dtype="fp32"), OptimizerConfig(), 1)
    try:
        engine.worker.stall_s = 0.2
        assert not engine.worker.is_updated("layers.0", 1)
        with pytest.raises(RuntimeError, match=r"updated no unit for 0.2 s .* layers\.0 to reach step 1"):
            engine.worker.wait_updated("layers.0", 1)
    finally:
        engine.close()
