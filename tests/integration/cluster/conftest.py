"""A `ray start --head` cluster for the `ray job submit` tests, with the `ray` CLI bound to it."""

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RayHead:
    """A running head: `address` is its dashboard (the job server); `cli` runs `ray` with the head's token."""

    address: str
    auth: dict[str, str]

    def cli(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, **self.auth}
        cmd = [shutil.which("ray") or "ray", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, check=check)

    def submit(self, job_id: str, command: list[str], env_vars: dict[str, str], wait_s: float = 240) -> None:
        """`ray job submit --no-wait`, retried while the head's job agent is still starting (a busy machine)."""
        deadline = time.monotonic() + wait_s
        while True:
            done = self.cli("job", "submit", f"--address={self.address}", f"--submission-id={job_id}", "--no-wait",
                            f"--runtime-env-json={json.dumps({'env_vars': env_vars})}", "--", *command, check=False)
            if done.returncode == 0:
                return
            if "No available agent" not in done.stderr or time.monotonic() > deadline:
                pytest.fail(f"ray job submit failed:\n{done.stdout}\n{done.stderr[-3000:]}")
            time.sleep(2)

    def stop(self, job_id: str) -> None:
        """Stop the job through the job server's REST API, at once: the `ray job stop` CLI starts a Python process
        first, seconds on a loaded machine, in which a short job may finish."""
        headers = {"Authorization": f"Bearer {self.auth['RAY_AUTH_TOKEN']}"}
        request = urllib.request.Request(f"{self.address}/api/jobs/{job_id}/stop", method="POST", headers=headers)
        with urllib.request.urlopen(request, timeout=60) as response:
            assert json.load(response).get("stopped"), f"job {job_id} had already ended"
        deadline = time.monotonic() + 120  # as `ray job stop` does: return once the job has ended
        while time.monotonic() < deadline:
            with urllib.request.urlopen(urllib.request.Request(f"{self.address}/api/jobs/{job_id}", headers=headers),
                                        timeout=60) as response:
                if json.load(response)["status"] in ("STOPPED", "SUCCEEDED", "FAILED"):
                    return
            time.sleep(0.5)
        pytest.fail(f"job {job_id} did not end within 120 s of being stopped")

    def status(self, job_id: str) -> str:
        return self.cli("job", "status", f"--address={self.address}", job_id, check=False).stdout

    def logs(self, job_id: str, follow: bool = False, timeout: float = 120) -> str:
        """The job's output; with `follow`, once it ends (bounded by `timeout`)."""
        args = ["--follow"] if follow else []
        return self.cli("job", "logs", f"--address={self.address}", *args, job_id, timeout=timeout, check=False).stdout


@pytest.fixture
def ray_head():
    """A 2-CPU head with its dashboard, in a process group of its own that is ended after the test.

    `ray start --block` keeps the head and every process it starts in one group; ending the group
    stops exactly this cluster (`ray stop` would stop every Ray on the machine).
    """
    pytest.importorskip("ray")
    port, dash = free_port(), free_port()
    # The head and every client here share one token, so the tests do not depend on ~/.ray.
    head = RayHead(f"http://127.0.0.1:{dash}", {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)})
    temp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's unix socket paths must fit 107 bytes
    log = Path(temp) / "head.log"
    # Every port free, not Ray's fixed defaults: a second head on the machine (another test process's) would
    # otherwise hold the job agent's port, and every submission would answer "No available agent".
    ports = [f"--{flag}={free_port()}" for flag in ("dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                                                    "runtime-env-agent-port", "metrics-export-port",
                                                    "ray-client-server-port")]
    cmd = [shutil.which("ray") or "ray", "start", "--head", "--block", f"--port={port}", *ports, "--num-cpus=2",
           "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
           "--object-store-memory=200000000", f"--temp-dir={temp}"]
    with log.open("wb") as out:  # the head writes to its own copy of the descriptor
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, **head.auth})
    try:
        wait_for_dashboard(head.address, proc, log)
        yield head
    finally:
        end_group(proc)
        shutil.rmtree(temp, ignore_errors=True)


def wait_for_dashboard(address: str, proc: subprocess.Popen, log: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"ray start --head exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{address}/api/version", timeout=2):
                return
        except urllib.error.HTTPError:
            return  # it answers (without our token: 401)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.5)
    pytest.fail(f"the head's dashboard did not answer within {timeout_s:.0f} s:\n{log.read_text()[-3000:]}")


def end_group(proc: subprocess.Popen) -> None:
    """SIGKILL the head's process group: every process of this cluster, and no other (its orderly stop takes >20 s)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
