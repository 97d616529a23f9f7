"""The packing probe: rows past every position threshold a config names, documents starting inside a chunk, and
layers that compute from the row's own index found in their code; where packing would change what a document
computes, its documents run alone and train as transformers' eager model trains each alone."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from mt_ray.models.context import LayerContextBuilder
from mt_ray.models.discovery import discover
from mt_ray.models.packing_probe import (
    beyond_probe,
    packed_differs,
    position_thresholds,
    probe_lengths,
    reads_row_index,
)
from tests.family_checks import assert_same_step, documents, engine_step, packed_micro_batch, reference_step
from tests.family_sweep import causal_lm_config_class, save_tiny
from tests.family_sweep import tiny_config as sweep_config

CPU = torch.device("cpu")


def _defaults() -> list:
    """Each causal-LM family's default config: the sizes of its released checkpoints, thresholds included."""
    out = []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            out.append(causal_lm_config_class(model_type)())
        except Exception:  # noqa: BLE001, S112 - a default transformers cannot build (a sub-config it requires)
            continue
    return out


def test_every_threshold_of_every_family_default_is_inside_the_probe_row():
    """B alone runs past each threshold (so the row does), or the family's documents run alone (`beyond_probe`)."""
    short = []
    for config in _defaults():
        b = probe_lengths(config)[1]
        short += [(config.model_type, k, v) for k, v in position_thresholds(config).items()
                  if v >= b and beyond_probe(config) is None]
    assert not short, f"thresholds past the probe's document B: {short}"


def test_the_thresholds_that_change_attention_are_found():
    llama4 = AutoConfig.for_model("llama4_text")  # the released models' 8192-token chunks and temperature floor
    assert position_thresholds(llama4) == {"attention_chunk_size": 8192, "floor_scale": 8192}
    assert sum(probe_lengths(llama4)) > 8192 + 2
    longrope = AutoConfig.for_model("phi3", max_position_embeddings=131072, rope_scaling={
        "rope_type": "longrope", "short_factor": [1.0] * 48, "long_factor": [4.0] * 48,
        "original_max_position_embeddings": 4096})
    assert position_thresholds(longrope) == {"rope_parameters.original_max_position_embeddings": 4096}
    assert position_thresholds(AutoConfig.for_model("mistral", sliding_window=4096)) == {"sliding_window": 4096}
    assert position_thresholds(AutoConfig.for_model("qwen2")) == {}  # max_window_layers counts layers
    dynamic = AutoConfig.for_model("llama", max_position_embeddings=65536,
                                   rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert "longer than the packing probe's rows" in beyond_probe(dynamic)
    # dynamic scaling starts past max_position_embeddings; an original_max_position_embeddings beside it is unread
    dynamic = AutoConfig.for_model("llama", max_position_embeddings=16, rope_scaling={
        "rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 8})
    assert position_thresholds(dynamic) == {"rope_parameters.max_position_embeddings": 16}


def test_a_chunk_cut_by_the_row_index_shows_for_a_document_starting_inside_a_chunk():
    """Llama 4's chunked mask follows the row's index: B, starting inside the first chunk and running past it, sees
    other chunk boundaries packed than alone (a document after one longer than the chunk would not show it)."""
    spec = discover(sweep_config("llama4_text", attention_chunk_size=16))
    ctx = LayerContextBuilder(spec, CPU)
    differs = packed_differs(lambda *row: ctx._record(ctx.probe_weights, *row), spec.config, 32, CPU, 0, masks=True)
    assert differs is not None and "attention_mask" in differs
    assert ctx.isolate_documents


def test_a_layer_that_numbers_the_row_itself_is_found_in_its_code():
    llama4 = discover(sweep_config("llama4_text", attention_chunk_size=64, floor_scale=3))
    found = reads_row_index(llama4.base.layers)
    assert found is not None and "Llama4TextAttention" in found and "arange" in found
    assert reads_row_index(discover(sweep_config("llama")).base.layers) is None
    minimax = discover(sweep_config("minimax_m3_vl_text")).base.layers  # an arange only where no position ids come
    assert reads_row_index(minimax) is not None
    assert reads_row_index(minimax, given={"position_ids"}) is None


@pytest.mark.parametrize(("chunk", "floor_scale"), [(8, 8192), (64, 3)], ids=["chunk-in-row", "temperature-floor"])
def test_llama4_packed_rows_train_as_each_document_alone(tmp_path, chunk, floor_scale):
    """A tiny Llama 4 (its second layer NoPE, with attention-temperature tuning) on packed rows of unequal documents,
    some starting inside a chunk: one step's loss and updates equal transformers' eager model on each document
    alone, with chunks shorter than the row, and with chunks longer but a temperature floor shorter."""
    save_tiny("llama4_text", tmp_path, attention_chunk_size=chunk, floor_scale=floor_scale, no_rope_layers=[1, 0])
    docs = documents()
    ref_loss, before, ref_state = reference_step(tmp_path, docs)
    result, state = engine_step(tmp_path, [packed_micro_batch(docs)])
    assert_same_step(state, before, ref_state, result.loss.item(), ref_loss)
