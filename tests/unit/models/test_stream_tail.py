"""Bodies read from their source: children used through the body's own methods (Gemma 4's per-layer inputs), the
body's own code after its layers lifted out for the head unit (DeepSeek-V4's and Qwen4-Exp's hyper-connection heads,
Gemma 3n's AltUp unembedding), the layout of a widened stream, and children whose output only builds the attention
mask (Qwen4-Exp's indexer)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutput
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Model
from transformers.models.gemma3n.modeling_gemma3n import Gemma3nTextModel
from transformers.models.gemma4.modeling_gemma4 import Gemma4TextModel
from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextAttention

from mt_ray.errors import ModelNotSupportedError
from mt_ray.models.body_source import first_use
from mt_ray.models.discovery import ParamInfo, discover
from mt_ray.models.mask_modules import mask_only_children
from mt_ray.models.stream_tail import Stream, measure, tail_code
from mt_ray.models.tail_module import check_per_token
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


def test_the_code_after_the_layers_joins_the_head_unit_with_the_modules_it_uses():
    code = tail_code(DeepseekV4Model.__new__(DeepseekV4Model), "layers")  # only its forward's source is read
    assert code.children == {"hc_head", "norm"} and code.free == ()
    assert "self.norm(self.hc_head(hidden_states))" in code.source
    spec = discover(tiny_config("qwen4_exp_text"))
    assert spec.tail_attrs == ("hyper_connection_mixer",) and spec.norm_attr is None
    assert any(p.local_name.startswith("hyper_connection_mixer.") for p in spec.unit("head").params)


def test_what_the_tail_reads_from_before_the_layers_is_taken_only_where_tokens_do_not_matter():
    """Gemma 3n's unembedding reads `epsilon_tensor` (0-dim) and `hidden_states_0` (only its dtype)."""
    code = tail_code(Gemma3nTextModel.__new__(Gemma3nTextModel), "layers")
    assert set(code.free) == {"epsilon_tensor", "hidden_states_0"} and code.meta_only == {"hidden_states_0"}
    spec = discover(tiny_config("gemma3n_text"))
    assert set(spec.tail_attrs) == {"altup_unembed_projections", "norm"}
    assert {"altup_projections", "embed_tokens_per_layer"} <= set(spec.embed_attrs)


def test_a_stream_is_kept_token_major_whatever_the_layers_layout():
    stream = Stream()
    measure(stream, torch.zeros(3, 1, 2, 8), (1, 2), "m")  # AltUp's [n, B, T, D]
    assert (stream.token_dim, stream.numel) == (1, 24)
    x = torch.randn(3, 1, 2, 8)
    assert stream.to_tokens(x).shape == (1, 2, 3, 8) and torch.equal(stream.to_layers(stream.to_tokens(x)), x)
    with pytest.raises(ModelNotSupportedError, match="'m'.*without adjacent batch and token dimensions"):
        measure(stream, torch.zeros(4, 8), (1, 2), "m")


def test_a_child_that_only_builds_the_attention_mask_gets_no_gradient():
    assert "indexer" in mask_only_children(Qwen4ExpTextAttention)
    spec = discover(tiny_config("qwen4_exp_text"))
    indexer = [p for u in spec.layer_units for p in u.params if ".indexer." in p.local_name]
    assert indexer and not any(p.trainable for p in indexer)


class _MixingBody(nn.Module):
    """A body whose code after its layers lets each token see the ones before it (a running sum)."""

    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(8, 4)
        self.layers = nn.ModuleList([nn.Linear(4, 4)])
        self.mix = nn.Linear(4, 4)

    def forward(self, input_ids):
        hidden_states = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        hidden_states = self.mix(hidden_states.cumsum(1))
        return BaseModelOutput(last_hidden_state=hidden_states)


@pytest.mark.parametrize("mixes", [True, False])
def test_a_tail_whose_tokens_see_each_other_is_refused(mixes):
    body = _MixingBody()
    code = tail_code(body, "layers")
    if not mixes:  # the same tail without the running sum
        code = dataclasses.replace(code, source=code.source.replace(".cumsum(1)", ""))
    params = [ParamInfo(f"mix.{n}", f"mix.{n}", tuple(p.shape)) for n, p in body.mix.named_parameters()]
    spec = SimpleNamespace(base=body, tail_attrs=("mix",), tail_code=code, config=SimpleNamespace(model_type="m"),
                           unit=lambda name: SimpleNamespace(params=params))
    stream = Stream(token_shape=(4,))
    if mixes:
        with pytest.raises(ModelNotSupportedError, match="'m'.*mixes tokens"):
            check_per_token(spec, stream, torch.device("cpu"))
    else:
        check_per_token(spec, stream, torch.device("cpu"))


@pytest.mark.parametrize(("family", "alone"), [("deepseek_v32", True), ("qwen4_exp_text", True), ("llama", False)])
def test_layers_whose_indexer_picks_keys_over_the_row_run_documents_alone(family, alone):
    """DeepSeek-V3.2's indexer runs without a gradient; a packed row's documents would crowd each other's keys out."""
    assert discover(tiny_config(family)).isolate_documents is alone
