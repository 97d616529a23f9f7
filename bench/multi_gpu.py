"""Data-parallel speed and host memory beside the single engine, at the same rows per GPU.

One process runs, in turn and each on a fresh Ray:
- `single-engine`: a `StreamingEngine` on one GPU, no Ray;
- `data-parallel` on each GPU count of `--gpus`: one engine worker per GPU, one coordinator shard;
- `sharded` (with `--sharded`): two Ray nodes on this host, one GPU each, `cluster.num_nodes=2`, so
  the fp32 state is split over two shards and gradients and weights cross between the nodes. On a
  one-GPU host both nodes share it (`sharded-1gpu`): a plumbing check, its time is not a speed; both
  nodes' state then lives on this one host, so `--sharded-layers` may cut the model's layers for it
  (its own single-engine row of that shape, `single-engine-cut`, gives the losses it must equal).

Each row: step time after warm-up, model TFLOPS per GPU (6 x params x tokens / step / GPUs), the
node's host bytes per parameter (peak growth of MemTotal - MemAvailable from before the run, all
processes, the shared-memory arenas and the object store included; for two nodes on one host, the
host's growth over the two), `mt-ray calc`'s prediction of it, the bytes Ray spilled to disk (its
own spill statistics), every step's loss, and the time split summed over the timed steps: workers
waiting for weights (the engine's thread idle), the shards' Adam, their gradient sums, and their
casts and puts of updated units for other nodes.

    python bench/multi_gpu.py --shape qwen2.5-7b --gpus 1,2 --rows-per-gpu 128 --kernels liger --sharded \
        --out bench/results/multi_gpu_h200x2.json
    python bench/multi_gpu.py --shape tiny --gpus 1,2 --rows-per-gpu 8 --micro 4 --steps 2   # plumbing check

`--grad-reduce host,nccl` measures each several-GPU count with both `cluster.grad_reduce` modes.

`--store-gb` overrides the object store each node gets (default: the calculator's figure), and
`--clip 0` turns gradient clipping off, to tell the store's headroom and the clip's barrier apart.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import OPT as CLIPPED
from bench.common import print_table, random_micro_batches, shape_config, write_json  # noqa: E402
from mt_ray.cluster import ClusterConfig, DataParallelTrainer  # noqa: E402
from mt_ray.cluster.node_memory import NodeMemoryPeak, node_used_bytes  # noqa: E402
from mt_ray.cluster.placement import MIN_STORE  # noqa: E402
from mt_ray.cluster.sizing import size_cluster  # noqa: E402
from mt_ray.cluster.store_settings import SYSTEM_CONFIG  # noqa: E402
from mt_ray.engine import EngineConfig, OptimizerConfig, StreamingEngine  # noqa: E402
from mt_ray.models.discovery import discover  # noqa: E402
from mt_ray.models.weights import init_random  # noqa: E402

COLUMNS = ["system", "gpus", "grad_reduce", "rows_per_gpu", "step_s", "model_tflops_per_gpu", "node_host_bytes_per_param",
           "calc_node_host_bytes_per_param", "spilled_bytes", "weight_wait_s", "adam_s", "sum_s", "publish_s"]


def optimizer(args) -> OptimizerConfig:
    return CLIPPED.model_copy(update={"max_grad_norm": args.clip})


def engine_config(args) -> EngineConfig:
    # Full recompute: the rows compare the cluster with the single engine, and two engines may share one GPU.
    return EngineConfig(device="cuda", compute_dtype="bf16", checkpoint_every=args.k, grad_dtype=args.grad_dtype,
                        keep_activations=0,
                        stream_master=args.stream_master, kernels=args.kernels, optimizer_threads=args.optimizer_threads)


def batches(args, cfg, gpus: int) -> list:
    rows = args.rows_per_gpu * gpus
    return [random_micro_batches(cfg.vocab_size, rows, args.micro, args.seq, seed=s)
            for s in range(args.warmup + args.steps)]


SETTLE_S = 60.0  # how long a row waits for the previous row's memory to be given back
SETTLE_SLACK = 1 << 30
_START: list[int] = []  # the node's used memory before the first row


def row_memory() -> tuple[NodeMemoryPeak, int]:
    """The node's memory sampler for one row, started once the previous row's memory is back (Ray's processes,
    arenas and object store give their pages back after shutdown returns), within SETTLE_S, and what the earlier
    rows still hold then (reported with the row). Its growth counts from the bench's start, never from a baseline an
    earlier row's leftovers still raise: the nccl row, run after the host row, read 4.86 B/param that way, below the
    fp32 state it holds."""
    if not _START:
        _START.append(node_used_bytes())
    deadline = time.monotonic() + SETTLE_S
    while node_used_bytes() > _START[0] + SETTLE_SLACK and time.monotonic() < deadline:
        time.sleep(1.0)
    now = node_used_bytes()
    return NodeMemoryPeak(baseline=min(now, _START[0])), now - _START[0]


def row(args, cfg, system: str, gpus: int, step_s: float, growth: int, calc: float, losses: list[float],
        split: dict, spilled: int | None = None, rows: int | None = None) -> dict:
    """`rows`: a step's rows, where not `rows_per_gpu` on each of `gpus`."""
    n = discover(cfg).num_params
    tokens = (rows or args.rows_per_gpu * gpus) * args.seq
    return {"system": system, "gpus": gpus, "rows_per_gpu": args.rows_per_gpu, "params": n, "step_s": step_s,
            "model_tflops_per_gpu": 6 * n * tokens / step_s / gpus / 1e12,
            "node_host_bytes_per_param": growth / n, "calc_node_host_bytes_per_param": calc,
            "spilled_bytes": spilled, "losses": losses, **split}


def run_single(args, cfg, system: str = "single-engine", init: str = "cuda", batch_of: int = 1) -> dict:
    """The single engine on one GPU, no Ray: the speed each data-parallel GPU should match. `init` cpu and
    `batch_of` N: its weights initialised on the CPU, as the cluster's shards do, and the global batch of N
    GPUs, so an N-GPU cluster row's losses compare with its."""
    memory, leftover = row_memory()
    engine = StreamingEngine(discover(cfg), engine_config(args), optimizer(args), total_steps=args.warmup + args.steps)
    try:
        init_random(engine.spec, engine.store.load_named, 0, init)
        times, losses = [], []
        for b in batches(args, cfg, batch_of):
            t0 = time.perf_counter()
            losses.append(engine.train_step(b).loss.item())  # the step's device work is done
            times.append(time.perf_counter() - t0)
        engine.synchronize()
        adam = engine.worker.busy_seconds
    finally:
        engine.close()
        del engine
        gc.collect()
        torch.cuda.empty_cache()  # the GPU's memory back for the next row's workers, which share it
        # ...and the pinned host pages torch caches, which the next row's growth would count (torch 2.13 names it)
        (getattr(torch.accelerator, "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", lambda: None))()
    memory.close()
    return row(args, cfg, system, 1, sum(times[args.warmup:]) / args.steps, memory.growth, float("nan"), losses,
               {"grad_reduce": None, "weight_wait_s": None, "adam_s": adam, "sum_s": None, "publish_s": None,
                "leftover_host_gib": leftover / 2**30},
               rows=args.rows_per_gpu * batch_of)


def run_cluster(args, cfg, system: str, gpus: int, nodes: int, reduce: str = "host") -> dict:
    """`gpus` workers over `nodes` Ray nodes of this host, each on its own fresh Ray; `reduce` is
    `cluster.grad_reduce` (nccl: a node's GPUs sum each gradient between them)."""

    memory, leftover = row_memory()  # before Ray: its processes, the arenas and the object store count too
    spec = discover(cfg)
    sizing = size_cluster(spec, engine_config(args), optimizer(args), gpus, nodes, reduce)
    store = int(args.store_gb * 2**30) if args.store_gb else max(sizing.object_store_bytes, MIN_STORE)
    shutdown = start_ray(nodes, gpus, store, args.cpus_per_worker)
    cluster = ClusterConfig(gpus_per_worker=1, cpus_per_worker=args.cpus_per_worker, num_nodes=nodes,
                            grad_reduce=reduce)
    try:
        trainer = DataParallelTrainer(cfg, engine_config(args), optimizer(args), gpus,
                                      total_steps=args.warmup + args.steps, cluster=cluster, weights=0)
        try:
            data = batches(args, cfg, gpus)
            losses = [float(trainer.train_step(b).loss) for b in data[:args.warmup]]
            trainer.synchronize()
            before = split_seconds(trainer)
            result = trainer.train(data[args.warmup:])
            after = split_seconds(trainer)
            processes = process_split(trainer)
        finally:
            trainer.close()
        spilled = spilled_bytes()
    finally:
        shutdown()
    memory.close()
    split = {**{k: after[k] - before[k] for k in after}, **processes, "leftover_host_gib": leftover / 2**30}
    # Every node of the run is on this host: its growth is all nodes', so the calculator's figure counts each.
    calc = sizing.node_host_bytes_per_param * nodes
    return row(args, cfg, system, gpus, sum(result.step_seconds) / args.steps, memory.growth, calc,
               losses + result.losses, {"grad_reduce": reduce, **split}, spilled)


def process_split(trainer: DataParallelTrainer) -> dict:
    """Each process's own memory (private pages, beside the arena it maps): what a worker and a shard cost;
    and the node's census, to account for the whole growth."""
    import ray

    workers = ray.get([w.host_bytes.remote() for w in trainer.workers])
    shards = ray.get([s.host_bytes.remote() for s in trainer.shards])
    return {"worker_uss_bytes": max(w["uss"] for w in workers), "shard_uss_bytes": max(s["uss"] for s in shards),
            "census_gib": node_census()}


def node_census() -> dict[str, float]:
    """GiB of private memory (USS) of every process on this host, summed by process title (Ray names its actors
    `ray::<class>`), beside the host's shared memory (Shmem: the arenas and the object store)."""
    import psutil

    census: dict[str, int] = {}
    for proc in psutil.process_iter(["cmdline", "name"]):
        try:
            title = ((proc.info["cmdline"] or [proc.info["name"]])[0] or proc.info["name"]).split("/")[-1][:40]
            uss = proc.memory_full_info().uss
        except (psutil.Error, IndexError):
            continue
        if uss > 16 << 20:
            census[title] = census.get(title, 0) + uss
    with open("/proc/meminfo") as f:
        census["Shmem (arenas, object store)"] = next(int(line.split()[1]) << 10 for line in f if line.startswith("Shmem:"))
    return {k: round(v / 2**30, 3) for k, v in sorted(census.items(), key=lambda kv: -kv[1])}


def spilled_bytes() -> int:
    """What Ray has spilled from the object stores to disk so far, from its own statistics (every node)."""
    import ray
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    reply = get_memory_info_reply(get_state_from_address(ray.get_runtime_context().gcs_address))
    return int(reply.store_stats.spilled_bytes_total)


def split_seconds(trainer: DataParallelTrainer) -> dict:
    import ray

    shards = ray.get([s.busy_seconds.remote() for s in trainer.shards])
    waits = ray.get([w.weight_wait_seconds.remote() for w in trainer.workers])
    return {"weight_wait_s": max(waits), "adam_s": max(s["adam"] for s in shards),
            "sum_s": max(s["sum"] for s in shards), "publish_s": max(s["publish"] for s in shards)}


def start_ray(nodes: int, gpus: int, store_bytes: int, cpus_per_worker: float):
    """A Ray of this process's own (never one left running on this machine): one node with every GPU, or
    `nodes` nodes on this host splitting the GPUs, each with the CPUs its workers' bundle asks for (and one
    for the driver's and shard's calls). Returns its shutdown."""
    import math

    import ray

    per = gpus // nodes
    cpus = math.ceil(cpus_per_worker * per) + 1
    if nodes == 1:
        ray.init(address="local", num_cpus=max(cpus, os.cpu_count() or 1), object_store_memory=store_bytes,
                 include_dashboard=False, _system_config=SYSTEM_CONFIG)
        return ray.shutdown
    from ray.cluster_utils import Cluster

    available = torch.cuda.device_count()
    devices = [",".join(str(g % available) for g in range(n * per, (n + 1) * per)) for n in range(nodes)]
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": cpus, "num_gpus": per, "object_store_memory": store_bytes, "include_dashboard": False,
        "_system_config": SYSTEM_CONFIG, "env_vars": {"CUDA_VISIBLE_DEVICES": devices[0]}})
    for d in devices[1:]:
        cluster.add_node(num_cpus=cpus, num_gpus=per, object_store_memory=store_bytes,
                         env_vars={"CUDA_VISIBLE_DEVICES": d})
    ray.init(address=cluster.address)

    def shutdown() -> None:
        ray.shutdown()
        cluster.shutdown()

    return shutdown


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen2.5-7b")
    p.add_argument("--gpus", default="1,2", help="comma-separated data-parallel GPU counts (0: none)")
    p.add_argument("--sharded", action="store_true", help="also 2 Ray nodes x 1 GPU with the state sharded")
    p.add_argument("--sharded-layers", type=int, default=None,
                   help="layers of the model for the sharded row on a one-GPU host (both nodes' state on one host)")
    p.add_argument("--no-single", action="store_true", help="skip the single-engine row")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--rows-per-gpu", type=int, default=128)
    p.add_argument("--micro", type=int, default=16, help="rows per micro-batch")
    p.add_argument("--k", type=int, default=4, help="checkpoint every K layers")
    p.add_argument("--kernels", default="liger", choices=["torch", "liger"])
    p.add_argument("--grad-dtype", default="compute", choices=["fp32", "compute"])
    p.add_argument("--stream-master", action="store_true")
    p.add_argument("--optimizer-threads", type=int, default=None)
    p.add_argument("--clip", type=float, default=CLIPPED.max_grad_norm, help="max grad norm (0: no clipping)")
    p.add_argument("--store-gb", type=float, default=None, help="object store per node (default: calculated)")
    p.add_argument("--grad-reduce", default="host", help="comma-separated cluster.grad_reduce modes (host, nccl) "
                   "for each count of several GPUs")
    p.add_argument("--cpus-per-worker", type=float, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default="bench/results/multi_gpu.json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/multi_gpu.py needs CUDA GPUs")
    cfg = shape_config(args.shape)
    available = torch.cuda.device_count()
    runs = [] if args.no_single else [lambda: run_single(args, cfg)]
    runs += [lambda n=n, r=r: run_cluster(args, cfg, "data-parallel" + ("" if r == "host" else f"-{r}"), n, 1, r)
             for n in (int(g) for g in args.gpus.split(",")) if 0 < n <= available
             for r in args.grad_reduce.split(",") if n > 1 or r == "host"]
    if args.sharded and available >= 2:
        runs.append(lambda: run_cluster(args, cfg, "sharded", 2, 2))
    elif args.sharded:
        cut = shape_config(args.shape)
        if args.sharded_layers:
            cut.num_hidden_layers = args.sharded_layers
            if isinstance(getattr(cut, "layer_types", None), list):
                cut.layer_types = cut.layer_types[: args.sharded_layers]
            runs.append(lambda: run_single(args, cut, "single-engine-cut", init="cpu", batch_of=2))
        runs.append(lambda: run_cluster(args, cut, "sharded-1gpu", 2, 2))
    payload: dict = {"shape": args.shape, "args": vars(args), "rows": []}
    for run in runs:  # each row is written as it lands: a run cut short keeps what it measured
        payload["rows"].append(run())
        print_table(payload["rows"], COLUMNS)
        write_json(args.out, payload)


if __name__ == "__main__":
    main()
