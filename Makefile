PY ?= python3
PIP = $(PY) -m pip

.PHONY: install demo test lint bench

# torch first, pinned to the CPU build already on disk on CPU machines (no CUDA wheels);
# a machine that has torch installed (e.g. a CUDA build) keeps it.
install:
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev,tracking,cluster]" -c constraints.txt

demo:
	$(PY) -m jobs.train

test:
	$(PY) -m pytest -q tests

lint:
	$(PY) -m ruff check mt_ray tests jobs bench

bench:
	$(PY) bench/engine_gpu.py
