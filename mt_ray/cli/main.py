"""`mt-ray`: train, sweep, calc, export, info."""

from __future__ import annotations

import argparse
import json
import sys

from mt_ray.errors import MtRayError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mt-ray", description="Full-precision LLM training from host memory.")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a model (defaults: the built-in demo)")
    train.add_argument("--config", help="YAML run config (see jobs/configs/)")
    train.add_argument("--help-config", action="store_true", help="list every config key with its default")
    train.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. training.steps=10")

    sweep = sub.add_parser("sweep", help="Ray Tune sweep of a run config, judged on held-out eval loss (ASHA)")
    from jobs.sweep import add_sweep_arguments

    add_sweep_arguments(sweep)

    calc = sub.add_parser("calc", help="largest micro-batch / checkpoint interval that fit, memory and step time")
    calc.add_argument("--config", help="YAML run config providing the model (or use --preset/--path)")
    calc.add_argument("--preset", help="built-in model shape, e.g. qwen2.5-7b")
    calc.add_argument("--path", help="local Hugging Face model folder")
    calc.add_argument("--seq", type=int, default=1024, help="sequence length")
    calc.add_argument("--global-batch", type=int, default=128, help="sequences per optimizer step")
    calc.add_argument("--gpu-mem-gb", type=float, default=80.0)
    calc.add_argument("--host-mem-gb", type=float, default=128.0)
    calc.add_argument("--image-tokens", type=int, default=0,
                      help="image-text models: image tokens per sample (part of --seq): the vision tower's share")
    calc.add_argument("--json", action="store_true", help="print JSON instead of a table")
    calc.add_argument("--workers", type=int, default=1, help="data-parallel workers (GPUs): adds the per-node figures")
    calc.add_argument("--nodes", type=int, default=1, help="nodes the workers and the fp32 state spread over")

    export = sub.add_parser("export", help="checkpoint -> Hugging Face folder")
    export.add_argument("--config", required=True, help="the run's YAML config (model section)")
    export.add_argument("--checkpoint", help="checkpoint URI (default: the run's latest)")
    export.add_argument("--out", required=True)

    info = sub.add_parser("info", help="what the engine discovers about a model")
    info.add_argument("--preset", help="built-in model shape")
    info.add_argument("--path", help="local Hugging Face model folder")

    args = parser.parse_args(argv)
    try:
        return _COMMANDS[args.command](args)
    except MtRayError as e:
        print(f"mt-ray {args.command}: error: {e}", file=sys.stderr)
        return 2


def _train(args) -> int:
    from mt_ray.config.run import describe_config, load_run_config

    if args.help_config:
        print(describe_config())
        return 0
    from jobs.train import run

    run(load_run_config(args.config, args.overrides))
    return 0


def _sweep(args) -> int:
    from jobs.sweep import report, sweep

    print(report(sweep(args)))
    return 0


def _calc(args) -> int:
    from mt_ray.engine.sizing import recommend, render_recommendation

    spec = _spec(args)
    rec = recommend(spec, args.seq, args.global_batch, args.gpu_mem_gb, args.host_mem_gb,
                    image_tokens=args.image_tokens)
    cluster = _cluster_sizing(spec, args) if args.workers > 1 or args.nodes > 1 else None
    if args.json:
        print(json.dumps({**rec, **({"cluster": cluster.as_dict()} if cluster else {})}, indent=2))
        return 0
    print(render_recommendation(rec))
    if cluster is not None:
        from mt_ray.cluster.sizing import render_cluster

        print(render_cluster(cluster))
    return 0


def _cluster_sizing(spec, args):
    """Per-node host memory, object store and network of a data-parallel run of the recommended engine."""
    from mt_ray.cluster.sizing import size_cluster
    from mt_ray.engine.config import EngineConfig, OptimizerConfig
    from mt_ray.errors import ConfigError

    if args.workers % args.nodes:
        raise ConfigError(f"--workers {args.workers} cannot spread evenly over --nodes {args.nodes}")
    cfg = EngineConfig(device="cpu", compute_dtype="bf16", grad_dtype="compute")
    return size_cluster(spec, cfg, OptimizerConfig(), args.workers, args.nodes)


def _export(args) -> int:
    from mt_ray.training.export import export_checkpoint

    print(export_checkpoint(args.config, args.checkpoint, args.out))
    return 0


def _info(args) -> int:
    from mt_ray.engine.sizing import describe_model

    print(describe_model(_spec(args)))
    return 0


def _spec(args):
    from mt_ray.models.discovery import discover
    from mt_ray.models.presets import preset_config

    if getattr(args, "config", None):
        from mt_ray.config.run import load_run_config
        from mt_ray.training import build_model_spec

        return build_model_spec(load_run_config(args.config))
    if args.path:
        return discover(args.path)
    return discover(preset_config(args.preset or "tiny"))


_COMMANDS = {"train": _train, "sweep": _sweep, "calc": _calc, "export": _export, "info": _info}

if __name__ == "__main__":
    sys.exit(main())
