"""The calculator's active parameters (`ModelSpec.active_numel`, `experts.py`) equal what the model's own modules
compute with for one token, for every mixture-of-experts family the family sweep trains at parity.

Measured from the model itself: a tiny random model of the family (tests/family_sweep.py's `tiny_config`) runs one
token forward and its logits backward, so each expert bank has a gradient on exactly the experts the router picked
for it: a parameter of a bank counts the share of its expert slices (along its first dimension, E of them) with a
gradient, every other parameter counts whole. (A bank of query projections, JetMoE's attention experts, has no
gradient with one token, whose softmax over one key is 1, bar rounding: it counts as its sibling bank does, which
the same router feeds.)
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from mt_ray.models.discovery import discover
from mt_ray.models.presets import preset_config
from tests.family_sweep import tiny_config

README = Path(__file__).resolve().parents[3] / "README.md"
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
ROUTERS = {"router", "gate"}  # a router's rows get gradients only where it picked (Mixtral): computed whole


def _experts(config) -> int | None:
    text = config.get_text_config()
    for source in (text, getattr(text, "ffn_config", None)):
        for key in EXPERT_COUNTS:
            value = getattr(source, key, None)
            if isinstance(value, int) and value > 1:
                return value
    return None


def _matched_families() -> list[str]:
    """The causal-LM families the README's families table (the sweep's outcomes) lists as trained at parity."""
    line = next(x for x in README.read_text().splitlines() if x.startswith("Trained at parity"))
    return re.findall(r"`([^`]+)`", line.split(":", 1)[1])


def _moe_families() -> list[str]:
    out = []
    for model_type in _matched_families():
        try:
            config = tiny_config(model_type)
        except Exception:  # noqa: BLE001 - a family the sweep builds otherwise is not a MoE one here
            continue
        text = config.get_text_config()
        if _experts(config) and getattr(text, "enable_moe_block", True) and getattr(text, "is_moe", True):
            out.append(model_type)
    return out


MOE_FAMILIES = _moe_families()


def _in_bank(name: str, module: torch.nn.Module) -> bool:
    """A routed expert's parameter, by the model's names: under a module named for experts (not shared ones, not a
    router)."""
    segments = name.split(".")[:-1]
    if any(s in ROUTERS for s in segments) or any("shared" in s for s in segments):
        return False
    return "Expert" in type(module).__name__ or any("expert" in s for s in segments)


def measured_layers(model: torch.nn.Module, units, experts: int) -> float:
    """Parameters of the layers' units one token computed with, from the gradients (the checkpoint's buffers a unit
    carries, DeepSeek's `e_score_correction_bias`, count whole)."""
    torch.manual_seed(0)
    logits = model(input_ids=torch.tensor([[5]]), use_cache=False).logits
    (logits[0, -1] * torch.randn_like(logits[0, -1])).sum().backward()
    owners, params = dict(model.named_modules()), dict(model.named_parameters())
    # rounding leaves a softmax of one key a gradient of ~1e-9 on its queries: below this, no gradient
    floor = 1e-5 * max(p.grad.abs().max().item() for p in params.values() if p.grad is not None)
    used: dict[str, tuple[int, int]] = {}  # a bank parameter: (experts with a gradient, its numel)
    total = 0.0
    for info in (info for unit in units for info in unit.params):
        p = params.get(info.hf_name)
        if p is None or p.grad is None or p.dim() < 2 or p.shape[0] % experts or not _in_bank(
                info.hf_name, owners[info.hf_name.rsplit(".", 1)[0]]):
            total += info.numel
        else:
            used[info.hf_name] = ((p.grad.reshape(experts, -1).abs() > floor).any(dim=1).sum().item(), p.numel())
    for name, (n, numel) in used.items():
        block = name.rsplit(".", 2)[0]
        n = n or max(m for other, (m, _) in used.items() if other.startswith(f"{block}."))
        total += numel * n / experts
    return total


def test_the_sweep_has_mixtures_of_experts_to_count():
    assert {"qwen3_moe", "gpt_oss", "mixtral", "deepseek_v3", "dbrx", "jetmoe"} <= set(MOE_FAMILIES)


@pytest.mark.parametrize("model_type", MOE_FAMILIES)
def test_active_parameters_are_what_a_token_computes_with(model_type):
    config = tiny_config(model_type)
    spec = discover(config)
    assert any(spec.routed_shares.values()), f"no routed experts found in {model_type}"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    measured = measured_layers(model, spec.layer_units, _experts(config))
    active = sum(spec.active_numel(u) for u in spec.layer_units)
    assert active == pytest.approx(measured, abs=0.5)
    assert active < sum(u.numel for u in spec.layer_units)


def test_the_published_shapes_count_as_released():
    """Qwen3-30B-A3B cut to 12 layers: 8.10 B parameters, 1.31 B active (issue 38's measured cut); a dense model's
    active parameters are all of them."""
    spec = discover(preset_config("qwen3-30b-a3b", layers=12))
    assert (round(spec.num_params / 1e7), round(spec.active_text_params / 1e7)) == (810, 131)
    dense = discover(preset_config("tiny"))
    assert dense.active_text_params == dense.text_params and dense.routed_active_params == 0
