"""`engine.auto_fit: true`: the run takes the calculator's fastest configuration that fits this GPU and host.

Applied before anything is allocated, so a run that cannot fit stops with the calculator's reason
instead of running out of memory mid-step. The global batch (`micro_batch_size x grad_accum_steps`)
and the sequence length (`data.max_seq_len`) are kept; the calculator chooses the engine's memory
knobs and how the global batch splits into micro-batches. So a long `data.max_seq_len` reaches the
longest context this machine trains (`mt-ray calc --max-seq` names it) with no knob set by hand.

Without auto_fit a run keeps its own settings, but one that no configuration of the engine can fit
(a context too long for this GPU or host) is refused the same way before the first step
(`refuse_what_cannot_fit`).
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from mt_ray.config.run import RunConfig
from mt_ray.engine.calculator import GPU_HEADROOM, SEARCHED, local_gpu_memory_gb, recommend
from mt_ray.engine.config import EngineConfig
from mt_ray.engine.direct_io import measure_disk
from mt_ray.engine.gpus import Gpu, local_gpu
from mt_ray.engine.host_store import GIB, available_host_bytes
from mt_ray.engine.sizing import Stage, device_bytes
from mt_ray.engine.step_time import Machine
from mt_ray.errors import ConfigError, InsufficientMemoryError
from mt_ray.models.discovery import ModelSpec

log = logging.getLogger(__name__)
PROBE_BYTES = 1 << 30  # the disk probe's scratch file: long enough to read a drive's sustained speed


def stage_shape(cfg: RunConfig) -> tuple[Stage, int]:
    """What the run's stage adds to the device and time models (a reference, GRPO's rollout copy), and the longest
    sequence a step trains: `data.max_seq_len`, or GRPO's longest prompt and completion."""
    stage = Stage.of(cfg.training.stage, cfg.pref, cfg.grpo, cfg.rollout)
    return stage, stage.rollout_tokens or cfg.data.max_seq_len


def rollout_placement(cfg: RunConfig, spec: ModelSpec) -> str:
    """GRPO's rollout copy: `rollout.placement` as given, or for `auto` resident where the device model says the
    step with the whole copy beside it fits this GPU (`engine.gpu_memory_limit_gb`, or the device's memory), else
    streamed. With no GPU to plan for (the CPU, no limit) the copy is resident: host memory holds it either way."""
    if cfg.rollout.placement != "auto":
        return cfg.rollout.placement
    engine, t = cfg.engine, cfg.training
    if engine.resolve_device().type != "cuda" and engine.gpu_memory_limit_gb is None:
        return "resident"
    stage, seq = stage_shape(cfg)  # auto counts the copy as resident
    planned = device_bytes(spec, engine, t.micro_batch_size, seq, t.micro_batch_size * t.grad_accum_steps,
                           stage=stage)["total"]
    return "resident" if planned <= _gpu_memory_gb(cfg) * GIB * GPU_HEADROOM else "streamed"


def apply_auto_fit(cfg: RunConfig, spec: ModelSpec) -> RunConfig:
    """`cfg` with the recommended engine settings and micro-batch size; raises the calculator's reason
    (`InsufficientMemoryError`) when nothing fits."""
    engine, t = cfg.engine, cfg.training
    if cfg.cluster.num_workers > 1:
        raise ConfigError("engine.auto_fit: fits a single engine (cluster.num_workers: 1); for data-parallel workers "
                          "run `mt-ray calc` for each worker's share of the global batch and set the keys it gives")
    gpu_gb, host_gb, rec = _search(cfg, spec)
    if not rec["fits"]:
        raise InsufficientMemoryError(f"engine.auto_fit: nothing fits a {gpu_gb:.3g} GiB GPU and {host_gb:.3g} GiB of "
                                      f"host memory. {rec['reason']}")
    chosen = {k: rec[k] for k in SEARCHED}
    if chosen["prefetch_units"] == chosen["checkpoint_every"]:
        chosen["prefetch_units"] = None  # the default: K
    rollout = ({"rollout": cfg.rollout.model_copy(update={"placement": rec["rollout_placement"]})}
               if "rollout_placement" in rec else {})  # the copy the search fitted beside the step
    fitted = cfg.model_copy(update={
        **rollout, "engine": engine.model_validate({**engine.model_dump(), **chosen}),
        "training": t.model_copy(update={"micro_batch_size": rec["micro_batch_size"],
                                         "grad_accum_steps": rec["grad_accum_steps"]}),
    })
    choices = ", ".join([*(f"engine.{k}={rec[k]}" for k in SEARCHED),
                         f"training.micro_batch_size={rec['micro_batch_size']}",
                         f"training.grad_accum_steps={rec['grad_accum_steps']}",
                         *([f"rollout.placement={rec['rollout_placement']}"] if "rollout_placement" in rec else [])])
    message = (f"auto_fit for a {gpu_gb:.3g} GiB GPU and {host_gb:.3g} GiB of host memory: {choices} (predicted "
               f"{rec['device_gib']:.3g} GiB GPU, {rec['host_gib']:.3g} GiB host, {rec['predicted_step_s']:.3g} s/step)"
               + (f"; {rec['placement_reason']}" if "placement_reason" in rec else "")
               # the batch is the user's: say what bounds it and which batch would hide the optimizer, not change it
               + (f"; {rec['optimizer_advice']}" if "optimizer_advice" in rec else ""))
    print(message, flush=True)  # on the console, as the trainer says where it resumes from
    log.info(message)
    return fitted


def _search(cfg: RunConfig, spec: ModelSpec) -> tuple[float, float, dict]:
    """The GPU and host GiB planned for, and the calculator's fastest fit of this run's global batch and sequence."""
    engine, t = cfg.engine, cfg.training
    gpu_gb = _gpu_memory_gb(cfg)
    host_gb = available_host_bytes(engine.host_memory_limit_gb) / GIB
    stage, seq = stage_shape(cfg)
    rec = recommend(spec, seq, t.micro_batch_size * t.grad_accum_steps, gpu_gb, host_gb, cfg=engine,
                    opt=cfg.optimizer, machine=_machine(engine), stage=stage)
    return gpu_gb, host_gb, rec


def _machine(engine: EngineConfig) -> Machine:
    """This GPU's figures where the calculator's table knows the card (`gpus.py`; else an H100's), with the disk
    under `engine.nvme_path` measured when one is set (the search may then move optimizer state there, only if the
    host cannot hold it)."""
    card = _local_card(engine)
    machine = Machine(layer_tflops=card.layer_tflops, h2d_gbps=card.h2d_gbps) if card else Machine()
    if not engine.nvme_path:
        return machine
    try:
        speed = measure_disk(engine.nvme_path, PROBE_BYTES)
    except OSError as e:
        raise ConfigError(f"engine.nvme_path {engine.nvme_path}: {e}; point it at an existing, writable folder on an "
                          "NVMe disk") from None
    log.info("engine.nvme_path %s: %s", engine.nvme_path, speed.describe())
    return replace(machine, nvme_read_gbps=speed.read_gbps, nvme_write_gbps=speed.write_gbps,
                   nvme_mixed_gbps=speed.mixed_gbps)


def _local_card(engine: EngineConfig) -> Gpu | None:
    """The table's card for the run's CUDA device (None on the CPU, or for a card not in the table)."""
    device = engine.resolve_device()
    if device.type != "cuda":
        return None
    return local_gpu(torch.cuda.get_device_name(device), local_gpu_memory_gb(device))


def refuse_what_cannot_fit(cfg: RunConfig, spec: ModelSpec) -> None:
    """Raise the calculator's reason (which memory runs out, and the longest sequence and largest global
    batch that fit) where no engine configuration fits this run's shape; warn where only its own does not.
    For a single engine planning for a GPU (a CUDA device, or `engine.gpu_memory_limit_gb`)."""
    engine, t = cfg.engine, cfg.training
    if cfg.cluster.num_workers > 1 or (engine.resolve_device().type != "cuda" and engine.gpu_memory_limit_gb is None):
        return
    gpu_gb, host_gb, rec = _search(cfg, spec)
    global_batch = t.micro_batch_size * t.grad_accum_steps
    stage, seq = stage_shape(cfg)
    if not rec["fits"]:
        raise InsufficientMemoryError(
            f"{_seq_name(stage, seq)} x {global_batch} sequences a step cannot train on a {gpu_gb:.3g} "
            f"GiB GPU with {host_gb:.3g} GiB of host memory, whatever the engine settings. {rec['reason']}")
    planned = device_bytes(spec, engine, t.micro_batch_size, seq, global_batch, stage=stage)["total"] / GIB
    if planned > gpu_gb * GPU_HEADROOM:
        log.warning("the engine settings are predicted to need %.3g GiB of a %.3g GiB GPU; engine.auto_fit: true "
                    "would train with %s", planned, gpu_gb, ", ".join(f"engine.{k}={rec[k]}" for k in SEARCHED))


def _seq_name(stage: Stage, seq: int) -> str:
    return f"grpo.max_prompt_length + max_completion_length {seq}" if stage.rollout_tokens else f"data.max_seq_len {seq}"


def _gpu_memory_gb(cfg: RunConfig) -> float:
    """engine.gpu_memory_limit_gb, capped by the device's memory when it is a GPU."""
    limit, device = cfg.engine.gpu_memory_limit_gb, cfg.engine.resolve_device()
    if device.type != "cuda":
        if limit is None:
            raise ConfigError("engine.auto_fit: there is no GPU to fit; set engine.gpu_memory_limit_gb to plan for one, "
                              "or turn auto_fit off")
        return limit
    total = local_gpu_memory_gb(device)
    return total if limit is None else min(limit, total)


__all__ = ["apply_auto_fit", "refuse_what_cannot_fit", "rollout_placement", "stage_shape"]
