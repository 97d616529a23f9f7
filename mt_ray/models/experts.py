"""Mixture-of-experts layers: which parameters are routed experts, and how many of them a token computes with.

A token runs through every parameter of a dense layer, but through only `top_k` of a routed bank's
`num_experts` experts: its compute (and the calculator's FLOPs) follows the active parameters, while its
memory, host link, gradients and optimizer follow all of them. Found from the modules themselves, as
transformers builds them, not from a list of families:

- a routed bank is a module with an integer `num_experts` and no `top_k` of its own (a router or a MoE
  block has both), each of whose parameters splits evenly into `num_experts` slices (transformers 5's fused
  banks `[E, ...]`, DBRX's `[E * ffn, D]`, JetMoE's parallel experts); or, for the families whose banks name
  no count (Aria's grouped GEMMs), a module whose class name ends in `Experts` (not a shared one) with every
  parameter `[E, ...]` for the config's expert count;
- its `top_k` is the nearest enclosing module's, or a sibling router's with as many experts, else the
  config's (`num_experts_per_tok` and the families' other names for it).

Shared experts, routers, attention and dense layers (DeepSeek's `first_k_dense_replace`) are dense.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from transformers import PretrainedConfig

from mt_ray.errors import ModelNotSupportedError

# The families' names for the routed experts a token picks, and for the experts a bank holds.
TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "moe_k", "num_experts_per_token", "top_k_experts",
              "experts_per_token", "moe_top_k")
NUM_EXPERTS_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


@dataclass(frozen=True)
class ExpertBank:
    """One routed bank of a layer: its path in the layer, its parameters, experts and experts a token uses."""

    path: str
    numel: int
    num_experts: int
    top_k: int

    @property
    def active_numel(self) -> int:
        """The parameters one token computes with: `top_k` experts' slices."""
        return self.numel * self.top_k // self.num_experts


def expert_banks(layer: nn.Module, config: PretrainedConfig) -> list[ExpertBank]:
    """The routed banks of a decoder layer (empty for a dense layer), outermost first."""
    banks: list[ExpertBank] = []
    taken: list[str] = []
    modules = dict(layer.named_modules())
    for path, module in modules.items():
        if any(path.startswith(f"{t}.") for t in taken):
            continue
        experts = _bank_experts(module, config)
        if experts is None:
            continue
        numel = sum(p.numel() for p in module.parameters())
        banks.append(ExpertBank(path, numel, experts, _top_k(path, modules, experts, config)))
        taken.append(path)
    return banks


def active_fraction_by_param(layer: nn.Module, config: PretrainedConfig) -> dict[str, float]:
    """Each routed parameter's share a token computes with, by its name in the layer (dense ones are absent)."""
    out = {}
    for bank in expert_banks(layer, config):
        module = layer.get_submodule(bank.path)
        for name, _ in module.named_parameters():
            out[f"{bank.path}.{name}" if bank.path else name] = bank.top_k / bank.num_experts
    return out


def _bank_experts(module: nn.Module, config: PretrainedConfig) -> int | None:
    """The experts `module` holds as a routed bank, or None where it is none."""
    params = list(module.parameters())
    if not params:
        return None
    count = getattr(module, "num_experts", None)
    if isinstance(count, int) and count > 1 and not isinstance(getattr(module, "top_k", None), int):
        return count if all(p.shape[0] % count == 0 for p in params) else None
    name = type(module).__name__
    count = config_value(config, NUM_EXPERTS_KEYS)
    if name.endswith("Experts") and "Shared" not in name and count and all(p.shape[0] == count for p in params):
        return count
    return None


def _top_k(path: str, modules: dict[str, nn.Module], experts: int, config: PretrainedConfig) -> int:
    """The experts a token picks from the bank at `path`: an enclosing module's `top_k`, a sibling router's, or the
    config's."""
    parts = path.split(".")
    for depth in range(len(parts) - 1, -1, -1):
        parent = ".".join(parts[:depth])
        outer = modules[parent]
        if isinstance(getattr(outer, "top_k", None), int):
            return outer.top_k
        for child in outer.children():
            if isinstance(getattr(child, "top_k", None), int) and getattr(child, "num_experts", experts) == experts:
                return child.top_k
    top_k = config_value(config, TOP_K_KEYS)
    if top_k is None:
        raise ModelNotSupportedError(
            f"'{config.model_type}': the routed experts at {path} name no top-k (none of {', '.join(TOP_K_KEYS)} in "
            "the config, no `top_k` on its router); the calculator cannot count its active parameters")
    return top_k


def config_value(config: PretrainedConfig, keys: tuple[str, ...]) -> int | None:
    """The first of `keys` set to a positive integer on `config` or its MoE sub-config (DBRX's `ffn_config`)."""
    for source in (config, getattr(config, "ffn_config", None)):
        for key in keys:
            value = getattr(source, key, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None
