"""Encoder families used as decoders: an embedding and a layer list nested in containers of the body, and modules
between the body and the LM head (tests/family_sweep.py trains each at parity; these pin down how)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from transformers.modeling_outputs import BaseModelOutput
from transformers.models.bert.modeling_bert import BertModel

from mt_ray.engine import EngineConfig, StreamingEngine
from mt_ray.errors import ModelNotSupportedError
from mt_ray.models.context import LayerContextBuilder
from mt_ray.models.discovery import discover
from tests.family_checks import OPT, assert_exports_as_saved
from tests.family_sweep import save_tiny, tiny_config

CPU = torch.device("cpu")
ENCODER_FAMILIES = ["bert", "bert-generation", "big_bird", "camembert", "data2vec-text", "electra", "ernie",
                    "megatron-bert", "modernbert-decoder", "rembert", "roberta", "roberta-prelayernorm", "roc_bert",
                    "roformer", "xlm-roberta", "xlm-roberta-xl", "xmod"]


def _hf_names(spec, unit: str) -> list[str]:
    return [p.hf_name for p in spec.unit(unit).params]


def test_bert_streams_its_embedding_container_and_prediction_head():
    spec = discover(tiny_config("bert"))
    assert (spec.layers_attr, spec.embed_attrs, spec.norm_attr, spec.between_attrs) == (
        "encoder.layer", ("embeddings",), None, ("cls",))
    assert "bert.embeddings.position_embeddings.weight" in _hf_names(spec, "embed")
    head = _hf_names(spec, "head")
    assert "cls.predictions.transform.dense.weight" in head
    # The decoder's bias is the prediction head's (tied): held once, under the name save_pretrained stores.
    assert "cls.predictions.bias" in head and "cls.predictions.decoder.bias" not in head
    every = [p.hf_name for u in spec.units for p in u.params]
    assert len(every) == len(set(every))


def test_modules_inside_the_encoder_split_around_the_layers():
    """RemBERT maps the embedding to the hidden size inside its encoder, before the layers; Megatron-BERT's encoder
    norms after them."""
    rembert = discover(tiny_config("rembert"))
    assert rembert.embed_attrs == ("embeddings", "encoder.embedding_hidden_mapping_in")
    assert discover(tiny_config("megatron-bert")).norm_attr == "encoder.ln"


def test_a_pooler_the_lm_head_never_reads_stays_untrained():
    spec = discover(tiny_config("big_bird"))
    assert spec.unread_attrs == ("pooler",)
    pooler = [p for p in spec.unit("head").params if p.hf_name.startswith("bert.pooler.")]
    assert len(pooler) == 2 and not any(p.trainable for p in pooler)


def test_a_body_numbering_its_own_positions_records_each_document_alone():
    """RoBERTa counts positions from its padding token when given none (as transformers is called on a document);
    BERT reads the position ids (its documents run alone for its mask); ModernBERT's decoder trains packed rows."""
    roberta = LayerContextBuilder(discover(tiny_config("roberta")), CPU)
    assert roberta.own_positions and roberta.isolate_documents
    bert = LayerContextBuilder(discover(tiny_config("bert")), CPU)
    assert not bert.own_positions and bert.isolate_documents
    assert not LayerContextBuilder(discover(tiny_config("modernbert-decoder")), CPU).isolate_documents


class _ScalesAfterLayers(BertModel):
    """A body that changes the hidden state after its last layer (as CPM-Ant drops its prompt's tokens there)."""

    def forward(self, input_ids=None, position_ids=None, **kwargs):
        h = self.embeddings(input_ids=input_ids, position_ids=position_ids)
        return BaseModelOutput(last_hidden_state=self.encoder(h).last_hidden_state * 2)


def test_a_body_that_changes_the_hidden_state_after_its_layers_is_refused():
    spec = discover(tiny_config("bert"))
    spec.base.__class__ = _ScalesAfterLayers
    with pytest.raises(ModelNotSupportedError, match="'bert': its body changes the hidden state after its last "
                                                     "decoder layer"):
        LayerContextBuilder(spec, CPU)


def test_block_sparse_attention_is_refused_by_name():
    config = tiny_config("big_bird")
    config.attention_type = "block_sparse"
    with pytest.raises(ModelNotSupportedError, match="'big_bird' uses block-sparse attention"):
        discover(config)


def test_a_body_that_embeds_tokens_of_its_own_is_refused_before_any_state():
    with pytest.raises(ModelNotSupportedError, match="'cpmant': its body embeds other tokens than the row's"):
        StreamingEngine(discover(tiny_config("cpmant")), EngineConfig(device="cpu"), OPT, total_steps=1)


def test_reversible_layers_are_refused_by_name():
    """Reformer's encoder runs its layers inside a reversible function that reads two streams off each layer's
    output (`attn_output`, `hidden_states`), which no stand-in returns (its default axial positions are refused even
    before: they need rows of one fixed length)."""
    config = tiny_config("reformer")
    config.axial_pos_embds, config.attn_layers = False, ["local", "local"]
    with pytest.raises(ModelNotSupportedError, match="'reformer': its body does not run with mt-ray's layer stand-ins "
                                                     r"\(AttributeError: .*attn_output"):
        StreamingEngine(discover(config), EngineConfig(device="cpu"), OPT, total_steps=1)


def test_a_checkpoint_that_also_stores_the_tied_copies_loads(tmp_path):
    """Older BERT checkpoints store the decoder's bias and matrix again beside `cls.predictions.bias` and the
    embedding: the copies are the same tensors, and the state is the one tensor each."""
    config = tiny_config("bert")
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    assert "cls.predictions.decoder.bias" not in tensors  # save_pretrained stores each tied tensor once
    tensors["cls.predictions.decoder.bias"] = tensors["cls.predictions.bias"].clone()
    tensors["cls.predictions.decoder.weight"] = tensors["bert.embeddings.word_embeddings.weight"].clone()
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    engine = StreamingEngine(discover(str(tmp_path)), EngineConfig(device="cpu"), OPT, total_steps=1)
    try:
        engine.load_pretrained(tmp_path)
        state = engine.state_dict()
    finally:
        engine.close()
    assert torch.equal(state["cls.predictions.bias"], model.cls.predictions.bias.detach())
    assert "cls.predictions.decoder.bias" not in state


@pytest.mark.parametrize("model_type", ENCODER_FAMILIES)
def test_a_checkpoint_loads_and_exports_as_save_pretrained_wrote_it(model_type, tmp_path):
    """Every tensor of the folder, tied ones stored once (the decoder's bias as the prediction head's), comes back
    under the same names with the same values."""
    save_tiny(model_type, tmp_path / "saved")
    assert_exports_as_saved(tmp_path / "saved", tmp_path / "exported")
