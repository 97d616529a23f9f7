"""`mt-ray`: train, sweep, calc, export, info."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import replace

from mt_ray.cli.startup import run_quietly
from mt_ray.errors import ConfigError, MtRayError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mt-ray", description="Full-precision LLM training from host memory.")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a model (defaults: the built-in demo)")
    train.add_argument("--config", help="YAML run config (see jobs/configs/), or a LLaMA-Factory training YAML; the "
                       "file may also come first among the arguments: mt-ray train my.yaml")
    train.add_argument("--help-config", action="store_true", help="list every config key with its default")
    train.add_argument("overrides", nargs="*", help="[config.yaml] then section.key=value overrides, e.g. "
                       "training.steps=10")

    sweep = sub.add_parser("sweep", help="Ray Tune sweep of a run config, judged on held-out eval loss (ASHA)")
    from mt_ray.cli.sweep_command import add_sweep_arguments

    add_sweep_arguments(sweep)

    calc = sub.add_parser("calc", help="the fastest configuration that fits this GPU and host, as a config snippet")
    calc.add_argument("--config", help="YAML run config providing the model, engine and optimizer (or --preset/--path)")
    calc.add_argument("--preset", help="built-in model shape, e.g. qwen2.5-7b, qwen3-30b-a3b, gpt-oss-20b")
    calc.add_argument("--path", help="local Hugging Face model folder")
    calc.add_argument("--layers", type=int, help="cut the model to its first N layers (a large shape on a smaller host)")
    calc.add_argument("--gpu", help="plan for this card: rtx3080, rtx3090, rtx4080, rtx4090, rtx5090, a100-40gb, "
                      "a100-80gb, l40s, h100, h200, gh200 (its memory, layer TFLOPS and host link; each flag below "
                      "overrides its figure). Default: the local GPU's, else an H100's figures")
    calc.add_argument("--seq", type=int, help="sequence length (default: the config's data.max_seq_len, else 1024)")
    calc.add_argument("--global-batch", type=int, help="sequences per optimizer step (default: the config's "
                      "micro_batch_size x grad_accum_steps, else 128)")
    calc.add_argument("--gpu-mem-gb", type=float, help="GPU memory in GiB (default: --gpu's, else the local GPU's)")
    calc.add_argument("--host-mem-gb", type=float, help="host memory for training in GiB (default: what this host "
                      "has available: the cgroup limit, else MemAvailable)")
    calc.add_argument("--h2d-gbps", type=float, help="host<->GPU link bandwidth in GB/s, each direction (default: "
                      "--gpu's; 50 for the H100 host's PCIe 5.0, measured; about 25 for PCIe 4.0 x16)")
    calc.add_argument("--gpu-tflops", type=float, help="bf16 TFLOPS a decoder layer reaches on the GPU, as 8 x params "
                      "x tokens a streamed step (default: --gpu's; 600 measured on the H100 and H200)")
    calc.add_argument("--nvme-gbps", type=float, help="direct read and write GB/s of an NVMe disk for optimizer "
                      "state: lets the search move state there when the host cannot hold it")
    calc.add_argument("--nvme-mixed-gbps", type=float, help="with --nvme-gbps: GB/s read and written together "
                      "with both in flight at once (default: reads and writes share the drive one after the other)")
    calc.add_argument("--probe-disk", metavar="PATH", help="measure the direct read, write and mixed GB/s of the disk "
                      "under PATH (a 2 GiB scratch file) and plan optimizer state there as --nvme-gbps does")
    calc.add_argument("--image-tokens", type=int, default=0,
                      help="image-text models: image tokens per sample (part of --seq): the vision tower's share")
    calc.add_argument("--max-seq", action="store_true", help="the longest sequence that trains at --global-batch "
                      "(default here: 1) sequences a step, its configuration, and what runs out one step longer")
    calc.add_argument("--json", action="store_true", help="print JSON instead of a table")
    calc.add_argument("--workers", type=int, default=None,
                      help="data-parallel workers (GPUs), 1 included: adds the per-node figures of a Ray run")
    calc.add_argument("--nodes", type=int, default=1, help="nodes the workers and the fp32 state spread over")

    export = sub.add_parser("export", help="checkpoint -> Hugging Face folder")
    export.add_argument("--config", required=True, help="the run's YAML config (model section)")
    export.add_argument("--checkpoint", help="checkpoint URI (default: the run's latest)")
    export.add_argument("--out", required=True)
    export.add_argument("--fall-back", action="store_true", help="when the checkpoint fails its SHA-256 check, "
                        "export the newest earlier one that passes (default: refuse)")

    info = sub.add_parser("info", help="what the engine discovers about a model")
    info.add_argument("--preset", help="built-in model shape")
    info.add_argument("--path", help="local Hugging Face model folder")
    info.add_argument("--layers", type=int, help="cut the model to its first N layers")

    args = parser.parse_args(argv)
    command = f"mt-ray {args.command}"
    # The commands that train import for seconds before their first word.
    announce = args.command in ("train", "sweep") and not getattr(args, "help_config", False)
    return run_quietly(command, lambda: _run_command(command, args), announce)


def _run_command(command: str, args: argparse.Namespace) -> int:
    try:
        return _COMMANDS[args.command](args)
    except MtRayError as e:
        print(f"{command}: error: {e}", file=sys.stderr)
        return 2


def _train(args) -> int:
    from mt_ray.config.run import describe_config, load_run_config

    if args.help_config:
        print(describe_config())
        return 0
    from mt_ray.training.launch import run_from_command_line

    config, overrides = args.config, list(args.overrides)
    if overrides and "=" not in overrides[0]:  # `mt-ray train my.yaml key=value ...`
        if config is not None:
            raise ConfigError(f"give the config once: --config {config} or {overrides[0]}, not both")
        config = overrides.pop(0)
    command = shlex.join(["mt-ray", "train", *([config] if config else []), *overrides])
    return run_from_command_line(load_run_config(config, overrides), command)


def _sweep(args) -> int:
    from mt_ray.cli.sweep_command import report, sweep
    from mt_ray.verbosity import quiet_libraries

    quiet_libraries()
    print(report(sweep(args)))
    return 0


def _calc(args) -> int:
    from mt_ray.engine.calculator import config_snippet, longest_context, recommend, render_recommendation
    from mt_ray.engine.config import EngineConfig
    from mt_ray.engine.sizing import SFT
    from mt_ray.training.auto_fit import stage_shape

    for flag in ("seq", "global_batch", "gpu_mem_gb", "host_mem_gb", "h2d_gbps", "gpu_tflops", "nvme_gbps",
                 "nvme_mixed_gbps", "layers"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise ConfigError(f"--{flag.replace('_', '-')} must be positive, got {value}")
    run = _run_config(args)
    stage, run_seq = stage_shape(run) if run else (SFT, 1024)  # a preference stage's reference and head, GRPO's copy
    if args.seq is None:
        args.seq = run_seq
    if args.global_batch is None:
        args.global_batch = 1 if args.max_seq else (
            run.training.micro_batch_size * run.training.grad_accum_steps if run else 128)
    machine, gpu, host, assumed = _calc_machine(args)
    engine = EngineConfig(device="cpu", compute_dtype="bf16")
    if run:  # the config's engine, as it runs on a GPU (bf16 unless it names a dtype)
        dtype = "bf16" if run.engine.compute_dtype == "auto" else run.engine.compute_dtype
        engine = run.engine.model_copy(update={"device": "cpu", "compute_dtype": dtype})
    if args.probe_disk:
        engine = engine.model_copy(update={"nvme_path": args.probe_disk})
    spec = _spec(args, run)
    opt = run.optimizer if run else None
    if (args.workers or 1) > 1 and stage.rollout_tokens and not (run and run.cluster.rollout_gpus):
        # each worker updates its share beside a rollout replica in another process on its GPU
        args.global_batch = max(1, args.global_batch // args.workers)
        stage = replace(stage, rollout_rows=args.global_batch, rollout_apart=True)
    if args.max_seq:
        rec = longest_context(spec, gpu, host, args.global_batch, cfg=engine, opt=opt, machine=machine, stage=stage)
    else:
        rec = recommend(spec, args.seq, args.global_batch, gpu, host, cfg=engine, opt=opt, machine=machine,
                        image_tokens=args.image_tokens, stage=stage)
    model = run.model.model_dump(exclude_defaults=True) if run else {"path": args.path} if args.path else {
        "preset": args.preset or "tiny", **({"overrides": {"num_hidden_layers": args.layers}} if args.layers else {})}
    cluster = _cluster_sizing(spec, args, stage) if args.workers is not None or args.nodes > 1 else None
    if args.json:
        print(json.dumps({"assumptions": assumed, **rec, "config": config_snippet(rec, model) if rec["fits"] else None,
                          **({"cluster": cluster.as_dict()} if cluster else {})}, indent=2))
        return 0 if rec["fits"] else 1
    print("assumed: " + "; ".join(f"{k} {v}" for k, v in assumed.items()) + "\n")
    print(render_recommendation(rec, model))
    if cluster is not None:
        from mt_ray.cluster.sizing import render_cluster

        print(render_cluster(cluster))
    return 0 if rec["fits"] else 1


def _calc_machine(args):
    """The machine the calculation plans for: (step-time Machine, GPU GiB, host GiB, the assumptions in words), from
    --gpu's figures (else the local GPU's, else an H100's) with each flag given overriding its figure."""
    from mt_ray.engine.calculator import local_gpu_memory_gb
    from mt_ray.engine.gpus import GPUS, gpu, local_gpu
    from mt_ray.engine.host_store import GIB, available_host_bytes
    from mt_ray.engine.step_time import Machine

    card, where = (gpu(args.gpu), "--gpu") if args.gpu else (None, "")
    if card is None and args.gpu_mem_gb is None:
        memory = local_gpu_memory_gb()
        card, where = _local_card(memory, local_gpu), "this machine's GPU"
    if card is None:
        card, where = GPUS["h100"], "not given: an H100's figures (--gpu NAME for another card)"
    gpu_mem = args.gpu_mem_gb if args.gpu_mem_gb is not None else card.memory_gib
    host = args.host_mem_gb if args.host_mem_gb is not None else available_host_bytes() / GIB
    read, write, mixed = _disk_bandwidth(args)
    machine = Machine(layer_tflops=args.gpu_tflops or card.layer_tflops, h2d_gbps=args.h2d_gbps or card.h2d_gbps,
                      nvme_read_gbps=read, nvme_write_gbps=write, nvme_mixed_gbps=mixed)
    assumed = {
        "GPU": f"{card.name} ({where}; {card.source})",
        "GPU memory": f"{gpu_mem:.3g} GiB" + (" (--gpu-mem-gb)" if args.gpu_mem_gb is not None else ""),
        "layer TFLOPS": f"{machine.layer_tflops:g} bf16" + (" (--gpu-tflops)" if args.gpu_tflops else ""),
        "host link": f"{machine.h2d_gbps:g} GB/s each way" + (" (--h2d-gbps)" if args.h2d_gbps else ""),
        "host memory": f"{host:.3g} GiB" + (" (--host-mem-gb)" if args.host_mem_gb is not None
                                            else " (this host's available memory; --host-mem-gb for another)"),
        "host Adam": f"{machine.adam_gparams_per_s:g} G params/s",
    }
    return machine, gpu_mem, host, assumed


def _local_card(memory_gib: float, match):
    """The table's card for the local CUDA GPU (None where it is not in the table: its memory alone is used)."""
    import torch

    return match(torch.cuda.get_device_name(), memory_gib)


def _disk_bandwidth(args) -> tuple[float | None, float | None, float | None]:
    """(read, write, mixed) GB/s of the state disk: measured under --probe-disk, else --nvme-gbps both ways (and
    --nvme-mixed-gbps), else none."""
    if args.probe_disk:
        from mt_ray.engine.direct_io import measure_disk

        try:
            speed = measure_disk(args.probe_disk)
        except OSError as e:
            raise ConfigError(f"--probe-disk {args.probe_disk}: {e}") from None
        print(f"disk under {args.probe_disk}: {speed.describe()}", flush=True)
        return speed
    if args.nvme_mixed_gbps is not None and args.nvme_gbps is None:
        raise ConfigError("--nvme-mixed-gbps needs --nvme-gbps (the disk's read and write GB/s each alone)")
    return args.nvme_gbps, args.nvme_gbps, args.nvme_mixed_gbps


def _cluster_sizing(spec, args, stage):
    """Per-node host memory, object store and network of a data-parallel run of the recommended engine (a
    preference stage's reference once per node)."""
    from mt_ray.cluster.sizing import size_cluster
    from mt_ray.engine.config import EngineConfig, OptimizerConfig

    args.workers = args.workers or args.nodes
    if args.workers % args.nodes:
        raise ConfigError(f"--workers {args.workers} cannot spread evenly over --nodes {args.nodes}")
    cfg = EngineConfig(device="cpu", compute_dtype="bf16", grad_dtype="compute")
    return size_cluster(spec, cfg, OptimizerConfig(), args.workers, args.nodes, reference=stage.reference,
                        rollout=stage.rollout_tokens > 0)


def _export(args) -> int:
    from mt_ray.training.export import export_checkpoint

    print(export_checkpoint(args.config, args.checkpoint, args.out, args.fall_back).describe())
    return 0


def _info(args) -> int:
    from mt_ray.engine.sizing import describe_model

    print(describe_model(_spec(args)))
    return 0


def _run_config(args):
    if not getattr(args, "config", None):
        return None
    from mt_ray.config.run import load_run_config

    return load_run_config(args.config)


def _spec(args, run=None):
    from mt_ray.models.discovery import discover, load_config
    from mt_ray.models.presets import cut_config, preset_config

    if run is not None or getattr(args, "config", None):
        from mt_ray.training import build_model_spec

        return build_model_spec(run or _run_config(args))
    if args.path:
        return discover(cut_config(load_config(args.path), args.layers) if args.layers else args.path)
    return discover(preset_config(args.preset or "tiny", layers=args.layers))


_COMMANDS = {"train": _train, "sweep": _sweep, "calc": _calc, "export": _export, "info": _info}

if __name__ == "__main__":
    sys.exit(main())
