"""Structure discovery: units, layer kinds, tied heads, and clear refusals."""

import json
import re

import pytest
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

from mt_ray.errors import ModelNotSupportedError
from mt_ray.models.discovery import discover
from tests.family_sweep import tiny_config as sweep_config
from tests.tiny_models import checkpoint_config, tiny_config
from tests.vlm_sweep import tiny_vlm_config


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


def test_unknown_model_type_is_refused_clearly(tmp_path):
    """Whether from a dict or a checkpoint's config.json, the error names the installed transformers."""
    version = re.escape(f"transformers {transformers.__version__} does not know it")
    with pytest.raises(ModelNotSupportedError, match=f"unknown model_type 'nonsense' in the model config: .*{version}"):
        discover({"model_type": "nonsense"})
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen9_moe", "hidden_size": 32}))
    with pytest.raises(ModelNotSupportedError, match=f"unknown model_type 'qwen9_moe' in .*config.json: .*{version}"):
        discover(str(tmp_path))


def test_saved_buffers_travel_with_their_layer_as_frozen_entries():
    """DeepSeek-V3's per-layer routing bias is in the checkpoint: it belongs to its layer's unit, untrained."""
    spec = discover(checkpoint_config("deepseek_v3"))
    [bias] = [p for p in spec.unit("layers.1").params if not p.trainable]
    assert bias.hf_name == "model.layers.1.mlp.gate.e_score_correction_bias" and not bias.decays
    assert spec.unit("layers.1").params[-1] == bias  # frozen entries come last
    assert all(p.trainable for p in spec.unit("layers.0").params)  # the dense first layer has none


@pytest.mark.parametrize(("family", "isolate"), [("llama", False), ("qwen3_moe", False), ("gpt_oss", False),
                                                 ("qwen3_next", True), ("lfm2", True), ("falcon_h1", True)])
def test_layers_that_carry_state_along_the_sequence_are_found(family, isolate):
    """Linear attention, short convolutions and Mamba mixers (not attention) need documents run alone.
    GPT-OSS's leak is in its masks, which the context builder probes at run time instead."""
    assert discover(checkpoint_config(family)).isolate_documents is isolate


def test_model_without_decoder_only_layout_is_refused():
    """XLM keeps each layer's parts in lists of their own (attentions, norms, feed-forwards): no list of layers."""
    with pytest.raises(ModelNotSupportedError, match=r"'xlm' does not have a decoder-only layout: expected one list "
                       r"of 2 decoder layers"):
        discover(AutoConfig.for_model("xlm", emb_dim=16, n_layers=2, n_heads=2, vocab_size=32))


def test_an_engines_attention_choice_stays_off_the_callers_config():
    """A data-parallel driver sends the same config object to its shards, where a backend the engine
    registered in another process (varlen) would not exist."""
    from mt_ray.engine import EngineConfig, OptimizerConfig, StreamingEngine

    cfg = tiny_config("llama")
    before = cfg._attn_implementation
    engine = StreamingEngine(discover(cfg), EngineConfig(device="cpu", attn_implementation="eager"), OptimizerConfig(), 1)
    try:
        assert engine.spec.config._attn_implementation == "eager"
    finally:
        engine.close()
    assert cfg._attn_implementation == before != "eager"


def _as_saved(model_type: str):
    """The sweep's tiny config as its causal-LM class saves it (BART's as a decoder alone)."""
    return AutoModelForCausalLM.from_config(sweep_config(model_type)).config


def test_modules_run_before_the_first_layer_stream_with_the_embedding():
    spec = discover(_as_saved("gpt2"))
    assert spec.embed_attrs == ("wpe",) and spec.norm_attr == "ln_f"
    assert [p.hf_name for p in spec.unit("embed").params] == ["transformer.wte.weight", "transformer.wpe.weight"]
    assert [p.local_name for p in spec.unit("embed").params] == ["weight", "wpe.weight"]


def test_a_decoders_cross_attention_travels_untrained_and_its_tied_head_without_norm_is_empty():
    spec = discover(_as_saved("bart"))
    assert spec.norm_attr is None and spec.tied and spec.unit("head").params == [] and spec.unit("head").frozen
    layer = spec.unit("layers.0").params
    assert {p.trainable for p in layer if ".encoder_attn" in p.hf_name} == {False}
    assert {p.trainable for p in layer if ".self_attn." in p.hf_name} == {True}


def test_a_head_transformers_keeps_apart_is_not_tied():
    """BigBird-Pegasus' decoder says `tie_word_embeddings` but transformers ties nothing (and saves the head)."""
    config = _as_saved("bigbird_pegasus")
    assert config.tie_word_embeddings and not discover(config).tied


def test_an_omni_thinkers_audio_tower_travels_untrained_with_the_tower_and_its_body_holds_the_head():
    spec = discover(tiny_vlm_config("qwen2_5_omni_thinker"), freeze_vision_tower=False)
    assert spec.vision.held_paths == ["audio_tower"] and spec.vision.holds_head
    assert spec.vision.projector_paths == ["visual.merger"]  # neither the audio tower nor the LM head
    audio = [p for p in spec.unit("vision.embed").params if p.hf_name.startswith("audio_tower.")]
    assert audio and not any(p.trainable for p in audio)
