PY ?= python3
PIP = $(PY) -m pip
IMAGE ?= mt-ray:0.1.0
# GPU=1 gives the compose stack's Ray worker the machine's GPUs (NVIDIA Container Toolkit needed).
COMPOSE = docker compose -p mt-ray -f infra/compose.yaml $(if $(GPU),-f infra/compose.gpu.yaml)

.PHONY: install demo test lint bench image cluster-up cluster-down notebooks

# torch first, pinned to the CPU build already on disk on CPU machines (no CUDA wheels);
# a machine that has torch installed (e.g. a CUDA build) keeps it.
install:
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev,tracking,cluster]" -c constraints.txt

demo:
	$(PY) -m jobs.train

# The suite mostly waits (Ray, subprocesses, servers): TEST_WORKERS processes share the cores, at most two
# of them on a module that starts Ray (tests/xdist_schedule.py). TEST_WORKERS=0 (the default, what CI runs) runs
# it in this process: with 4 workers on 2 cores two Ray clusters starting at once still clash (a dashboard port,
# a node start timing out), which CI must never see.
TEST_WORKERS ?= 0

test:
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup tests

lint:
	$(PY) -m ruff check mt_ray tests jobs bench notebooks

bench:
	$(PY) bench/engine_gpu.py

# The mt-ray image (CUDA + the package), as used by infra/compose.yaml, infra/ray and infra/k8s.
image:
	docker build -f infra/Dockerfile -t $(IMAGE) .

# Ray head + worker, MLflow (Postgres, MinIO artifacts) and MinIO on this machine; see infra/compose.yaml.
cluster-up:
	$(COMPOSE) up -d --build

cluster-down:
	$(COMPOSE) down

# Runs every notebook top to bottom in a scratch directory; executed copies go to outputs/notebooks/.
notebooks:
	$(PY) notebooks/execute.py --out outputs/notebooks
