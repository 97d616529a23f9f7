"""The coordinator shard's thread teams: the gradient sum gets its own only where it runs beside the optimizer."""

from mt_ray.cluster.shard_state import SUM_THREADS, split_threads


def test_a_shard_that_sums_splits_its_cores_between_two_disjoint_teams():
    assert split_threads(31, sums=True) == (31 - 7, 7)
    assert split_threads(63, sums=True) == (63 - SUM_THREADS, SUM_THREADS)
    assert sum(split_threads(15, sums=True)) == 15


def test_a_shard_that_never_sums_or_has_few_cores_keeps_one_count():
    assert split_threads(31, sums=False) == (31, 31)
    assert split_threads(3, sums=True) == (3, 3)
