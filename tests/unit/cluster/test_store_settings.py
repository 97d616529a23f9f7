"""A Ray the driver starts frees deleted objects at once, not in Ray's default one-second batches,
and keeps no idle worker per CPU.

A data-parallel step's object-store traffic is sized for the objects alive at once; objects kept
for up to a second after their last reference went would spill the store (store_settings.py).
"""

import logging
import logging.handlers
import re
import time

import numpy as np
import psutil
import pytest

from mt_ray.cluster import ClusterConfig

ray = pytest.importorskip("ray")


def _store_mib() -> int:
    from ray._private.internal_api import memory_summary

    summary = memory_summary(address=ray.get_runtime_context().gcs_address, stats_only=True)
    found = re.search(r"Plasma memory usage (\d+) MiB", summary)
    return int(found.group(1)) if found else 0


def _seconds_to_free() -> float:
    ref = ray.put(np.ones(8 << 20, dtype=np.uint8))  # 8 MiB: in the store, not inlined
    assert _store_mib() >= 8
    del ref
    t0 = time.monotonic()
    while _store_mib() > 0 and time.monotonic() - t0 < 5:
        time.sleep(0.01)
    return time.monotonic() - t0


def test_the_driver_starts_ray_that_frees_deleted_objects_at_once(monkeypatch):
    """...and, as a run quiets the libraries, without Ray's WARNING that it turned its default token authentication
    on, before the run's banner."""
    from mt_ray.cluster.placement import init_ray
    from mt_ray.verbosity import VERBOSE_ENV, quiet_libraries

    if ray.is_initialized():
        ray.shutdown()
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    quiet_libraries()
    notices = logging.getLogger("ray._private.authentication.authentication_token_setup")
    heard = logging.handlers.BufferingHandler(100)  # what the logger lets through to Ray's console handler
    notices.addHandler(heard)
    try:
        assert init_ray(ClusterConfig(num_cpus=1), 100 << 20)
    finally:
        notices.removeHandler(heard)
    assert [r.getMessage() for r in heard.buffer] == []
    try:
        # Ray's default frees once a second: five frees all under half a second is a 1-in-32 chance.
        waits = [_seconds_to_free() for _ in range(5)]
    finally:
        ray.shutdown()
    assert max(waits) < 0.5, waits


def _idle_workers() -> int:
    """Idle Python workers of the Ray this process started (each names its process `ray::IDLE`): its raylet's
    children, so another test process's Ray on the machine does not count."""
    mine = psutil.Process().children(recursive=True)
    return sum(1 for p in mine if p.is_running() and (p.cmdline() or [""])[0].startswith("ray::IDLE"))


def test_the_driver_starts_ray_without_an_idle_worker_per_cpu():
    from mt_ray.cluster.placement import init_ray

    if ray.is_initialized():
        ray.shutdown()
    assert init_ray(ClusterConfig(num_cpus=4), 100 << 20)
    try:
        time.sleep(2.0)  # Ray's default starts an idle worker per CPU (at most the cores) as the driver connects
        assert _idle_workers() == 0
    finally:
        ray.shutdown()
