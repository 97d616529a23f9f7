"""What a layer returns beside its hidden state for a later layer (GLM-MoE-DSA's sparse-attention top-k indices, which
its next layers reuse; HY-V4's, with hyper-connections too): filled in at run time, found again by a recompute in
another block, whatever the schedule; a floating-point value, whose gradient would not travel, is refused."""

from __future__ import annotations

import pytest
import torch

from mt_ray.errors import ModelNotSupportedError
from mt_ray.models.handoff import Handoff, hand_on, plan_handoffs
from tests.family_checks import assert_same_step, documents, reference_step, rows_apart, stepped_engine
from tests.family_sweep import save_tiny

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["glm_moe_dsa", "hy_v4"])
def family(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    save_tiny(request.param, folder)  # layer 1 reuses layer 0's top-k keys (FAMILY_OVERRIDES), shorter than a document
    return folder, reference_step(folder, documents())


@pytest.mark.parametrize("engine_kw", [{}, {"checkpoint_every": 1}, {"schedule": "resident"}],
                         ids=["stream", "K1", "resident"])
def test_handed_indices_train_as_transformers_does(family, engine_kw):
    folder, (ref_loss, before, ref_state) = family
    engine, result, state = stepped_engine(folder, rows_apart(documents()), **engine_kw)
    assert engine.context.isolate_documents  # its indexer picks keys over the row: documents run alone
    assert_same_step(state, before, ref_state, result.loss.item(), ref_loss)


def test_each_marker_is_filled_with_what_its_layer_returned():
    per_layer = [{"prev": None}, {"prev": Handoff(0, 1)}, {"prev": Handoff(1, 1), "other": 3}]
    plan = plan_handoffs(per_layer)
    assert plan == {0: [(1, "prev", 1)], 1: [(2, "prev", 1)]}
    indices = torch.tensor([[2, 0]])
    hand_on(plan, 0, (torch.zeros(1), indices), per_layer, "m")
    assert per_layer[1]["prev"] is indices and per_layer[2]["prev"] == Handoff(1, 1)
    with pytest.raises(ModelNotSupportedError, match="'m'.*floating-point value decoder layer 1 returns"):
        hand_on(plan, 1, (torch.zeros(1), torch.zeros(2)), per_layer, "m")
