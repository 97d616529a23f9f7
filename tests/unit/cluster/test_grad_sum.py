"""The node's gradient sum: fp32 over the parts in the order given, rounded once, its norm² on any thread count.

The norm² is exact to fp32 rounding within a block (squares summed in fp32 lanes) and the blocks add in fp64: within
1e-6 of the fp64 norm², as torch's own fp32 `clip_grad_norm_` is, and the same on every thread count."""

import threading

import numba
import pytest
import torch

from mt_ray.cluster.grad_sum import BLOCK, sum_in_order, use_sum_threads

N = 3 * BLOCK + 777  # several blocks, the last one short
NORM_RTOL = 1e-6  # fp32 lanes within a block


def _parts(count: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(count)
    # Magnitudes spread over many binades, so rounding ties and carries into the exponent occur.
    return [(torch.randn(N, generator=g) * torch.exp2(torch.randint(-20, 20, (N,), generator=g))).to(dtype)
            for _ in range(count)]


def _in_order(parts: list[torch.Tensor]) -> torch.Tensor:
    total = parts[0].float()
    for p in parts[1:]:
        total = total + p.float()
    return total


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("count", [1, 2, 4])
def test_the_sum_is_bit_identical_to_fp32_addition_in_order_rounded_once(dtype, count):
    parts = _parts(count, dtype)
    expected = _in_order(parts)
    out = torch.empty(N, dtype=dtype)
    norm_sq = sum_in_order(parts, out)
    assert torch.equal(out, expected.to(dtype))
    assert norm_sq.dtype == torch.float64
    torch.testing.assert_close(norm_sq, expected.double().square().sum(), rtol=NORM_RTOL, atol=0)


def test_the_sum_may_land_on_its_first_part_and_a_lone_part_gives_its_norm_alone():
    parts = _parts(2, torch.bfloat16)
    expected = _in_order(parts).to(torch.bfloat16)
    sum_in_order(parts, parts[0])  # the slot is the first worker's landing and the sum's target
    assert torch.equal(parts[0], expected)
    before = parts[0].clone()
    norm_sq = sum_in_order([parts[0]], None)
    assert torch.equal(parts[0], before)
    torch.testing.assert_close(norm_sq, before.double().square().sum(), rtol=NORM_RTOL, atol=0)


def test_the_result_does_not_depend_on_the_thread_count():
    parts = _parts(3, torch.bfloat16)
    results = []
    for threads in (1, 2):
        use_sum_threads(threads)
        out = torch.empty(N, dtype=torch.bfloat16)
        results.append((sum_in_order(parts, out).item(), out))
    assert results[0][0] == results[1][0] and torch.equal(results[0][1], results[1][1])


def test_nan_stays_nan_and_mixed_dtypes_are_refused():
    parts = [torch.tensor([float("nan"), 1.0], dtype=torch.bfloat16), torch.ones(2, dtype=torch.bfloat16)]
    out = torch.empty(2, dtype=torch.bfloat16)
    sum_in_order(parts, out)
    assert out[0].isnan() and out[1] == 2
    with pytest.raises(TypeError, match="bf16 or fp32"):
        sum_in_order([torch.ones(2), torch.ones(2, dtype=torch.bfloat16)], None)
    with pytest.raises(TypeError, match="bf16 or fp32"):
        sum_in_order([torch.ones(2, dtype=torch.float16)] * 2, None)


def test_a_thread_keeps_its_team_size_when_another_thread_sets_another():
    """What the shard relies on: its reduce thread's team holds whatever the optimizer's thread sets."""
    seen, ready, go = [], threading.Event(), threading.Event()

    def reduce_thread() -> None:
        use_sum_threads(1)
        ready.set()
        go.wait(10)
        seen.append(numba.get_num_threads())

    t = threading.Thread(target=reduce_thread)
    t.start()
    ready.wait(10)
    use_sum_threads(2)
    go.set()
    t.join(10)
    assert seen == [1] and numba.get_num_threads() == min(2, numba.config.NUMBA_NUM_THREADS)
