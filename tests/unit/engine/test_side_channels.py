"""State one decoder layer leaves for later ones outside the hidden state (Gemma 4's KV sharing: its last layers attend
with the keys and values the last earlier layer of their type stored in `shared_kv_states`): the gradient the sharing
layers send into those keys reaches the layer that computed them, whichever schedule runs them, as in transformers."""

from __future__ import annotations

import pytest
import torch

from mt_ray.models.side_channels import SideChannel, backward_terms, open_side_channels, take_grads
from tests.family_checks import assert_same_step, documents, reference_step, rows_apart, stepped_engine
from tests.family_sweep import save_tiny

pytestmark = pytest.mark.usefixtures("one_thread")

KV_SHARED = {"num_hidden_layers": 4, "num_kv_shared_layers": 2,
             "layer_types": ["sliding_attention", "full_attention"] * 2}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma4_kv_shared")
    save_tiny("gemma4_text", path, **KV_SHARED)  # layers 2 and 3 read the keys and values of layers 0 and 1
    return path


@pytest.fixture(scope="module")
def reference(folder):
    return reference_step(folder, documents())


@pytest.mark.parametrize("engine_kw", [{}, {"checkpoint_every": 1}, {"schedule": "resident"}],
                         ids=["stream", "K1", "resident"])
def test_kv_shared_layers_train_their_writers_as_transformers_does(folder, reference, engine_kw):
    """Each packed row its own micro-batch (each its own channel): the step's loss and every weight's update."""
    ref_loss, before, ref_state = reference
    engine, result, state = stepped_engine(folder, rows_apart(documents()), **engine_kw)
    assert not engine.context.isolate_documents  # shared keys of a packed row are each document's, masked apart
    assert_same_step(state, before, ref_state, result.loss.item(), ref_loss)


def test_only_an_empty_mapping_handed_to_several_layers_becomes_a_channel():
    shared, own, filled = {}, {}, {"sliding_attention": torch.zeros(1)}
    per_layer = [{"kv": shared, "own": own, "table": filled}, {"kv": shared, "own": {}, "table": filled}]
    open_side_channels(per_layer)
    assert isinstance(per_layer[0]["kv"], SideChannel) and per_layer[0]["kv"] is per_layer[1]["kv"]
    assert per_layer[0]["own"] is own and per_layer[1]["table"] is filled


def test_a_reader_gets_leaves_and_the_writer_gets_their_gradient():
    """Layer 0 stores (2w, 3w); layer 1 reads them and computes sum(k * v): w's gradient is 12w, through layer 0."""
    channel, w = SideChannel(), torch.full((2,), 1.5, requires_grad=True)
    channel.layer = 0
    channel["kv"] = stored = (w * 2, w * 3)
    channel.layer = 1
    keys, values = channel["kv"]
    assert keys.is_leaf and keys.requires_grad and torch.equal(keys, stored[0])
    read, _, _ = backward_terms([channel], 1)
    take_grads([channel], 1, torch.autograd.grad((keys * values).sum(), read))
    _, outputs, grads = backward_terms([channel], 0)
    [grad] = torch.autograd.grad(outputs, [w], grads)
    torch.testing.assert_close(grad, 12 * w.detach())
    with torch.no_grad():
        assert channel["kv"] is stored  # a forward without autograd reads what was stored
