"""Local servers for the tracking integration tests: started on 127.0.0.1, free port, stopped after."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, timeout_s: float, log: Path) -> None:
    """Poll ``url`` until it answers 200, the process dies, or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.2)
    raise RuntimeError(f"server at {url} not up after {timeout_s} s: {log.read_text()[-2000:]}")


@contextlib.contextmanager
def running(cmd: list[str], health_url: str, log: Path, env: dict | None = None,
            timeout_s: float = 60) -> Iterator[subprocess.Popen]:
    """Run ``cmd`` until the block ends; the server is terminated (then killed) afterwards."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                start_new_session=True)
    try:
        wait_http(health_url, proc, timeout_s, log)
        yield proc
    finally:
        stop(proc)


def stop(proc: subprocess.Popen) -> None:
    """Stop the server and its workers: its own process group (``start_new_session``), TERM then KILL."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def moto_server(tmp_dir: Path, **env: str) -> Iterator[str]:
    """A ``moto_server`` (in-memory S3) subprocess; yields its endpoint URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with running(["moto_server", "-H", "127.0.0.1", "-p", str(port)], f"{url}/moto-api/data.json",
                 tmp_dir / f"moto-{port}.log", env=env, timeout_s=30):
        yield url
