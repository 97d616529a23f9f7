"""CUDA: packed rows on the fast attention paths train as on the dense-mask path.

The fast paths keep documents apart without a T x T mask: 'varlen' (PyTorch's variable-length flash
kernel, `auto`'s choice on CUDA) and 'flex_attention' (a document BlockMask built once per
micro-batch). The dense-mask path is SDPA with transformers' block-causal mask. Both run in bf16, as
in training, and each is measured against the fp32 ground truth: transformers' eager model trained on
each document alone (tests/unit/engine/test_families.py checks the same in fp32 on the CPU).

Runs only where a GPU is present (the lent device machine); CPU CI skips it.
"""

from __future__ import annotations

import pytest
import torch

from mt_ray.models.varlen import varlen_attention_forward
from tests.family_checks import documents, engine_step, packed_micro_batch, reference_step, save_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class _Attention(torch.nn.Module):
    is_causal = True


def _relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("dv", [64, 32], ids=["mha-dims", "mla-dims"])
def test_the_flash_kernel_computes_what_each_document_alone_does(window, dv):
    """bf16 kernel against the fp64 per-document path: the bounds, window, scale, grouped heads and MLA dims
    reach torch's varlen API in the form this torch asks for them."""
    torch.manual_seed(0)
    lengths = [300, 77, 135, 512]  # two rows of 512
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    shapes = [(2, 8, 512, 64), (2, 2, 512, 64), (2, 2, 512, dv)]
    ref_in = [torch.randn(s, dtype=torch.float64).requires_grad_() for s in shapes]
    fast_in = [t.detach().cuda().bfloat16().requires_grad_() for t in ref_in]
    w = torch.randn(2, 512, 8, dv, dtype=torch.float64)
    args = {"scaling": 0.125, "sliding_window": window, "max_length_q": max(lengths)}
    fast, _ = varlen_attention_forward(_Attention(), *fast_in, None, cu_seq_lens_q=cu.cuda(), **args)
    ref, _ = varlen_attention_forward(_Attention(), *ref_in, None, cu_seq_lens_q=cu, **args)
    assert _relative_error(fast.cpu(), ref) < 1e-2
    fast_grads = torch.autograd.grad((fast * w.cuda().bfloat16()).sum(), fast_in)
    for g, r in zip(fast_grads, torch.autograd.grad((ref * w).sum(), ref_in), strict=True):
        assert _relative_error(g.cpu(), r) < 2e-2


def test_the_flash_kernel_attends_both_ways_within_each_window():
    """A Qwen-VL tower's attention (`TOWER_VARLEN`): every patch sees its whole window or image, none beyond,
    head dim 80, as transformers' SDPA per window computes it (here in fp64 on the host)."""
    torch.manual_seed(0)
    cu = torch.tensor([0, 256, 512, 1536, 1600], dtype=torch.int32)  # windows, a whole image, a short one
    ref_in = [torch.randn(1, 16, 1600, 80, dtype=torch.float64).requires_grad_() for _ in range(3)]
    fast_in = [t.detach().cuda().bfloat16().requires_grad_() for t in ref_in]
    args = {"scaling": 80**-0.5, "max_length_q": 1024, "is_causal": False}
    fast, _ = varlen_attention_forward(_Attention(), *fast_in, None, cu_seq_lens_q=cu.cuda(), **args)
    ref, _ = varlen_attention_forward(_Attention(), *ref_in, None, cu_seq_lens_q=cu, **args)
    assert _relative_error(fast.cpu(), ref) < 1e-2
    w = torch.randn(ref.shape, dtype=torch.float64)
    fast_grads = torch.autograd.grad((fast * w.cuda().bfloat16()).sum(), fast_in)
    for g, r in zip(fast_grads, torch.autograd.grad((ref * w).sum(), ref_in), strict=True):
        assert _relative_error(g.cpu(), r) < 2e-2


def _step_error(folder, mb, ref_loss, before, ref_state, **engine_kw) -> tuple[float, float]:
    """(loss error, update error) of one bf16 engine step against the fp32 reference."""
    result, state = engine_step(folder, [mb], device="cuda", **engine_kw)
    names = [n for n in ref_state if n in state]
    update = torch.cat([(state[n] - before[n]).reshape(-1) for n in names])
    ref_update = torch.cat([(ref_state[n] - before[n]).reshape(-1) for n in names])
    return abs(result.loss.item() - ref_loss) / ref_loss, _relative_error(update, ref_update)


@pytest.mark.parametrize(("family", "backend", "overrides"), [
    ("llama", "varlen", {}),
    ("mistral", "varlen", {}),  # sliding window
    ("gemma3_text", "varlen", {}),  # sliding and full layers, each with its own rotary table
    ("qwen2-tied", "varlen", {}),
    ("deepseek_v3", "varlen", {}),  # MLA: value head dim below the query's
    ("qwen3_next", "varlen", {}),  # linear-attention hybrid: documents run alone
    ("llama", "flex_attention", {"head_dim": 16}),  # FlexAttention's kernels take head dims of 16 and up
    ("mistral", "flex_attention", {"head_dim": 16}),
    ("gemma3_text", "flex_attention", {"head_dim": 16}),
])
def test_fast_packed_path_trains_as_the_dense_mask_path(family, backend, overrides, tmp_path):
    """Within bf16 of the fp32 per-document reference, and no further from it than the dense-mask path is."""
    save_checkpoint(family, tmp_path, **overrides)
    docs = documents()
    mb = packed_micro_batch(docs)
    ref = reference_step(tmp_path, docs, device="cuda")
    fast = _step_error(tmp_path, mb, *ref, attn_implementation=backend)
    dense = _step_error(tmp_path, mb, *ref, attn_implementation="sdpa")
    assert fast[0] < max(2 * dense[0], 1e-2), (fast, dense)
    assert fast[1] < max(2 * dense[1], 5e-2), (fast, dense)
