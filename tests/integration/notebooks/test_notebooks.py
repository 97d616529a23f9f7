"""The notebooks: stored without outputs, and each runs top to bottom on CPU (tiny models) leaving nothing behind."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import nbformat
import pytest

from notebooks.execute import NOTEBOOKS, run_notebook

ROOT = NOTEBOOKS.parent
PATHS = sorted(NOTEBOOKS.glob("*.ipynb"))


def test_the_three_notebooks_are_there():
    assert [p.name for p in PATHS] == ["01_quickstart.ipynb", "02_runs_and_sweeps.ipynb", "03_sizing.ipynb"]


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.stem)
def test_stored_notebook_is_valid_and_has_no_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.outputs == [] and c.execution_count is None for c in code)
    assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# ")  # a title first
    assert nb.metadata.kernelspec.name == "python3"


def checkout_changes() -> str:
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT,
                          capture_output=True, text=True, check=True).stdout


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom_and_leaves_nothing(path):
    # The notebook's temp folder is this test's own (its kernel's TMPDIR): two test processes running the same
    # notebook at once (three fresh clones did) each saw the other's scratch folders in the shared one.
    tmp_root, before = Path(tempfile.mkdtemp(prefix="mtnb-")), checkout_changes()
    try:
        nb = run_notebook(path, tmp_root=tmp_root)  # a failing cell raises CellExecutionError with its traceback
        outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
        assert not [o for o in outputs if o.output_type == "error"]
        assert any("image/png" in o.get("data", {}) for o in outputs), "every notebook draws at least one plot"
        assert checkout_changes() == before and not list(tmp_root.glob("mt-ray-notebook-*"))
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)
