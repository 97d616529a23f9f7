"""Data-parallel scaling on one host: throughput on 1, 2, 4 GPUs, and object store -> GPU bandwidth.

Runs `mt_ray.cluster.DataParallelTrainer` (one engine worker per GPU, one coordinator holding the
fp32 master and Adam state) for each GPU count, with a fixed micro-batch budget per GPU (weak
scaling: the global batch grows with the GPU count). Reports tokens/s, model TFLOPS per GPU
(6 x params x tokens / step time) and scaling efficiency = throughput(N) / (N x throughput(1)).

The bandwidth part runs in a GPU actor: it maps a weights-sized object from the node's object
store (zero-copy) and times host->device copies from it as pageable memory, after
cudaHostRegister (and what registering costs), and from a torch-pinned buffer for reference.

Needs: CUDA GPUs, `pip install -e ".[cluster]"`, host RAM for the coordinator (about 18 B/param:
fp32 master + m + v, the bf16 published copy, fp32 summed gradients while clipping) plus the object
store (two bf16 weight versions + one gradient per GPU), i.e. ~250 GB for the 7B shape on 4 GPUs.

    python bench/multi_gpu.py --shape qwen2.5-7b --gpus 1,2,4 --out bench/results/multi_gpu.json
    python bench/multi_gpu.py --shape tiny --gpus 1,2 --steps 2      # quick check of the plumbing
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import OPT, print_table, random_micro_batches, shape_config, write_json  # noqa: E402
from mt_ray.cluster import ClusterConfig, DataParallelTrainer  # noqa: E402
from mt_ray.cluster.driver import plan_object_store_bytes  # noqa: E402
from mt_ray.engine import EngineConfig  # noqa: E402
from mt_ray.models.discovery import discover  # noqa: E402


def engine_config(args) -> EngineConfig:
    return EngineConfig(device="cuda", compute_dtype="bf16", checkpoint_every=args.k, grad_dtype=args.grad_dtype,
                        stream_master=False, optimizer_threads=args.optimizer_threads)


def run_scaling(args, cfg, n_gpus: int) -> dict:
    """Steps of the data-parallel trainer on `n_gpus` workers; times the steps after warm-up."""
    vocab = cfg.vocab_size
    steps = args.warmup + args.steps
    batches = [random_micro_batches(vocab, args.batch_per_gpu * n_gpus, args.micro, args.seq, seed=s)
               for s in range(steps)]
    cluster = ClusterConfig(gpus_per_worker=1, cpus_per_worker=args.cpus_per_worker, snapshot_every=0)
    trainer = DataParallelTrainer(cfg, engine_config(args), OPT, n_gpus, total_steps=steps, cluster=cluster, weights=0)
    try:
        result = trainer.train(batches)  # returns after the last update is in the master weights
    finally:
        trainer.close()
    times = result.step_seconds
    step_s = sum(times[args.warmup:]) / args.steps
    tokens = args.batch_per_gpu * n_gpus * args.seq
    n_params = discover(cfg).num_params
    return {"gpus": n_gpus, "step_s": step_s, "tokens_per_s": tokens / step_s,
            "tflops_per_gpu": 6 * n_params * tokens / step_s / n_gpus / 1e12}


def bandwidth_probe(nbytes: int, repeats: int) -> dict:
    """Runs inside a GPU actor: H2D GB/s from an object-store view, pageable vs registered vs pinned."""
    import ray

    from mt_ray.cluster.wire import from_numpy, to_numpy
    from mt_ray.cluster.worker import HostPins

    n = nbytes // 2
    ref = ray.put(to_numpy(torch.randn(n, dtype=torch.float32).to(torch.bfloat16)))
    host = from_numpy(ray.get(ref), torch.bfloat16)  # zero-copy view of shared memory
    dev = torch.empty(n, dtype=torch.bfloat16, device="cuda")

    def gbps(src: torch.Tensor, non_blocking: bool) -> float:
        dev.copy_(src, non_blocking=non_blocking)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(repeats):
            dev.copy_(src, non_blocking=non_blocking)
        torch.cuda.synchronize()
        return repeats * nbytes / (time.perf_counter() - t0) / 1e9

    out = {"bytes": nbytes, "pageable_gbps": gbps(host, False)}
    pins = HostPins(True)
    t0 = time.perf_counter()
    pins.swap("probe", host)
    out["register_s"] = time.perf_counter() - t0
    out["registered"] = "probe" in pins._held
    out["registered_gbps"] = gbps(host, True)
    pins.close()
    pinned = torch.empty(n, dtype=torch.bfloat16, pin_memory=True).copy_(host)
    out["torch_pinned_gbps"] = gbps(pinned, True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen2.5-7b")
    p.add_argument("--gpus", default="1,2,4", help="comma-separated GPU counts")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch-per-gpu", type=int, default=64, help="rows per GPU per step (weak scaling)")
    p.add_argument("--micro", type=int, default=16, help="rows per micro-batch")
    p.add_argument("--k", type=int, default=4, help="checkpoint every K layers")
    p.add_argument("--grad-dtype", default="compute", choices=["fp32", "compute"])
    p.add_argument("--optimizer-threads", type=int, default=None)
    p.add_argument("--cpus-per-worker", type=float, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--object-store-gb", type=float, default=None, help="default: planned from the model")
    p.add_argument("--bandwidth-gb", type=float, default=1.0, help="object size for the H2D probe (0: skip)")
    p.add_argument("--out", default="bench/results/multi_gpu.json")
    args = p.parse_args()

    import ray

    if not torch.cuda.is_available():
        sys.exit("bench/multi_gpu.py needs CUDA GPUs (it measures GPU throughput and H2D bandwidth)")
    counts = [int(g) for g in args.gpus.split(",")]
    available = torch.cuda.device_count()
    if max(counts) > available:
        print(f"only {available} GPUs here: skipping counts above it")
        counts = [c for c in counts if c <= available]
    cfg = shape_config(args.shape)
    store = args.object_store_gb * 2**30 if args.object_store_gb else plan_object_store_bytes(
        discover(cfg), engine_config(args), max(counts))
    ray.init(object_store_memory=int(store), include_dashboard=False)

    payload: dict = {"shape": args.shape, "args": vars(args), "object_store_bytes": int(store)}
    if args.bandwidth_gb > 0:
        probe = ray.remote(num_gpus=1)(bandwidth_probe)
        payload["bandwidth"] = ray.get(probe.remote(int(args.bandwidth_gb * 2**30), 10))
        print_table([payload["bandwidth"]], ["bytes", "pageable_gbps", "register_s", "registered",
                                             "registered_gbps", "torch_pinned_gbps"])
    payload["scaling"] = rows = []
    for n in counts:  # each row is written as it lands: a long run cut short keeps what it measured
        rows.append(run_scaling(args, cfg, n))
        base = next((r for r in rows if r["gpus"] == 1), None)
        for r in rows:
            r["scaling_efficiency"] = r["tokens_per_s"] / (r["gpus"] * base["tokens_per_s"]) if base else None
        print_table(rows, ["gpus", "step_s", "tokens_per_s", "tflops_per_gpu", "scaling_efficiency"])
        write_json(args.out, payload)
    ray.shutdown()


if __name__ == "__main__":
    main()
