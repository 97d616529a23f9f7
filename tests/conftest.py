"""Fixtures shared across test folders."""

import contextlib
import os
import sys
from pathlib import Path

import pytest

from mt_ray.cluster.store_settings import SYSTEM_CONFIG
from mt_ray.training.callbacks import Callback

ROOT = Path(__file__).resolve().parents[1]
# Every Ray a test starts (fixtures, jobs.train's own, `ray start` heads) inherits this: Ray's memory monitor
# kills workers once the *machine* is 95% used, so another process's memory failed tests (a fresh-clone run
# beside other suites on 24 GiB: 3 tests, each a worker killed at 22.4-23.0 GB used). The kernel's limit stays.
os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
# Prestarted Ray workers import the engine in the background while a test does its own work.
PRELOAD = {"preload_python_modules": ["mt_ray.cluster.worker"], **SYSTEM_CONFIG}


class RecordLogs(Callback):
    """Keeps every metrics dict the run logs, in order."""

    def __init__(self):
        self.logged: list[dict[str, float]] = []

    def on_log(self, trainer, step, metrics):
        self.logged.append(metrics)


def train_demo(config: str, tmp_path: Path, steps: int = 40) -> tuple[list[dict[str, float]], dict]:
    """A demo config's run on the CPU, logging every 2 steps into `tmp_path`, untracked: its logs and summary."""
    from mt_ray.config.run import load_run_config
    from mt_ray.training.launch import run

    cfg = load_run_config(config, [f"training.steps={steps}", "training.log_every=2", f"training.storage={tmp_path}",
                                   "engine.device=cpu", "tracking.enabled=false"])
    record = RecordLogs()
    summary = run(cfg, [record])
    return record.logged, summary


class StopAt(Callback):
    """Interrupts the run after `step`, as Ctrl-C (or a crash) would."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, trainer, step):
        if step == self.step:
            raise KeyboardInterrupt


@contextlib.contextmanager
def repo_on_worker_path():
    """Ray workers started meanwhile import this checkout's mt_ray (PYTHONPATH), whatever copy is installed.

    Through the environment rather than a runtime_env, so Ray's prestarted workers qualify.
    """
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), old) if p)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = old


@pytest.fixture(scope="module")
def local_ray():
    """A small in-process Ray (2 CPUs, 200 MB object store), started once per test module."""
    ray = pytest.importorskip("ray")
    with repo_on_worker_path():
        ray.init(address="local", num_cpus=2, object_store_memory=200 << 20, include_dashboard=False,
                 log_to_driver=False, _system_config=PRELOAD)
        yield ray
        ray.shutdown()


@pytest.fixture(scope="module")
def three_node_ray():
    """Three Ray nodes on this machine (2 CPUs and a 100 MB object store each), joined by this process."""
    with _ray_cluster(3) as ray:
        yield ray


@pytest.fixture(scope="module")
def two_node_ray():
    """Two Ray nodes on this machine (2 CPUs and a 100 MB object store each), joined by this process."""
    with _ray_cluster(2) as ray:
        yield ray


@contextlib.contextmanager
def _ray_cluster(nodes: int):
    """`nodes` Ray nodes on this machine, joined by this process.

    The raylets share the test machine's cores, so a busy machine can delay a heartbeat for long;
    the health check tolerates a few minutes of silence instead of declaring the node dead.
    """
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    patient = {**PRELOAD, "health_check_failure_threshold": 60, "health_check_timeout_ms": 30_000}
    with repo_on_worker_path():
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 2, "object_store_memory": 100 << 20, "include_dashboard": False, "_system_config": patient})
        for _ in range(nodes - 1):
            cluster.add_node(num_cpus=2, object_store_memory=100 << 20)
        ray.init(address=cluster.address, log_to_driver=False)
        try:
            yield ray
        finally:
            ray.shutdown()
            cluster.shutdown()


# Tests that start Ray, or run a long multi-process flow (`slow`): `make test` runs at most two such modules
# at a time beside the plain ones (tests/xdist_schedule.py).
HEAVY_FIXTURES = {"local_ray", "two_node_ray", "three_node_ray", "ray_head", "head"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which appends each test's group to its id
def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if HEAVY_FIXTURES & set(getattr(item, "fixturenames", ())) or item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.xdist_group(f"heavy:{item.nodeid.split('::', 1)[0]}"))


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") == "loadgroup":
        from tests.xdist_schedule import SuiteScheduling

        return SuiteScheduling(config, log)
    return None


def _family_sweep_lines() -> list[str]:
    """The family sweep's summary line per mapping, and each skip's reason (tests/unit/engine/test_family_sweep.py)."""
    sweep = sys.modules.get("tests.family_sweep")
    if sweep is None or not sweep.RESULTS:
        return []
    lines = []
    for mapping, outcomes in sweep.RESULTS.items():
        lines.append(f"{mapping} sweep: {sweep.summary_line(outcomes)}")
        lines += [f"  {o.status} {t}: {sweep.short_reason(o)}" for t, o in sorted(outcomes.items())
                  if o.status != "matched"]
    return lines


# Under pytest-xdist the sweep runs in a worker: its lines travel to the controller, which prints them.
_WORKER_LINES: list[str] = []


def pytest_sessionfinish(session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # this process is an xdist worker
        workeroutput["family_sweep"] = _family_sweep_lines()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    _WORKER_LINES.extend(getattr(node, "workeroutput", {}).get("family_sweep", []))


def pytest_terminal_summary(terminalreporter) -> None:
    for line in [*_family_sweep_lines(), *_WORKER_LINES]:
        terminalreporter.write_line(line)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads on a shared 2-core machine (a module opts in with
    `pytestmark = pytest.mark.usefixtures("one_thread")`)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
