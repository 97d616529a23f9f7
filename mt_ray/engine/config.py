"""Typed configuration of the streaming engine and its optimizer."""

from __future__ import annotations

import math
import os
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from mt_ray.errors import ConfigError

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class EngineConfig(_Strict):
    """How the engine moves a model through the device."""

    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$",
                        description="'auto' (CUDA when present, else CPU), 'cpu', 'cuda' or 'cuda:N'.")
    compute_dtype: Literal["auto", "bf16", "fp16", "fp32"] = Field(
        "auto", description="dtype of weights and activations on the device ('auto': bf16 on GPU, fp32 on CPU, "
        "where bf16 matmuls are slow); master weights stay fp32."
    )
    schedule: Literal["stream", "resident"] = Field(
        "stream",
        description="'stream': weights stream through the device a block at a time and every K layers' "
        "activations are recomputed in backward (8·N·T FLOPs a step; any model size). 'resident': the step's "
        "compute-dtype weights and fp32 gradient sums stay on the device (6 bytes/param) and each micro-batch "
        "runs forward and backward with nothing recomputed (6·N·T), for models whose weights and one "
        "micro-batch's activations fit; the optimizer and master weights stay in host memory.",
    )
    checkpoint_every: int = Field(
        4, ge=1, description="K: keep the hidden state every K layers and recompute blocks of K layers in backward."
    )
    checkpoint_placement: Literal["device", "host"] = Field(
        "device",
        description="Where the streaming schedule's hidden states wait between blocks (the checkpoints, the last "
        "block's output, the gradient flowing back). 'device': on the GPU, which then holds L/K + 1 hidden states "
        "per token of the step. 'host': in pinned host memory (the same amount, allocated once), copied out and "
        "fetched back on the copy streams, overlapped with compute, so GPU memory no longer grows with the "
        "step's tokens.",
    )
    keep_activations: Literal["auto"] | int = Field(
        "auto",
        description="Stream schedule: how many block graphs (one block of K layers for one micro-batch) the "
        "forward keeps for the backward instead of recomputing them (kept_blocks.py: the last blocks, for the "
        "micro-batches the backward reaches first). 0: recompute every block. 'auto': as many as fit beside the "
        "schedule's own peak in gpu_memory_limit_gb (or the GPU's memory), by the calculator's device model; "
        "0 on CPU. A number larger than the GPU holds is refused before the first step. The resident schedule "
        "keeps everything already.",
    )
    device_optimizer_units: Literal["auto"] | int = Field(
        "auto",
        description="Stream schedule with the local optimizer (optimizer.impl: numba, state in host RAM): how many "
        "units, the first in forward order (embedding, layer 0, ...), keep their fp32 master and Adam moments on "
        "the GPU between steps and are updated there (device_state.py), bit-identically to the host AdamW. Their "
        "update takes milliseconds where the host's takes seconds, and the next forward runs through them while "
        "the host updates the rest: what hides the optimizer behind a short step. 14 B of GPU memory a "
        "parameter (the state, and its gradient until the step's norm is known). 'auto': as many as fit the "
        "GPU budget after the step and its kept block graphs; 0 on CPU. 0: none. A number larger than fits is "
        "refused before the first step. Units with tied weights stay on the host. The host buffers are brought "
        "up to date whenever they are read (checkpoints, export).",
    )
    stream_master: bool = Field(
        False,
        description="Stream the fp32 master and cast on the device instead of keeping a compute-dtype host copy "
        "(12 instead of 14 host bytes/param, twice the host->device bytes).",
    )
    grad_dtype: Literal["fp32", "compute"] = Field(
        "fp32", description="dtype in which finished gradients travel to host (accumulation is always fp32)."
    )
    grad_slabs: int = Field(3, ge=1, description="Pinned host slabs gradients land in (when no clipping holds them all).")
    prefetch_units: int | None = Field(
        None, ge=1, description="Units uploaded ahead of use; default K so a whole recompute block is in flight."
    )
    loss_chunk_tokens: int = Field(4096, ge=1, description="Tokens per LM-head chunk; bounds the fp32 logits in memory.")
    mlp_chunk_tokens: int | None = Field(
        None, ge=1,
        description="Run every decoder layer's norms and dense MLP over the micro-batch's tokens in chunks of this "
        "many, recomputing each chunk in backward: the layer's graph keeps one input a token for each of them "
        "instead of the MLP's intermediates (at long context most of its activations), for one more forward of "
        "them a step. The same arithmetic; for long contexts. Default: whole micro-batches.",
    )
    attn_implementation: str = Field(
        "auto",
        description="attention backend: 'auto' (eager for a family whose attention uses soft-capping or sinks, which "
        "SDPA drops; on CUDA with bf16/fp16 'varlen' where the family allows it; SDPA otherwise), 'varlen' (PyTorch's "
        "variable-length flash attention: packed rows keep their documents apart with no T x T mask; on the CPU each "
        "document runs through SDPA alone), or a transformers name: sdpa, eager, flex_attention, flash_attention_2. "
        "A backend that lacks a feature the family uses, or cannot run here, is refused.",
    )
    kernels: Literal["torch", "liger"] = Field(
        "torch",
        description="'liger': Liger's fused Triton kernels for RMSNorm, SwiGLU/GeGLU and rotary in every decoder "
        "layer and the final norm, with the family's own settings (fewer activation bytes kept for backward and "
        "fewer kernel launches; CUDA only; pip install liger-kernel). The loss stays the engine's chunked fp32 "
        "cross-entropy, and MoE experts transformers' own (Liger's fused experts compute fp32 as TF32). "
        "'torch': the family's transformers code.",
    )
    moe_experts: Literal["grouped", "transformers"] = Field(
        "grouped",
        description="'grouped': a mixture of experts' routed banks run as two grouped GEMMs around the gated "
        "activation with nothing else over the tokens (`models.grouped_experts`); a bank it cannot express keeps "
        "transformers' code, with a one-line notice why. 'transformers': the family's configured experts code.",
    )
    host_memory_limit_gb: float | None = Field(
        None, gt=0, description="Host memory this job may use; default: cgroup limit, else MemAvailable."
    )
    gpu_memory_limit_gb: float | None = Field(
        None, gt=0, description="GPU memory (GiB) this job may use, enforced on CUDA through the caching allocator "
        "(emulates a smaller card) and used by auto_fit; default: the whole device."
    )
    auto_fit: bool = Field(
        False, description="mt-ray train: before building the engine, let the calculator choose the schedule, K, "
        "checkpoint placement, loss chunk, prefetch depth, stream_master, grad_dtype and training.micro_batch_size "
        "(global batch and seq kept) that fit this GPU and host fastest, log the choices, and stop with the "
        "calculator's reason when nothing fits."
    )
    state_placement: Literal["host", "nvme", "nvme_moments"] = Field(
        "host",
        description="Where the fp32 master weights and Adam moments live. 'host': in RAM (12 B/param beside the "
        "streamed copy). 'nvme': both in files under nvme_path; RAM keeps the compute-dtype copy the GPU streams "
        "from and a window of state chunks, read ahead with direct I/O and written back as each unit updates, "
        "overlapping the backward. 'nvme_moments': the master stays in RAM, only the moments go to disk.",
    )
    nvme_path: str | None = Field(
        None, description="An existing, writable folder on a local NVMe disk for state_placement nvme or "
        "nvme_moments; it needs room for the state (12 or 8 B/param), reserved at start."
    )
    nvme_io: Literal["direct", "auto"] = Field(
        "direct", description="'direct': the state files bypass the page cache (O_DIRECT), and a folder whose "
        "filesystem refuses that is refused. 'auto': fall back to buffered I/O there, with a warning (the page "
        "cache then holds what was moved out of RAM)."
    )
    nvme_window: int = Field(
        4, ge=2, description="State chunks (16 M parameters each: 192 MB with the master, 128 MB without) held in "
        "page-locked host memory at once: the one being updated, those read ahead and those being written back."
    )
    optimizer_threads: int | None = Field(
        None, ge=1, description="CPU threads for the optimizer; default: all cores but one (kept for launching GPU work)."
    )

    @field_validator("keep_activations")
    @classmethod
    def _keep_not_negative(cls, v: str | int) -> str | int:
        if isinstance(v, int) and v < 0:
            raise ValueError("keep_activations is 'auto' or a number of block graphs >= 0 (0: full recompute)")
        return v

    @field_validator("device_optimizer_units")
    @classmethod
    def _units_not_negative(cls, v: str | int) -> str | int:
        if isinstance(v, int) and v < 0:
            raise ValueError("device_optimizer_units is 'auto' or a number of units >= 0 (0: every update on the host)")
        return v

    @model_validator(mode="after")
    def _liger_needs_cuda(self) -> EngineConfig:
        if self.kernels == "liger" and self.device == "cpu":
            raise ValueError("kernels: liger runs Triton kernels on CUDA only, but device is cpu; "
                             "use kernels: torch, or device: cuda")
        return self

    @model_validator(mode="after")
    def _host_placement_needs_streaming(self) -> EngineConfig:
        if self.checkpoint_placement == "host" and self.schedule == "resident":
            raise ValueError("checkpoint_placement: host applies to schedule: stream (the resident schedule keeps "
                             "no checkpoints); use checkpoint_placement: device, or schedule: stream")
        return self

    @model_validator(mode="after")
    def _nvme_needs_a_path(self) -> EngineConfig:
        if self.state_placement != "host" and not self.nvme_path:
            raise ValueError(f"state_placement: {self.state_placement} needs engine.nvme_path, a folder on an NVMe "
                             "disk for the optimizer state; set it, or use state_placement: host")
        if self.state_placement == "nvme" and self.stream_master:
            raise ValueError("stream_master streams the fp32 master from RAM, but state_placement: nvme keeps it on "
                             "disk; use stream_master: false, or state_placement: nvme_moments")
        return self

    @property
    def dtype(self) -> torch.dtype:
        if self.compute_dtype == "auto":
            return torch.bfloat16 if self.resolve_device().type == "cuda" else torch.float32
        return _DTYPES[self.compute_dtype]

    @property
    def optimizer_thread_count(self) -> int:
        """`optimizer_threads`, else every core this process may run on but one.

        Set explicitly on the optimizer thread: Ray starts actors with OMP_NUM_THREADS=1,
        which left a coordinator's Adam on one core (a 7B step took 1.9x as long on H200s).
        """
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return self.optimizer_threads or max(1, cores - 1)

    @property
    def grad_torch_dtype(self) -> torch.dtype:
        """dtype gradients leave the device in (and travel between Ray actors in)."""
        return torch.float32 if self.grad_dtype == "fp32" else self.dtype

    def resolve_device(self) -> torch.device:
        """The device to compute on; a CUDA device this machine cannot give is a `ConfigError`, not torch's assert."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            why = (f"this torch ({torch.__version__}) is built without CUDA" if torch.version.cuda is None
                   else "no CUDA device is visible (check the driver and CUDA_VISIBLE_DEVICES)")
            raise ConfigError(f"engine.device: {self.device} was asked for, but {why}; use engine.device=auto "
                              "(CUDA when present, else CPU) or engine.device=cpu")
        if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            raise ConfigError(f"engine.device: {self.device} was asked for, but this machine has "
                              f"{torch.cuda.device_count()} CUDA device(s); use cuda:0 to cuda:{torch.cuda.device_count() - 1}")
        return device


class OptimizerConfig(_Strict):
    """AdamW with decoupled weight decay, global-norm clipping and an LR schedule."""

    lr: float = Field(1e-5, gt=0, description="Peak learning rate.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="Adam beta1, beta2.")
    eps: float = Field(1e-8, gt=0, description="Adam epsilon.")
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay on matrices (not norms/biases).")
    max_grad_norm: float = Field(
        1.0, ge=0, description="Clip the global gradient norm to this; 0 disables clipping (and lets each "
        "layer update the moment its gradient lands)."
    )
    schedule: Literal["constant", "cosine", "linear"] = Field("cosine", description="LR schedule after warmup.")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup steps from 0 to lr.")
    warmup_ratio: float | None = Field(
        None, ge=0, lt=1, description="Warmup as a fraction of the run's steps, rounded up (transformers' and "
        "LLaMA-Factory's warmup_ratio), instead of warmup_steps."
    )
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Floor of cosine/linear decay, as a fraction of lr.")
    impl: Literal["numba", "torch", "deepspeed"] = Field(
        "numba", description="'numba': one pass a chunk over the host state (`engine.host_adamw`: the gradient read as "
        "it landed, the clip and the streamed copy folded in), bit-identical to torch's fused AdamW on AVX2/AVX512 "
        "hosts; 'torch': torch's fused CPU AdamW (a bf16 gradient upcast through a scratch copy first); "
        "'deepspeed': DeepSpeed's CPUAdam (JIT-built)."
    )

    @model_validator(mode="after")
    def _one_warmup(self) -> OptimizerConfig:
        if self.warmup_ratio is not None and self.warmup_steps:
            raise ValueError("give warmup_steps or warmup_ratio, not both")
        return self

    def warmup(self, total_steps: int) -> int:
        """Warmup steps of a run of `total_steps` (`warmup_ratio` rounds up, as transformers does)."""
        return self.warmup_steps if self.warmup_ratio is None else math.ceil(total_steps * self.warmup_ratio)

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in v):
            raise ValueError("betas must be in [0, 1)")
        return v
