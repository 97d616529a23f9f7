"""The layer context: what the body does between its decoder layers is replayed by the engine, or refused."""

from __future__ import annotations

import pytest
import torch
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.models.llama import LlamaModel

from mt_ray.errors import ModelNotSupportedError
from mt_ray.models.context import LayerContextBuilder
from mt_ray.models.discovery import discover
from tests.tiny_models import tiny_config
from tests.vlm_sweep import tiny_vlm_config


class _ShiftsBetweenLayers(LlamaModel):
    """A body that adds to the hidden state between its layers (as Qwen3-VL's adds its deepstack features)."""

    def forward(self, input_ids=None, position_ids=None, **kwargs):
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h, position_ids=position_ids) + 1
        return BaseModelOutputWithPast(last_hidden_state=self.norm(h))


def test_a_body_that_changes_the_hidden_state_between_layers_is_refused():
    spec = discover(tiny_config("llama"))
    LayerContextBuilder(spec, torch.device("cpu"))  # Llama's own body hands each layer's output to the next
    spec.base.__class__ = _ShiftsBetweenLayers
    with pytest.raises(ModelNotSupportedError, match="'llama': its body changes the hidden state between decoder "
                                                     "layers 0 and 1, which mt-ray does not replay"):
        LayerContextBuilder(spec, torch.device("cpu"))


def test_deepstack_features_with_documents_that_run_alone_are_refused():
    """The engine adds deepstack features (Qwen3-VL's) to whole rows only: a body that also needs its documents run
    alone is refused by name, not trained with the features at the wrong tokens."""
    spec = discover(tiny_vlm_config("qwen3_vl"))
    assert not LayerContextBuilder(spec, torch.device("cpu")).isolate_documents
    spec.isolate_documents = True
    with pytest.raises(ModelNotSupportedError, match="'qwen3_vl': its documents must run through the layers one at a "
                                                     "time and its body adds deepstack features between layers"):
        LayerContextBuilder(spec, torch.device("cpu"))
