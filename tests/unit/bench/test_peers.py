"""The peers' chunked loss is the loss mt-ray computes: the same value and gradients as transformers'."""

import torch
from transformers import AutoModelForCausalLM

from bench.peers import ChunkedLossLM, deepspeed_config, param_groups
from mt_ray.engine import OptimizerConfig
from tests.tiny_models import tiny_config


def test_chunked_loss_matches_transformers_loss_and_gradients():
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(tiny_config("qwen2")).float()
    ids = torch.randint(3, 96, (3, 17))
    ref = lm(input_ids=ids, labels=ids).loss
    ref_grads = torch.autograd.grad(ref, list(lm.parameters()))
    chunked = ChunkedLossLM(lm, chunk_tokens=7)  # 48 tokens: chunks of 7 with a ragged last one
    loss = chunked(ids, n_items=ids[:, 1:].numel())
    grads = torch.autograd.grad(loss, list(lm.parameters()))
    torch.testing.assert_close(loss, ref)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-5)


def test_every_peer_gets_the_engines_optimizer_settings():
    lm = ChunkedLossLM(AutoModelForCausalLM.from_config(tiny_config("llama")), chunk_tokens=8)
    opt = OptimizerConfig(lr=3e-4, weight_decay=0.05, max_grad_norm=0.5)
    decay, rest = param_groups(lm, opt)
    assert decay["weight_decay"] == 0.05 and rest["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in rest["params"])
    assert len(decay["params"]) + len(rest["params"]) == len(list(lm.parameters()))
    ds = deepspeed_config(opt, micro=4, n_micro=3)
    assert ds["gradient_clipping"] == 0.5 and ds["optimizer"]["params"]["lr"] == 3e-4
    assert ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] == 12
    assert ds["zero_optimization"]["offload_param"]["device"] == "cpu"
