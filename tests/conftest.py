"""Fixtures shared across test folders."""

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def local_ray():
    """A small in-process Ray (2 CPUs, 200 MB object store), started once per test module.

    Its workers import this checkout's mt_ray (PYTHONPATH), whatever copy is installed.
    """
    ray = pytest.importorskip("ray")
    # Through the environment rather than a runtime_env, so Ray's prestarted workers qualify and
    # import the engine in the background (preload) while a test does its own work.
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), old) if p)
    ray.init(address="local", num_cpus=2, object_store_memory=200 << 20, include_dashboard=False,
             log_to_driver=False, _system_config={"preload_python_modules": ["mt_ray.cluster.worker"]})
    yield ray
    ray.shutdown()
    if old is None:
        os.environ.pop("PYTHONPATH")
    else:
        os.environ["PYTHONPATH"] = old
