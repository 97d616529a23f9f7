"""Checkpoint write/read throughput: a model-shaped state to local disk and to a local moto S3 server.

The state is three flat fp32 tensors (master, exp_avg, exp_avg_sq), as the engine holds them:
``--numel 1e9`` is a 1B-parameter model (12 GB). Reads go into the same buffers (``out=``), as a
resume does, after the written files are dropped from the page cache so they come from disk.
moto keeps objects in its own process's memory, so the S3 state is smaller (``--s3-numel``) and
its numbers measure moto plus the client, not a real object store.

    python bench/checkpoint_io.py --numel 1e9 --s3-numel 2.5e8 --json runs/bench/checkpoint_io.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mt_ray.tracking.checkpoint import CheckpointConfig, CheckpointManager  # noqa: E402
from mt_ray.tracking.ckpt_s3 import build_s3_client  # noqa: E402

NAMES = ("master", "exp_avg", "exp_avg_sq")


def make_state(numel: int) -> dict[str, torch.Tensor]:
    return {name: torch.empty(numel).uniform_() for name in NAMES}


def drop_page_cache(folder: Path) -> None:
    """Evict the just-written (fsynced, so clean) files from the page cache: the read then hits the disk."""
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def measure(ckpt: CheckpointManager, tensors: dict[str, torch.Tensor], before_load=None) -> dict:
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    start = time.perf_counter()
    uri = ckpt.save(1, tensors, {"step": 1})
    save_s = time.perf_counter() - start
    if before_load is not None:
        before_load(uri)
    start = time.perf_counter()
    ckpt.load(uri, out=tensors)  # verifies every SHA-256 while reading
    load_s = time.perf_counter() - start
    return {"gb": nbytes / 1e9, "save_s": save_s, "save_gb_s": nbytes / 1e9 / save_s,
            "load_s": load_s, "load_gb_s": nbytes / 1e9 / load_s}


def bench_local(numel: int, folder: Path, workers: int) -> dict:
    shutil.rmtree(folder, ignore_errors=True)
    tensors = make_state(numel)
    ckpt = CheckpointManager(CheckpointConfig(uri=str(folder), io_workers=workers))
    try:
        return measure(ckpt, tensors, before_load=lambda uri: drop_page_cache(Path(uri)))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def bench_s3(numel: int, workers: int, log: Path) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    with open(log, "wb") as out:
        server = subprocess.Popen(["moto_server", "-H", "127.0.0.1", "-p", str(port)], stdout=out,
                                  stderr=subprocess.STDOUT)
    try:
        wait_up(f"{endpoint}/moto-api/data.json", timeout_s=30)
        config = CheckpointConfig(uri=f"s3://bench-{uuid.uuid4().hex[:8]}/run", endpoint_url=endpoint,
                                  region="us-east-1", io_workers=workers)
        build_s3_client(config).create_bucket(Bucket=config.uri.split("/")[2])
        return measure(CheckpointManager(config), make_state(numel))
    finally:
        server.terminate()
        server.wait(timeout=30)


def wait_up(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up in {timeout_s} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=float, default=1e9, help="elements per tensor, local disk (1e9 = 1B model)")
    p.add_argument("--s3-numel", type=float, default=2.5e8, help="elements per tensor, moto S3 (0 = skip)")
    p.add_argument("--dir", type=Path, default=Path("runs/bench/ckpt"), help="local checkpoint folder")
    p.add_argument("--workers", type=int, default=4, help="CheckpointConfig.io_workers")
    p.add_argument("--json", type=Path, default=Path("runs/bench/checkpoint_io.json"))
    args = p.parse_args()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    results = {"cpus": os.cpu_count(), "workers": args.workers,
               "local": bench_local(int(args.numel), args.dir, args.workers)}
    if args.s3_numel:
        results["s3_moto"] = bench_s3(int(args.s3_numel), args.workers, args.json.with_suffix(".moto.log"))
    print(f"{'backend':<8} {'GB':>6} {'save s':>8} {'save GB/s':>10} {'load s':>8} {'load GB/s':>10}")
    for name in ("local", "s3_moto"):
        if name in results:
            r = results[name]
            print(f"{name:<8} {r['gb']:>6.1f} {r['save_s']:>8.1f} {r['save_gb_s']:>10.2f} "
                  f"{r['load_s']:>8.1f} {r['load_gb_s']:>10.2f}")
    args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
