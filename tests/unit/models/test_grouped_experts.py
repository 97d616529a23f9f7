"""The grouped experts path trains every MoE family it takes exactly as that family's own eager experts, and leaves
the banks it cannot express on transformers' code, saying why."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from mt_ray.models.grouped_experts import (
    IMPLEMENTATION,
    apply_grouped_experts,
    experts_banks,
    unsupported_reason,
)
from tests.family_sweep import tiny_config


@functools.cache
def _moe_families() -> tuple[list[str], dict[str, str]]:
    """The causal-LM families whose tiny config has experts under transformers' interface: those this path takes,
    and the others with the reason it gives."""
    taken, kept = [], {}
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        try:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(tiny_config(model_type))
        except Exception:  # noqa: BLE001 - a family transformers cannot build tiny is the sweep's business
            continue
        banks = experts_banks(model)
        reasons = {r for b in banks.values() if (r := unsupported_reason(b)) is not None}
        if banks and not reasons:
            taken.append(model_type)
        elif banks:
            kept[model_type] = "; ".join(sorted(reasons))
    return taken, kept


def _loss_and_grads(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_every_moe_family_the_path_takes_trains_as_its_eager_experts():
    """fp32 on the CPU, routing that spreads tokens over every expert: loss and every gradient against the family's
    own per-expert loop (`experts_implementation: eager`)."""
    taken, _ = _moe_families()
    assert {"qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe", "qwen2_moe", "olmoe"} <= set(taken)
    ids = torch.randint(3, 96, (2, 24), generator=torch.Generator().manual_seed(0))
    for model_type in taken:
        torch.manual_seed(0)
        eager = AutoModelForCausalLM.from_config(tiny_config(model_type), experts_implementation="eager").float()
        grouped = copy.deepcopy(eager)
        assert apply_grouped_experts(grouped) is None, model_type
        assert {b.config._experts_implementation for b in experts_banks(grouped).values()} == {IMPLEMENTATION}
        loss, grads = _loss_and_grads(eager, ids)
        ours, our_grads = _loss_and_grads(grouped, ids)
        torch.testing.assert_close(ours, loss, rtol=1e-5, atol=0, msg=model_type)
        assert our_grads.keys() == grads.keys(), model_type
        for name, g in grads.items():
            torch.testing.assert_close(our_grads[name], g, rtol=1e-4, atol=1e-6, msg=f"{model_type}: {name}")


@pytest.mark.parametrize("model_type", ["gpt_oss", "nemotron_h"])
def test_a_bank_it_cannot_express_keeps_transformers_code_and_says_why(model_type):
    model = AutoModelForCausalLM.from_config(tiny_config(model_type))
    notice = apply_grouped_experts(model)
    assert notice is not None and "keep transformers'" in notice and _moe_families()[1][model_type] in notice
    assert IMPLEMENTATION not in {b.config._experts_implementation for b in experts_banks(model).values()}
