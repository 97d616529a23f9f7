"""The README's `ray job submit` flow, as printed, against a real `ray start --head`.

The README block runs line by line in bash, each line verbatim (its `export` lines before each)
but two: `ray start --head` gets flags that keep this head apart from any other on the machine
(free ports, its own temp dir, 2 CPUs) and `--block` in a process group of its own, and `ray stop`,
which stops every Ray on the machine (other test processes' too), is done by ending that group,
which stops this cluster alone. HOME is a fresh folder, as for a new user: the README's lines
write the auth token there, and `ray start` and `ray job submit` read it. The job runs in a copy
of the repository, so the README's `$PWD/runs` is a scratch folder; once the cluster is stopped,
the run's model, checkpoints, summary and MLflow run must be there, and nothing of it in Ray's
package folder.
"""

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.integration.cluster.conftest import end_group, free_port

pytest.importorskip("ray")


def readme_block() -> list[str]:
    """The commands of the README's bash block that starts a head and submits `jobs.train` to it."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    [block] = [b for b in blocks if "ray start --head" in b and "ray job submit" in b]
    return [line.split(" #")[0].strip() for line in block.splitlines() if line.strip()]


def repository_copy(dest: Path) -> Path:
    """The files git would ship (tracked, and new ones not ignored): what `--working-dir .` uploads."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        if (ROOT / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dest / rel)
    return dest


class Shell:
    """Runs README lines in bash after its `export` lines, with a fresh HOME and no Ray address or token."""

    def __init__(self, home: Path, cwd: Path, export: str):
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH"))}
        self.env["HOME"] = str(home)
        self.cwd = cwd
        self.export = export

    def __call__(self, line: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", f"{self.export}\n{line}"], cwd=self.cwd, env={**self.env, **env},
                              capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def head(tmp_path):
    """The README's lines up to `ray start --head` (that one on free ports); the cluster ends whatever happens."""
    lines = readme_block()
    assert "ray start --head" in lines and "ray stop" in lines, lines
    setup = lines[:lines.index("ray start --head")]
    exports = "\n".join(line for line in setup if line.startswith("export "))
    assert "export RAY_AUTH_MODE=token" in exports
    home = tmp_path / "home"
    home.mkdir()
    shell = Shell(home, repository_copy(tmp_path / "repo"), exports)
    for line in setup:
        if not line.startswith("export "):
            done = shell(line)
            assert done.returncode == 0, f"{line}: {done.stderr}"
    assert (home / ".ray" / "auth_token").is_file()  # the fresh user's token, made by the README's lines

    dashboard = free_port()
    temp = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))  # short: Ray's unix socket paths must fit 107 bytes
    ports = " ".join(f"--{flag}={free_port()}" for flag in (
        "port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "runtime-env-agent-port",
        "metrics-export-port", "ray-client-server-port"))
    flags = (f"{ports} --dashboard-port={dashboard} --dashboard-host=127.0.0.1 --include-dashboard=true "
             f"--num-cpus=2 --object-store-memory=200000000 --temp-dir={temp} --block")
    with (temp / "head.log").open("wb") as log:  # the head writes to its own copy of the descriptor
        started = subprocess.Popen(["bash", "-c", f"{exports}\nexec ray start --head {flags}"], cwd=shell.cwd,
                                   env=shell.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        address = f"http://127.0.0.1:{dashboard}"
        wait_for_job_agent(shell, address, started, temp / "head.log")
        yield shell, address, temp, lambda: end_group(started)
    finally:
        end_group(started)
        shutil.rmtree(temp, ignore_errors=True)


def wait_for_job_agent(shell: Shell, address: str, started: subprocess.Popen, log: Path,
                       timeout_s: float = 120) -> None:
    """A head accepts jobs once its agent registers, a few seconds after it is up."""
    deadline = time.monotonic() + timeout_s
    while True:
        if started.poll() is not None:
            pytest.fail(f"ray start --head exited with {started.returncode}:\n{log.read_text()[-3000:]}")
        probe = shell("ray job submit --no-wait -- true", RAY_ADDRESS=address)
        if probe.returncode == 0 or time.monotonic() > deadline:
            assert probe.returncode == 0, probe.stdout + probe.stderr
            return
        time.sleep(2)


def test_the_readme_job_submit_line_trains_into_the_configured_storage(head):
    shell, address, ray_temp, stop = head
    [submit] = [line for line in readme_block() if line.startswith("ray job submit")]
    job = shell(submit, timeout=540, RAY_ADDRESS=address)  # verbatim; RAY_ADDRESS picks this test's head
    assert job.returncode == 0 and "succeeded" in job.stdout, (job.stdout + job.stderr)[-4000:]
    assert "done: 60 steps" in job.stdout
    stop()  # the README's `ray stop`, for this cluster alone

    runs = shell.cwd / "runs"
    [record] = runs.glob("*/run.json")
    run = record.parent
    assert json.loads(record.read_text())["name"] == run.name
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 60 and summary["exported_model"] == str(run / "hf_model")
    assert (run / "hf_model" / "model.safetensors").is_file()
    assert (run / "checkpoints" / "step-00000060" / "manifest.json").is_file()
    assert (runs / "mlflow.db").is_file() and summary["mlflow_model"].startswith("models:/")
    package = list(ray_temp.glob("session_*/runtime_resources/working_dir_files/*"))
    assert package and not [p for d in package for p in d.rglob("*") if p.name in ("runs", "mlflow.db", "mlruns")]
