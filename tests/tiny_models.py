"""Tiny random configs of every supported family, and a plain-PyTorch reference trainer."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from mt_ray.data.schema import IGNORE_INDEX, TokenizedExample
from mt_ray.engine.config import OptimizerConfig
from mt_ray.engine.optimizer import lr_at

VOCAB = 96
_COMMON = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=5, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, pad_token_id=0, bos_token_id=1,
               eos_token_id=2, max_position_embeddings=64)

FAMILIES: dict[str, dict] = {
    "llama": {},
    "qwen2": {},
    "qwen2-tied": {"model_type": "qwen2", "tie_word_embeddings": True},
    "qwen3": {},
    "mistral": {"sliding_window": 6},
    "gemma2": {"sliding_window": 6, "final_logit_softcapping": 5.0, "attn_logit_softcapping": 10.0},
    "gemma3_text": {"sliding_window": 6, "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                                                         "sliding_attention", "full_attention"]},
    "phi3": {},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "decoder_sparse_step": 2},
}


# The families trained from their own checkpoints (tests/unit/engine/test_families.py): 4 layers, so
# hybrids alternate their two layer kinds and MoE families have dense and sparse layers.
_MOE = dict(moe_intermediate_size=16, num_experts_per_tok=2)
_LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
               linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"] * 2)
_ROUTED = dict(n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, **_MOE)
CHECKPOINT_FAMILIES: dict[str, dict] = {
    "llama": {},
    "qwen2-tied": {"model_type": "qwen2", "tie_word_embeddings": True},
    "mistral": {"sliding_window": 4},  # shorter than every document
    "gemma2": {"sliding_window": 4, "attn_logit_softcapping": 1.0, "final_logit_softcapping": 2.0},
    "gemma3_text": {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"] * 2},
    "phi3": {},
    "olmo2": {},
    "smollm3": {"no_rope_layer_interval": 2},
    "qwen3_moe": {"num_experts": 4, "decoder_sparse_step": 2, **_MOE},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "deepseek_v3": {**_ROUTED, "num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 16,
                    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8, "n_group": 2, "topk_group": 1},
    "glm4_moe": {**_ROUTED, "n_group": 1, "topk_group": 1},
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 4,
                "layer_types": ["sliding_attention", "full_attention"] * 2},
    "qwen3_next": {"num_experts": 4, "decoder_sparse_step": 2, "shared_expert_intermediate_size": 16,
                   **_MOE, **_LINEAR},
    "qwen3_5_text": _LINEAR,
    "qwen3_5_moe_text": {"num_experts": 4, "shared_expert_intermediate_size": 16, **_MOE, **_LINEAR},
    "lfm2": {"layer_types": ["conv", "full_attention"] * 2, "conv_L_cache": 3},
    "falcon_h1": {"mamba_d_ssm": 32, "mamba_n_heads": 4, "mamba_d_head": 8, "mamba_d_state": 8, "mamba_d_conv": 4,
                  "mamba_chunk_size": 8, "mamba_expand": 1, "lm_head_multiplier": 0.5, "embedding_multiplier": 2.0},
}


def checkpoint_config(family: str, **overrides) -> PretrainedConfig:
    """A tiny config of `family` (a CHECKPOINT_FAMILIES key), random-init scale 0.2 so that soft-capping,
    sliding windows and routing all bite."""
    kw = {**_COMMON, "num_hidden_layers": 4, "initializer_range": 0.2, **CHECKPOINT_FAMILIES[family], **overrides}
    return AutoConfig.for_model(kw.pop("model_type", family), **kw)


def tiny_config(family: str = "llama", **overrides) -> PretrainedConfig:
    kw = {**_COMMON, **FAMILIES[family], **overrides}
    model_type = kw.pop("model_type", family)
    cfg = AutoConfig.for_model(model_type, **kw)
    cfg._attn_implementation = "sdpa"
    return cfg


def tiny_batches(n_micro: int = 2, batch: int = 2, seq: int = 12, seed: int = 0, prompt: int = 4) -> list[dict]:
    """Micro-batches with a masked prompt, one packed row (position ids restart mid-row)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_micro):
        ids = torch.randint(3, VOCAB, (batch, seq), generator=g)
        labels = ids.clone()
        labels[:, :prompt] = -100
        pos = torch.arange(seq).repeat(batch, 1)
        out.append({"input_ids": ids, "labels": labels, "position_ids": pos})
    return out


def reference_model(cfg: PretrainedConfig, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).float()


def reference_train(model: torch.nn.Module, steps: list[list[dict]], opt_cfg: OptimizerConfig,
                    objective=lambda out, mb, n: out.loss) -> list[float]:
    """Ordinary in-memory PyTorch training of `model` with the same optimizer: the ground truth.

    `objective(output, micro_batch, n)` is what each micro-batch backpropagates (default: the model's
    own loss, normalised over the step's n loss tokens)."""
    params = dict(model.named_parameters())
    groups = [
        {"params": [p for p in params.values() if p.dim() >= 2], "weight_decay": opt_cfg.weight_decay},
        {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=opt_cfg.lr, betas=opt_cfg.betas, eps=opt_cfg.eps, fused=True)
    losses = []
    for step, mbs in enumerate(steps):
        opt.zero_grad()
        n = sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in mbs)
        total = 0.0
        for mb in mbs:
            out = model(**mb, num_items_in_batch=n, use_cache=False)  # a cache would disable packed masks
            loss = objective(out, mb, n)
            loss.backward()
            total += loss.item()
        if opt_cfg.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), opt_cfg.max_grad_norm)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, opt_cfg, len(steps))
        opt.step()
        losses.append(total)
    return losses


def preference_sequence(prompt: list[int], response: list[int], role: int) -> TokenizedExample:
    """One side of a preference group as the data pipeline tokenizes it: the prompt carries no loss."""
    return TokenizedExample(input_ids=tuple(prompt + response), labels=(IGNORE_INDEX,) * len(prompt) + tuple(response),
                            role=role, prompt_len=len(prompt))


def assert_freed_once_closed(trained_engine: Callable[[], object]) -> None:
    """With the garbage collector off, the engine `trained_engine` builds and uses is freed, once closed, with its
    last reference: no reference cycle keeps its device and host memory until the collector runs."""
    gc.collect()
    gc.disable()
    try:
        engine = trained_engine()
        engine.close()
        freed = weakref.ref(engine)
        del engine
        assert freed() is None
    finally:
        gc.enable()
