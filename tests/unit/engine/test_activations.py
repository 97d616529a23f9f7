"""The activation store keeps to the step's plan: what it hands back is what was parked, and a step that
strays from the plan is stopped rather than handed the wrong hidden state."""

import pytest
import torch

from mt_ray.engine.activations import build_activation_store, streamed_step_plan
from mt_ray.engine.transfer import StreamSet


@pytest.mark.parametrize("placement", ["device", "host"])
def test_every_get_returns_the_latest_put_of_its_key(placement):
    store = build_activation_store(placement, StreamSet(torch.device("cpu")), torch.float32)
    plan = streamed_step_plan(n_blocks=2, n_micro=3, train=True)
    store.start(plan, [4, 4, 4])
    latest, count = {}, 0
    try:
        for op, key in plan:
            if op == "put":
                count += 1
                latest[key] = torch.full((2, 2), float(count))
                store.put(key, latest[key])
            else:
                assert torch.equal(store.get(key), latest[key]), key
    finally:
        store.close()


def test_a_step_out_of_order_is_refused():
    store = build_activation_store("host", StreamSet(torch.device("cpu")), torch.float32)
    store.start(streamed_step_plan(n_blocks=1, n_micro=2, train=False), [4, 4])
    try:
        store.put((0, 0), torch.zeros(4))
        with pytest.raises(RuntimeError, match=r"activation order broken: expected \('put', \(0, 1\)\)"):
            store.get((0, 0))
    finally:
        store.close()


def test_the_plan_reads_each_checkpoint_once_in_training_and_the_carry_between_blocks():
    plan = streamed_step_plan(n_blocks=2, n_micro=1, train=True)
    assert plan == [("put", (0, 0)), ("get", (0, 0)), ("put", (1, 0)), ("get", (1, 0)), ("put", (2, 0)),
                    ("get", (2, 0)), ("put", (2, 0)),  # the head: output in, gradient out
                    ("get", (1, 0)), ("get", (2, 0)), ("put", (2, 0)),  # block 1 backward
                    ("get", (0, 0)), ("get", (2, 0)), ("put", (2, 0)),  # block 0 backward
                    ("get", (2, 0))]  # the embedding's backward
