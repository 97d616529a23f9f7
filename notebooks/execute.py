"""Run notebooks top to bottom, each in a fresh kernel and a scratch working directory.

    python notebooks/execute.py                          # every notebooks/*.ipynb
    python notebooks/execute.py --out outputs/notebooks  # ... and keep the executed copies there

What `make notebooks` and the test suite do. The kernel imports this checkout's `mt_ray` and
`jobs` (and so do the Ray workers it starts), and its working directory is removed afterwards,
so a run leaves nothing behind. The notebooks stored in git keep no outputs; executed copies
with their plots go to `--out` only.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parent
ROOT = NOTEBOOKS.parent


def kernel_env() -> dict[str, str]:
    """This environment, with the checkout first on the path and matplotlib left to the kernel's inline backend."""
    env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def run_notebook(path: Path, timeout_s: int = 300, tmp_root: Path | None = None) -> nbformat.NotebookNode:
    """Execute `path` and return it with its outputs; a failing cell raises `nbclient.exceptions.CellExecutionError`.

    `tmp_root`: the temp folder of this run and its kernel (its TMPDIR), so that what a notebook leaves there is
    its own, whatever other processes on the machine do in theirs."""
    nb = nbformat.read(path, as_version=4)
    env = kernel_env() | ({"TMPDIR": str(tmp_root)} if tmp_root is not None else {})
    with tempfile.TemporaryDirectory(prefix="mt-ray-notebook-", dir=tmp_root) as workdir:
        client = NotebookClient(nb, timeout=timeout_s, kernel_name="python3",
                                resources={"metadata": {"path": workdir}})
        client.execute(env=env)
    return nb


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: every notebook in notebooks/")
    parser.add_argument("--out", type=Path, help="folder for the executed copies")
    args = parser.parse_args(argv)
    for path in args.notebooks or sorted(NOTEBOOKS.glob("*.ipynb")):
        print(f"running {path.name}", flush=True)
        nb = run_notebook(path)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            nbformat.write(nb, args.out / path.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
