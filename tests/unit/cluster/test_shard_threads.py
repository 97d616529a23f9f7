"""The coordinator shard's thread teams: the gradient sum gets its own only where it runs beside the optimizer."""

import ctypes
import glob
import os
import threading

import pytest
import torch

from mt_ray.cluster.shard_state import SUM_THREADS, split_threads


def test_a_shard_that_sums_splits_its_cores_between_two_disjoint_teams():
    assert split_threads(31, sums=True) == (31 - 7, 7)
    assert split_threads(63, sums=True) == (63 - SUM_THREADS, SUM_THREADS)
    assert sum(split_threads(15, sums=True)) == 15


def test_a_shard_that_never_sums_or_has_few_cores_keeps_one_count():
    assert split_threads(31, sums=False) == (31, 31)
    assert split_threads(3, sums=True) == (3, 3)


def _openmp():
    """torch's own OpenMP runtime: its per-thread count (torch.get_num_threads reports the process-wide one)."""
    found = glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*"))
    if not found:
        pytest.skip("this torch build ships no libgomp")
    return ctypes.CDLL(found[0])


def test_a_thread_keeps_the_count_it_set_after_another_thread_sets_the_process_count():
    """What the shard relies on: OpenMP's team size is per thread once a thread has set it."""
    omp, before = _openmp(), torch.get_num_threads()
    seen, ready, go = [], threading.Event(), threading.Event()

    def reduce_thread() -> None:
        torch.set_num_threads(1)
        ready.set()
        go.wait(10)
        seen.append(omp.omp_get_max_threads())

    t = threading.Thread(target=reduce_thread)
    t.start()
    ready.wait(10)
    torch.set_num_threads(2)
    go.set()
    t.join(10)
    main = omp.omp_get_max_threads()
    torch.set_num_threads(before)
    assert seen == [1] and main == 2
