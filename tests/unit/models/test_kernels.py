"""The Liger swap, on CPU: a fake Liger (passed through `apply_kernels`' `liger_fns` seam) patches
the skeleton the way Liger's `apply_liger_kernel_to_llama(model=...)` does, with plain torch
forwards that count their calls; the real kernels need CUDA and triton (tests/gpu covers them).
"""

from __future__ import annotations

import sys
from collections import Counter
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama import modeling_llama

from mt_ray.engine.templates import build_templates
from mt_ray.errors import ConfigError, ModelNotSupportedError
from mt_ray.models.context import LayerContextBuilder, document_spans
from mt_ray.models.discovery import ModelSpec, discover
from mt_ray.models.kernels import apply_kernels
from tests.tiny_models import tiny_batches, tiny_config

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # apply_kernels only checks the type; nothing runs on it


class FakeLiger:
    """Stands in for Liger's llama function: instance-bound forwards on the norms and MLPs, a
    module-level rotary swap, each a torch equivalent that counts its calls."""

    def __init__(self):
        self.calls: Counter[str] = Counter()
        self.kwargs: dict | None = None
        self.torch_rotary = modeling_llama.apply_rotary_pos_emb

    def apply_llama(self, rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True,
                    swiglu=True, model=None):
        self.kwargs = dict(cross_entropy=cross_entropy, fused_linear_cross_entropy=fused_linear_cross_entropy,
                           model=model)
        fake = self

        def rms_forward(norm, x):
            fake.calls["rms_norm"] += 1
            x32 = x.float()
            return norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)).to(x.dtype)

        def swiglu_forward(mlp, x):
            fake.calls["swiglu"] += 1
            return mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))

        def rotary(q, k, cos, sin, *args, **kwargs):
            fake.calls["rope"] += 1
            return fake.torch_rotary(q, k, cos, sin, *args, **kwargs)

        modeling_llama.apply_rotary_pos_emb = rotary
        base = model.model
        norms = [base.norm] + [n for layer in base.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        for norm in norms:
            norm.__dict__["forward"] = rms_forward.__get__(norm)
        for layer in base.layers:
            layer.mlp.__dict__["forward"] = swiglu_forward.__get__(layer.mlp)


@pytest.fixture
def torch_rotary(monkeypatch):
    """Liger's rotary swap is process-wide: put llama's own function back after the test."""
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", modeling_llama.apply_rotary_pos_emb)


def _forward(spec: ModelSpec, flats: dict[str, torch.Tensor], mb: dict) -> torch.Tensor:
    """Logits of `mb` through the spec's templates with the given flat unit weights (as the engine binds them)."""
    templates = build_templates(spec, CPU)
    context = LayerContextBuilder(spec, CPU)
    embed = templates["embed"]
    with torch.no_grad():
        spans = document_spans(mb["position_ids"])
        h, ctx = context(embed(embed.bind(flats["embed"]), mb["input_ids"]), mb["input_ids"], mb["position_ids"], spans)
        for i, unit in enumerate(spec.layer_units):
            layer = templates[unit.kind]
            h = ctx.run(partial(layer, layer.bind(flats[unit.name])), i, h)
        head = templates["head"]
        return head(head.bind(flats["head"]), h)


def test_swap_rebinds_norms_mlps_and_rotary_and_keeps_the_weights_by_name(torch_rotary):
    cfg = tiny_config("llama", num_hidden_layers=2)
    plain, swapped = discover(cfg), discover(cfg)
    g = torch.Generator().manual_seed(0)
    flats = {u.name: torch.randn(u.numel, generator=g) * 0.2 for u in plain.units}
    mb = tiny_batches(n_micro=1)[0]
    expected = _forward(plain, flats, mb)  # before the fake replaces llama's rotary for the whole process

    fake = FakeLiger()
    swapped_names = apply_kernels(swapped, "liger", CUDA, liger_fns={"llama": fake.apply_llama})

    assert fake.kwargs == {"cross_entropy": False, "fused_linear_cross_entropy": False, "model": swapped.skeleton}
    layer_parts = ("input_layernorm", "post_attention_layernorm", "mlp")
    assert sorted(swapped_names) == sorted(
        ["model.norm", "transformers.models.llama.modeling_llama.apply_rotary_pos_emb"]
        + [f"model.layers.{i}.{part}" for i in range(2) for part in layer_parts]
    )
    assert [(u.name, u.params) for u in swapped.units] == [(u.name, u.params) for u in plain.units]
    for kind, template in build_templates(swapped, CPU).items():
        assert [n for n, _ in template.module.named_parameters()] == [
            n for n, _ in build_templates(plain, CPU)[kind].module.named_parameters()
        ]

    got = _forward(swapped, flats, mb)
    # Every swapped piece ran inside the templates: 2 norms a layer + the final norm, 1 MLP and 1 rotary a layer.
    assert fake.calls == {"rms_norm": 5, "swiglu": 2, "rope": 2}
    torch.testing.assert_close(got, expected)


def test_torch_kernels_swap_nothing():
    spec = discover(tiny_config("llama", num_hidden_layers=2))
    assert apply_kernels(spec, "torch", CPU, liger_fns={}) == []
    assert not any("forward" in vars(m) for m in spec.skeleton.modules())


def test_liger_on_cpu_names_the_fix():
    spec = discover(tiny_config("llama", num_hidden_layers=2))
    with pytest.raises(ConfigError, match="CUDA only.*use kernels: torch"):
        apply_kernels(spec, "liger", CPU, liger_fns={"llama": FakeLiger().apply_llama})


def test_liger_not_importable_names_the_fix(monkeypatch):
    # None in sys.modules makes the import fail as a missing package (or missing triton) does.
    monkeypatch.setitem(sys.modules, "liger_kernel", None)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", None)
    spec = discover(tiny_config("llama", num_hidden_layers=2))
    with pytest.raises(ConfigError, match="pip install liger-kernel.*or use kernels: torch"):
        apply_kernels(spec, "liger", CUDA)


def test_model_type_liger_lacks_is_refused():
    spec = discover(tiny_config("phi3", num_hidden_layers=2))
    with pytest.raises(ModelNotSupportedError, match="no kernels for model_type 'phi3'.*use kernels: torch"):
        apply_kernels(spec, "liger", CUDA, liger_fns={"llama": FakeLiger().apply_llama})


def test_liger_failing_on_the_model_is_refused():
    def broken(model=None, cross_entropy=False, fused_linear_cross_entropy=True):
        raise AttributeError("'Qwen3MoeMLP' object has no attribute 'experts'")

    spec = discover(tiny_config("llama", num_hidden_layers=2))
    with pytest.raises(ModelNotSupportedError, match="broken failed.*AttributeError.*use kernels: torch"):
        apply_kernels(spec, "liger", CUDA, liger_fns={"llama": broken})


def test_swap_that_renames_parameters_is_refused():
    def replaces_modules(model=None, **_):
        for layer in model.model.layers:
            layer.mlp = nn.Sequential(layer.mlp.gate_proj, nn.SiLU(), layer.mlp.down_proj)

    spec = discover(tiny_config("llama", num_hidden_layers=2))
    with pytest.raises(ModelNotSupportedError, match="parameter names or shapes"):
        apply_kernels(spec, "liger", CUDA, liger_fns={"llama": replaces_modules})


def test_swap_that_patches_nothing_is_refused():
    spec = discover(tiny_config("llama", num_hidden_layers=2))
    with pytest.raises(ModelNotSupportedError, match="swapped no module"):
        apply_kernels(spec, "liger", CUDA, liger_fns={"llama": lambda model=None, **_: None})
