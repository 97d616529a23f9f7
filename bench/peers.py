"""The systems mt-ray is compared with, each training the same model on the same batches.

Every peer runs the same Hugging Face model (random init from the shape's config), the same
global batch split into the same micro-batches, AdamW with the same hyper-parameters, global
norm clipping, activation checkpointing, bf16 compute with fp32 master weights, and the same
loss: fp32 cross-entropy over chunks of tokens, each chunk's logits recomputed in backward, so
no peer is held back by transformers' full-vocabulary fp32 logits (the loss mt-ray computes).

- `plain`: everything on the GPU (fp32 params, bf16 autocast, fused GPU AdamW): the ceiling.
- `fsdp2`: PyTorch FSDP2 `fully_shard` per decoder layer with `CPUOffloadPolicy`, one GPU.
- `deepspeed`: ZeRO-3 with parameters and optimizer offloaded to pinned CPU memory,
  DeepSpeedCPUAdam (JIT-built on first use), bf16; `deepspeed-superoffload` adds SuperOffload.
- `plain-no-recompute`, `deepspeed-no-recompute`: the same without activation checkpointing.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from mt_ray.engine import OptimizerConfig
from mt_ray.models.kernels import apply_liger

Step = Callable[[], torch.Tensor]


class ChunkedLossLM(torch.nn.Module):
    """A causal LM whose forward returns the mean next-token loss, computed chunk by chunk."""

    def __init__(self, lm: torch.nn.Module, chunk_tokens: int):
        super().__init__()
        self.lm = lm
        self.chunk = chunk_tokens

    def forward(self, input_ids: torch.Tensor, n_items: int) -> torch.Tensor:
        hidden = self.lm.model(input_ids=input_ids).last_hidden_state
        h = hidden[:, :-1].reshape(-1, hidden.shape[-1])
        target = input_ids[:, 1:].reshape(-1)
        total = hidden.new_zeros((), dtype=torch.float32)
        for s in range(0, h.shape[0], self.chunk):
            total = total + checkpoint(self._chunk_loss, h[s : s + self.chunk], target[s : s + self.chunk],
                                       use_reentrant=False)
        return total / n_items

    def _chunk_loss(self, h: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.lm.lm_head(h).float(), target, reduction="sum")


def build_lm(cfg, chunk_tokens: int, recompute: bool = True, kernels: str = "torch") -> ChunkedLossLM:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(cfg)
    lm.config.use_cache = False
    if kernels == "liger":  # the same fused kernels as mt-ray's `kernels: liger`
        apply_liger(lm, cfg.model_type)
    if recompute:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return ChunkedLossLM(lm, chunk_tokens)


def param_groups(model: torch.nn.Module, opt: OptimizerConfig) -> list[dict]:
    """Weight decay on matrices only, as mt-ray does."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": opt.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def plain_step(cfg, mbs: list[dict], opt: OptimizerConfig, chunk_tokens: int, kernels: str = "torch",
               recompute: bool = True) -> Step:
    model = build_lm(cfg, chunk_tokens, recompute, kernels).cuda()
    optim = torch.optim.AdamW(param_groups(model, opt), lr=opt.lr, betas=opt.betas, eps=opt.eps, fused=True)

    def forward(i: int, ids: torch.Tensor, n_items: int) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return model(ids, n_items)

    return accumulating_step(model, optim, mbs, opt, forward)


def accumulating_step(model: torch.nn.Module, optim: torch.optim.Optimizer, mbs: list[dict], opt: OptimizerConfig,
                      forward: Callable[[int, torch.Tensor, int], torch.Tensor]) -> Step:
    """A step of plain PyTorch shape: backward per micro-batch, clip, optimizer step."""
    mbs = [mb["input_ids"].cuda() for mb in mbs]
    n_items = sum(ids[:, 1:].numel() for ids in mbs)

    def step() -> torch.Tensor:
        total = torch.zeros((), device="cuda")
        for i, ids in enumerate(mbs):
            loss = forward(i, ids, n_items)
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), opt.max_grad_norm)
        optim.step()
        optim.zero_grad(set_to_none=True)
        return total

    return step


def _single_process_group() -> None:
    """A world of one process, which FSDP2 and DeepSpeed both need."""
    if not os.environ.get("MASTER_PORT"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")


def fsdp2_step(cfg, mbs: list[dict], opt: OptimizerConfig, chunk_tokens: int, kernels: str = "torch") -> Step:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    _single_process_group()
    torch.distributed.init_process_group("nccl", device_id=torch.device("cuda", 0))
    model = build_lm(cfg, chunk_tokens, kernels=kernels)
    policy = dict(offload_policy=CPUOffloadPolicy(pin_memory=True),
                  mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    for layer in model.lm.model.layers:
        fully_shard(layer, **policy)
    fully_shard(model, **policy)
    optim = torch.optim.AdamW(param_groups(model, opt), lr=opt.lr, betas=opt.betas, eps=opt.eps)

    def forward(i: int, ids: torch.Tensor, n_items: int) -> torch.Tensor:
        model.set_requires_gradient_sync(i == len(mbs) - 1)  # reduce (and offload) once per step
        return model(ids, n_items)

    return accumulating_step(model, optim, mbs, opt, forward)


def deepspeed_config(opt: OptimizerConfig, micro: int, n_micro: int, super_offload: bool = False) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": n_micro,
        "gradient_clipping": opt.max_grad_norm,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": opt.lr, "betas": list(opt.betas), "eps": opt.eps,
                                                  "weight_decay": opt.weight_decay}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": True},
            "offload_optimizer": {"device": "cpu", "pin_memory": True, "super_offload": super_offload},
            "overlap_comm": True,
            "contiguous_gradients": True,
            "stage3_param_persistence_threshold": 0,
        },
        "wall_clock_breakdown": False,
    }


def deepspeed_host_bytes(n_params: int) -> int:
    """DeepSpeed's own estimate of host memory for ZeRO-3 with params and optimizer offloaded.

    (`estimate_zero3_model_states_mem_needs`: 18 B/param with both offloads, one GPU.)
    """
    return 18 * n_params


def deepspeed_step(cfg, mbs: list[dict], opt: OptimizerConfig, chunk_tokens: int, kernels: str = "torch",
                   super_offload: bool = False, recompute: bool = True) -> Step:
    import deepspeed

    _single_process_group()
    deepspeed.init_distributed(dist_backend="nccl")
    ds_cfg = deepspeed_config(opt, mbs[0]["input_ids"].shape[0], len(mbs), super_offload)
    # Built with transformers' own init on the GPU, then partitioned and offloaded by initialize:
    # zero.Init (also what HfDeepSpeedConfig turns on) skips that init in transformers 5, and
    # building on the host would add the fp32 model to DeepSpeed's peak host memory.
    with torch.device("cuda"):
        model = build_lm(cfg, chunk_tokens, recompute, kernels)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model, opt), config=ds_cfg)
    mbs = [mb["input_ids"].cuda() for mb in mbs]
    micro_items = mbs[0][:, 1:].numel()  # DeepSpeed divides each micro-batch loss by the accumulation steps

    def step() -> torch.Tensor:
        total = torch.zeros((), device="cuda")
        for ids in mbs:
            loss = engine(ids, micro_items)
            engine.backward(loss)
            engine.step()
            total += loss.detach() / len(mbs)
        return total

    return step


PEERS: dict[str, Callable[..., Step]] = {
    "plain": plain_step, "fsdp2": fsdp2_step, "deepspeed": deepspeed_step,
    "deepspeed-superoffload": partial(deepspeed_step, super_offload=True),  # DeepSpeed >= 0.18, built for superchips
    # Without activation checkpointing (6·N·T), the peers of mt-ray's resident schedule.
    "plain-no-recompute": partial(plain_step, recompute=False),
    "deepspeed-no-recompute": partial(deepspeed_step, recompute=False),
}
