"""The varlen attention backend: documents apart from their bounds alone, with no mask; which backend `auto` takes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mt_ray.engine.batch import prepare_micro_batch
from mt_ray.errors import ConfigError
from mt_ray.models.attention import resolve_attention
from mt_ray.models.context import LayerContextBuilder
from mt_ray.models.discovery import discover
from mt_ray.models.varlen import _kernel_kwargs, varlen_attention_forward
from tests.family_checks import documents, packed_micro_batch
from tests.tiny_models import checkpoint_config, tiny_config

SPANS = [(0, 5), (5, 12), (12, 16), (16, 19), (19, 32)]  # two rows of 16; a document never crosses a row
CUDA, CPU = torch.device("cuda"), torch.device("cpu")


class _Attention(torch.nn.Module):
    is_causal = True


def qkv(dv: int = 8, seed: int = 0):
    """q [2, 4, 16, 8] with 2 key/value heads (grouped-query), v of head dim `dv`."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(2, 4, 16, 8), (2, 2, 16, 8), (2, 2, 16, dv)]
    return [torch.randn(s, generator=g, dtype=torch.float64).requires_grad_() for s in shapes]


def masked_sdpa(q, k, v, window: int | None):
    """transformers' SDPA path: one dense block-causal mask (same document, causal, within the window)."""
    doc = torch.tensor([d for d, (s, e) in enumerate(SPANS) for _ in range(s, e)]).view(2, 16)
    i = torch.arange(16)
    allowed = (doc[:, :, None] == doc[:, None, :]) & (i[:, None] >= i[None, :])
    if window:
        allowed &= i[:, None] - i[None, :] < window
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                         attn_mask=allowed[:, None], scale=0.3)
    return out.transpose(1, 2)


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("dv", [8, 4], ids=["mha-dims", "mla-dims"])
def test_bounds_alone_compute_what_the_block_mask_does(window, dv):
    q, k, v = qkv(dv)
    cu = torch.tensor([s for s, _ in SPANS] + [32], dtype=torch.int32)
    out, _ = varlen_attention_forward(_Attention(), q, k, v, None, scaling=0.3, sliding_window=window,
                                      cu_seq_lens_q=cu, max_length_q=13)
    ref = masked_sdpa(q, k, v, window)
    torch.testing.assert_close(out, ref)
    grads = torch.autograd.grad(out.square().sum(), [q, k, v])
    for g, r in zip(grads, torch.autograd.grad(ref.square().sum(), [q, k, v]), strict=True):
        torch.testing.assert_close(g, r)


def test_without_bounds_each_row_is_one_sequence():
    q, k, v = qkv()
    out, _ = varlen_attention_forward(_Attention(), q, k, v, None, scaling=0.3)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(out, ref.transpose(1, 2))


@pytest.mark.parametrize("kw", [{"softcap": 1.0}, {"dropout": 0.1}, {"s_aux": torch.zeros(4)},
                                {"is_causal": False, "sliding_window": 4}])
def test_what_the_kernel_cannot_compute_is_refused(kw):
    with pytest.raises(ValueError, match="varlen attention takes no mask, soft-capping, sinks, dropout or bidirect"):
        varlen_attention_forward(_Attention(), *qkv(), None, **kw)


def test_both_ways_each_bounded_span_attends_to_all_of_itself_alone():
    """A vision tower's windows (`TOWER_VARLEN`): no causal mask, nothing across a bound."""
    q, k, v = (t[:1] for t in qkv())
    cu = torch.tensor([0, 5, 6, 16], dtype=torch.int32)
    out, _ = varlen_attention_forward(_Attention(), q, k, v, None, scaling=0.3, is_causal=False, cu_seq_lens_q=cu)
    bounds = cu.tolist()
    ref = torch.cat([F.scaled_dot_product_attention(q[..., s:e, :], k[..., s:e, :], v[..., s:e, :], scale=0.3,
                                                    enable_gqa=True) for s, e in zip(bounds[:-1], bounds[1:], strict=True)], 2)
    torch.testing.assert_close(out, ref.transpose(1, 2))


def test_the_kernel_is_asked_in_each_torch_form_of_its_api():
    """Causality is `window_size=(left, 0)` where torch has it, else `is_causal`; grouped heads say so where asked."""
    assert _kernel_kwargs(frozenset({"window_size", "enable_gqa"}), 3, True) == {"window_size": (3, 0), "enable_gqa": True}
    assert _kernel_kwargs(frozenset({"window_size"}), -1, True) == {"window_size": (-1, 0)}
    assert _kernel_kwargs(frozenset({"is_causal"}), -1, False) == {"is_causal": True}
    assert _kernel_kwargs(frozenset({"window_size"}), -1, False, causal=False) == {"window_size": (-1, -1)}
    assert _kernel_kwargs(frozenset({"is_causal"}), -1, False, causal=False) == {"is_causal": False}
    with pytest.raises(ValueError, match="no sliding window"):
        _kernel_kwargs(frozenset({"is_causal"}), 3, False)


def test_layers_get_the_micro_batch_bounds_and_no_mask():
    spec = discover(tiny_config("mistral"))
    spec.config._attn_implementation = resolve_attention(spec, "varlen", CPU, torch.float32)
    builder = LayerContextBuilder(spec, CPU)
    mb = prepare_micro_batch(packed_micro_batch(documents()), CPU)
    embeds = torch.zeros(*mb.input_ids_BT.shape, spec.config.hidden_size)
    _, ctx = builder(embeds, mb.input_ids_BT, mb.position_ids_BT, mb.documents)
    assert not builder.isolate_documents
    for kw in ctx.whole:
        assert kw["attention_mask"] is None
        assert kw["cu_seq_lens_q"].tolist() == [0, 9, 15, 22, 24, 37, 48]  # rows [9 6 7 +2 pad], [13 11]
        assert kw["max_length_q"] == 13


@pytest.mark.parametrize(("family", "device", "dtype", "expected"), [
    ("llama", CUDA, torch.bfloat16, "varlen"),
    ("mistral", CUDA, torch.bfloat16, "varlen"),
    ("llama", CUDA, torch.float32, "sdpa"),  # the flash kernel takes half precision only
    ("llama", CPU, torch.float32, "sdpa"),
    ("gemma2", CUDA, torch.bfloat16, "eager"),  # soft-capping
    ("gpt_oss", CUDA, torch.bfloat16, "eager"),  # sinks
])
def test_auto_takes_varlen_on_cuda_where_the_family_allows(family, device, dtype, expected):
    spec = discover(checkpoint_config(family))
    assert resolve_attention(spec, "auto", device, dtype) == expected


@pytest.mark.parametrize(("family", "dtype", "message"), [
    ("llama", torch.float32, "'varlen' runs the flash kernel, which takes bf16 or fp16 compute only"),
    ("gemma2", torch.bfloat16, "'varlen' does not implement the attention soft-capping that 'gemma2' uses"),
    ("llama", torch.bfloat16, "'varlen' has no attention dropout"),
    ("gemma3_text", torch.bfloat16, "'varlen' computes causal attention only, and this 'gemma3_text' attends both"),
])
def test_varlen_that_cannot_train_the_model_here_is_refused(family, dtype, message):
    overrides = {"attention_dropout": 0.1} if "dropout" in message else {}
    if "both" in message:
        overrides["use_bidirectional_attention"] = True
    spec = discover(checkpoint_config(family, **overrides))
    with pytest.raises(ConfigError, match=f"engine.attn_implementation: {message}"):
        resolve_attention(spec, "varlen", CUDA, dtype)
