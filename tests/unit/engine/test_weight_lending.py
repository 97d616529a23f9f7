"""The streamer's reuse rule holds for the engine's real schedule.

On CUDA the streamer gives a unit's device buffer back to the upload stream once `hold`
more units have been handed out; that is only safe if the schedule never computes with a
unit after that point. Here every template call is checked against when its weights were
handed out, for the block sizes and head layouts the engine has.
"""

import pytest

from mt_ray.engine import EngineConfig, OptimizerConfig, StreamingEngine
from mt_ray.engine.templates import UnitTemplate
from mt_ray.models.discovery import discover
from tests.tiny_models import tiny_batches, tiny_config


@pytest.mark.parametrize("family", ["llama", "qwen2-tied"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_no_unit_is_used_after_the_streamer_gives_it_back(monkeypatch, family, k):
    cfg = tiny_config(family, num_hidden_layers=5)
    engine = StreamingEngine(discover(cfg), EngineConfig(device="cpu", compute_dtype="fp32", checkpoint_every=k),
                             OptimizerConfig(), total_steps=2)
    handed_out: dict[int, int] = {}  # buffer address -> index of the next() call that lent it
    calls = 0
    real_next, real_call = engine.streamer.next, UnitTemplate.__call__
    uses = []

    def next_(unit):
        nonlocal calls
        flat = real_next(unit)
        handed_out[flat.data_ptr()] = calls
        calls += 1
        return flat

    def call(self, weights, *args, **kwargs):
        for w in weights.values():  # views of a lent flat buffer share its storage
            uses.append(calls - 1 - handed_out[w.untyped_storage().data_ptr()])
        return real_call(self, weights, *args, **kwargs)

    monkeypatch.setattr(engine.streamer, "next", next_)
    monkeypatch.setattr(UnitTemplate, "__call__", call)
    try:
        engine.load_random()
        for _ in range(2):
            engine.train_step(tiny_batches(n_micro=2))
    finally:
        engine.close()
    # `calls - 1 - owner` units were handed out after the one in use: it must still be lent.
    assert uses and max(uses) < engine.streamer.hold
    assert max(uses) >= k - 1  # and it is tight: a whole block of K units is in use at once
