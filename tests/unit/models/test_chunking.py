"""Norms and dense MLPs in sequence chunks: what a layer's graph keeps, and which parts are chunked."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from mt_ray.engine.batch import prepare_micro_batch
from mt_ray.engine.templates import UnitTemplate
from mt_ray.models.chunking import ChunkedForward, apply_token_chunks
from mt_ray.models.context import LayerContextBuilder
from mt_ray.models.discovery import discover
from tests.tiny_models import checkpoint_config, tiny_config

CPU = torch.device("cpu")
INTER = 344  # unlike any token count here


def saved_for_backward(chunk: int | None, tokens: int) -> list[torch.Tensor]:
    """What autograd keeps of one bf16 decoder layer's forward over `tokens` (weights left out)."""
    spec = discover(tiny_config("qwen2", hidden_size=64, intermediate_size=INTER, num_hidden_layers=1))
    apply_token_chunks(spec, chunk)
    unit = spec.layer_units[0]
    template = UnitTemplate(spec.layer_kinds[unit.kind], unit.params, CPU)
    flat = (torch.randn(unit.numel) * 0.02).bfloat16()
    weights = template.bind(flat, requires_grad=True)
    mb = prepare_micro_batch({"input_ids": torch.randint(3, 96, (1, tokens))}, CPU)
    x = torch.randn(1, tokens, 64, dtype=torch.bfloat16, requires_grad=True)
    _, ctx = LayerContextBuilder(spec, CPU)(x.detach(), mb.input_ids_BT, mb.position_ids_BT, mb.documents)
    kept = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr():
            kept.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = ctx.run(partial(template, weights), 0, x)
    out.sum().backward()  # each chunk recomputed (outside the hooks: its graph lives for one chunk)
    assert x.grad is not None and all(w.grad is not None for w in template.leaves(weights))
    return kept


def bytes_per_token(kept: list[torch.Tensor], tokens: int) -> float:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in kept}
    return sum(storages.values()) / tokens


def test_the_layer_graph_keeps_no_mlp_intermediate():
    whole, chunked = saved_for_backward(None, 256), saved_for_backward(32, 256)
    assert any(t.shape[-1] == INTER for t in whole)
    assert not any(t.shape[-1] == INTER for t in chunked)
    assert bytes_per_token(chunked, 256) < 0.3 * bytes_per_token(whole, 256)
    # per token, whatever the length: the intermediates live for one chunk only
    assert bytes_per_token(saved_for_backward(32, 512), 512) == bytes_per_token(chunked, 256)


def test_norms_and_dense_mlps_are_chunked_and_moe_blocks_are_not():
    spec = discover(checkpoint_config("qwen3_moe"))  # layer 0 dense, layer 1 MoE
    dense, moe = spec.layer_kinds
    assert set(apply_token_chunks(spec, 8)) == {f"{dense}.mlp", f"{dense}.input_layernorm",
                                                f"{dense}.post_attention_layernorm", f"{moe}.input_layernorm",
                                                f"{moe}.post_attention_layernorm"}
    gpt_oss = discover(checkpoint_config("gpt_oss"))  # its 'MLP' holds the router and experts
    assert not any(name.endswith(".mlp") for name in apply_token_chunks(gpt_oss, 8))


@pytest.mark.parametrize("then", [16, None])
def test_a_new_engine_rewraps_or_unwraps_the_shared_layer_modules(then):
    spec = discover(tiny_config("llama"))
    mlp = next(iter(spec.layer_kinds.values())).mlp
    apply_token_chunks(spec, 8)
    apply_token_chunks(spec, then)
    current = vars(mlp).get("forward")
    if then is None:
        assert current is None  # the class's own forward again
    else:
        assert isinstance(current, ChunkedForward) and current.chunk == then
        assert not isinstance(current.inner, ChunkedForward)
