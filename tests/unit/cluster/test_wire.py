"""The shard's gradient sum: fp32 over the parts in the order given, rounded once, whatever their dtypes."""

import pytest
import torch

from mt_ray.cluster import wire


@pytest.mark.parametrize("dtypes", [(torch.bfloat16,) * 3, (torch.float32, torch.bfloat16), (torch.float16,) * 2,
                                    (torch.float32,) * 2])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_the_sum_equals_fp32_addition_in_order_rounded_once(monkeypatch, dtypes, out_dtype):
    monkeypatch.setattr(wire, "SUM_CHUNK", 1000)  # several chunks, the last one short
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(4321, generator=g).to(dt) for dt in dtypes]
    expected = parts[0].float()
    for v in parts[1:]:
        expected = expected + v.float()
    out = torch.empty(4321, dtype=out_dtype)
    norm_sq = wire.sum_in_order(parts, out)
    assert torch.equal(out, expected.to(out_dtype))
    assert norm_sq.dtype == torch.float32
    torch.testing.assert_close(norm_sq, expected.square().sum(), rtol=1e-6, atol=0)


def test_a_lone_part_gives_its_norm_and_writes_nothing():
    part = torch.arange(10, dtype=torch.bfloat16)
    assert wire.sum_in_order([part], None).item() == pytest.approx(float((part.float() ** 2).sum()))
