"""Structure discovery: units, layer kinds, tied heads, and clear refusals."""

import pytest
from transformers import AutoConfig

from mt_ray.errors import ModelNotSupportedError
from mt_ray.models.discovery import discover
from tests.tiny_models import tiny_config


def test_units_cover_every_parameter_once():
    spec = discover(tiny_config("llama"))
    names = [p.hf_name for u in spec.units for p in u.params]
    assert len(names) == len(set(names))
    assert set(names) == {n for n, _ in spec.skeleton.named_parameters()}
    assert [u.name for u in spec.units] == ["embed", *[f"layers.{i}" for i in range(5)], "head"]
    assert not spec.tied and len(spec.layer_kinds) == 1


def test_tied_head_owns_only_the_norm():
    spec = discover(tiny_config("qwen2-tied"))
    assert spec.tied
    assert [p.hf_name for p in spec.unit("head").params] == ["model.norm.weight"]


def test_sliding_and_full_attention_layers_are_separate_kinds():
    spec = discover(tiny_config("gemma3_text"))
    kinds = [u.kind for u in spec.layer_units]
    assert kinds[0] == kinds[1] == kinds[3] and kinds[2] == kinds[4] and kinds[0] != kinds[2]


def test_moe_and_dense_layers_are_separate_kinds():
    spec = discover(tiny_config("qwen3_moe"))
    assert len(spec.layer_kinds) == 2


def test_decayed_parameters_come_first_in_every_unit():
    for unit in discover(tiny_config("llama")).units:
        flags = [p.decays for p in unit.params]
        assert flags == sorted(flags, reverse=True), unit.name


def test_encoder_decoder_is_refused_clearly():
    with pytest.raises(ModelNotSupportedError, match="encoder-decoder"):
        discover(AutoConfig.for_model("t5", d_model=16, num_layers=1, num_heads=2, d_ff=32, vocab_size=32))


def test_unknown_model_type_is_refused_clearly():
    with pytest.raises(ModelNotSupportedError, match="unknown model_type 'nonsense'"):
        discover({"model_type": "nonsense"})


def test_model_without_decoder_only_layout_is_refused():
    with pytest.raises(ModelNotSupportedError, match="'bert' does not have a decoder-only layout"):
        discover(AutoConfig.for_model("bert", hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=32, vocab_size=32))
