"""A widened residual stream (hyper-connections: DeepSeek-V4's [B, T, n, D], Qwen4-Exp's [B, T, n*D]; Gemma 3n's
AltUp [n, B, T, D]) travels between the units as the hidden state, token-major, parked and fetched whole whatever the
schedule, and is collapsed by the body's own code in the head unit: the step matches transformers, each packed row
its own micro-batch."""

from __future__ import annotations

import pytest

from tests.family_checks import assert_same_step, documents, reference_step, rows_apart, stepped_engine
from tests.family_sweep import save_tiny

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = {
    # sliding-window attention and top-k experts: its compressed attention and hash routing are refused apart
    "deepseek_v4": {"mlp_layer_types": ["moe", "moe"], "layer_types": ["sliding_attention"] * 2},
    "qwen4_exp_text": {},
    "gemma3n_text": {"altup_num_inputs": 4},  # its per-layer inputs and KV-shared layers too
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    save_tiny(request.param, folder, **FAMILIES[request.param])
    return request.param, folder, reference_step(folder, documents())


@pytest.mark.parametrize("engine_kw", [{}, {"checkpoint_every": 1, "checkpoint_placement": "host"},
                                       {"schedule": "resident"}], ids=["stream", "K1-host", "resident"])
def test_a_widened_stream_trains_as_transformers_does(family, engine_kw):
    model_type, folder, (ref_loss, before, ref_state) = family
    engine, result, state = stepped_engine(folder, rows_apart(documents()), **engine_kw)
    assert engine.context.stream.numel == 4 * engine.spec.text_config.hidden_size  # four copies of the stream
    assert_same_step(state, before, ref_state, result.loss.item(), ref_loss)
