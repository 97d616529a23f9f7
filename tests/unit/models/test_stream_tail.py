"""Bodies read from their source: children used through the body's own methods (Gemma 4's per-layer inputs), a
widened residual stream collapsed after the layers by a chain of the body's modules (DeepSeek-V4's and Qwen4-Exp's
hyper-connections), and children whose output only builds the attention mask (Qwen4-Exp's indexer)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Model
from transformers.models.gemma4.modeling_gemma4 import Gemma4TextModel
from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextAttention

from mt_ray.errors import ModelNotSupportedError
from mt_ray.models.body_source import first_use
from mt_ray.models.discovery import discover
from mt_ray.models.mask_modules import mask_only_children
from mt_ray.models.stream_tail import tail_chain, token_numel
from tests.family_sweep import tiny_config


def test_a_child_used_through_a_method_counts_where_the_method_is_called():
    """`self.get_per_layer_inputs(...)` runs `self.embed_tokens_per_layer` before the layer loop."""
    assert first_use(Gemma4TextModel, "embed_tokens_per_layer") < first_use(Gemma4TextModel, "layers")
    assert first_use(Gemma4TextModel, "norm") > first_use(Gemma4TextModel, "layers")
    assert first_use(Gemma4TextModel, "no_such_child") is None


def test_per_layer_inputs_join_the_embed_unit_and_reach_each_layer():
    spec = discover(tiny_config("gemma4_text"))
    assert spec.embed_attrs == ("embed_tokens_per_layer", "per_layer_model_projection", "per_layer_projection_norm")
    assert {p.local_name.split(".")[0] for p in spec.unit("embed").params} >= set(spec.embed_attrs)


def test_the_hyper_connection_head_joins_the_head_unit_before_the_norm():
    body = DeepseekV4Model.__new__(DeepseekV4Model)  # its forward's source is all that is read
    assert tail_chain(body, "layers") == ["hc_head", "norm"]  # self.norm(self.hc_head(hidden_states))
    spec = discover(tiny_config("qwen4_exp_text"))
    assert spec.tail_attrs == ("hyper_connection_mixer",) and spec.norm_attr is None
    assert any(p.local_name.startswith("hyper_connection_mixer.") for p in spec.unit("head").params)


def test_a_tail_of_its_own_code_is_refused_by_name():
    """Gemma 3n collapses its AltUp streams with magnitudes computed after the layers: not a chain of modules."""
    with pytest.raises(ModelNotSupportedError, match=r"'gemma3n_text'.*code of its own"):
        discover(tiny_config("gemma3n_text"))


def test_a_stream_not_laid_out_token_major_is_refused():
    assert token_numel(torch.zeros(1, 2, 4, 8), (1, 2), "m") == 32
    with pytest.raises(ModelNotSupportedError, match="'m'.*not the batch and the tokens"):
        token_numel(torch.zeros(4, 1, 2, 8), (1, 2), "m")


def test_a_child_that_only_builds_the_attention_mask_gets_no_gradient():
    assert "indexer" in mask_only_children(Qwen4ExpTextAttention)
    spec = discover(tiny_config("qwen4_exp_text"))
    indexer = [p for u in spec.layer_units for p in u.params if ".indexer." in p.local_name]
    assert indexer and not any(p.trainable for p in indexer)
