"""The Liger swap, on CPU: a fake Liger (passed through `apply_kernels`' `liger_fns` seam) patches
the skeleton the way Liger's `apply_liger_kernel_to_llama(model=...)` (or, for MoE, Liger 0.8's
`apply_liger_kernel_to_qwen3_moe`) does, with plain torch forwards that count their calls; the real
kernels need CUDA and triton (tests/gpu covers them).
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
from transformers.models.qwen3_moe import modeling_qwen3_moe

from mt_ray.engine.batch import prepare_micro_batch
from mt_ray.engine.templates import build_templates
from mt_ray.errors import ConfigError, ModelNotSupportedError
from mt_ray.models.context import LayerContextBuilder
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

        def rotary(q, k, cos, sin, *args, **kwargs):
            fake.calls["rope"] += 1
            return fake.torch_rotary(q, k, cos, sin, *args, **kwargs)

        modeling_llama.apply_rotary_pos_emb = rotary
        base = model.model
        norms = [base.norm] + [n for layer in base.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        for norm in norms:
            norm.__dict__["forward"] = partial(_rms_forward, self.calls, norm)
        for layer in base.layers:
            layer.mlp.__dict__["forward"] = partial(_swiglu_forward, self.calls, layer.mlp)


def _rms_forward(calls: Counter, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    calls["rms_norm"] += 1
    x32 = x.float()
    return norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)).to(x.dtype)


def _swiglu_forward(calls: Counter, mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    calls["swiglu"] += 1
    return mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))


class FakeFusedExperts(modeling_qwen3_moe.Qwen3MoeExperts):
    """Stands in for Liger 0.8's `LigerExperts`: the same parameters, a forward that is visibly wrong."""

    calls: Counter[str] = Counter()

    def forward(self, hidden_states, top_k_index, top_k_weights):
        self.calls["experts"] += 1
        return torch.zeros_like(hidden_states)


def fake_liger_qwen3_moe(calls: Counter, model=None, cross_entropy=False, fused_linear_cross_entropy=True):
    """Liger 0.8's qwen3_moe function on transformers 5: the RMSNorm and expert-bank classes replaced
    in the modeling file; norms, dense MLPs and expert banks rebound on the instance."""
    modeling_qwen3_moe.Qwen3MoeRMSNorm = nn.RMSNorm  # stands in for LigerRMSNorm
    modeling_qwen3_moe.Qwen3MoeExperts = FakeFusedExperts
    base = model.model
    for norm in [base.norm] + [n for layer in base.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]:
        norm.__dict__["forward"] = partial(_rms_forward, calls, norm)
    for layer in base.layers:
        if hasattr(layer.mlp, "experts"):
            layer.mlp.experts.__dict__["forward"] = FakeFusedExperts.forward.__get__(layer.mlp.experts)
            layer.mlp.experts.__dict__["_get_name"] = lambda: "FakeFusedExperts"
        else:
            layer.mlp.__dict__["forward"] = partial(_swiglu_forward, calls, layer.mlp)


@pytest.fixture
def torch_rotary(monkeypatch):
    """Liger's rotary swap is process-wide: put llama's own function back after the test."""
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", modeling_llama.apply_rotary_pos_emb)


@pytest.fixture
def qwen3_moe_file(monkeypatch):
    """The fakes replace classes in qwen3_moe's modeling file: put them back after the test, whatever it did."""
    for name in ("Qwen3MoeRMSNorm", "Qwen3MoeExperts", "apply_rotary_pos_emb"):
        monkeypatch.setattr(modeling_qwen3_moe, name, getattr(modeling_qwen3_moe, name))
    FakeFusedExperts.calls.clear()
    return dict(vars(modeling_qwen3_moe))


def _forward(spec: ModelSpec, flats: dict[str, torch.Tensor], mb: dict) -> torch.Tensor:
    """Logits of `mb` through the spec's templates with the given flat unit weights (as the engine binds them)."""
    templates = build_templates(spec, CPU)
    context = LayerContextBuilder(spec, CPU)
    embed = templates["embed"]
    with torch.no_grad():
        documents = prepare_micro_batch(mb, CPU).documents
        h, ctx = context(embed(embed.bind(flats["embed"]), mb["input_ids"]), mb["input_ids"], mb["position_ids"],
                         documents)
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


def test_liger_failing_on_the_model_is_refused_and_its_modeling_file_put_back(qwen3_moe_file):
    def broken(model=None, cross_entropy=False, fused_linear_cross_entropy=True):
        # Liger 0.8.5 on a Qwen3-MoE with dense layers: the classes are swapped, then the layer loop fails.
        modeling_qwen3_moe.apply_rotary_pos_emb = lambda *a, **k: None
        modeling_qwen3_moe.Qwen3MoeExperts = FakeFusedExperts
        modeling_qwen3_moe.LIGER_WAS_HERE = True
        return model.model.layers[0].mlp.experts

    spec = discover(tiny_config("qwen3_moe", num_hidden_layers=2))
    with pytest.raises(ModelNotSupportedError, match=(
            "broken failed on this 'qwen3_moe' model .AttributeError: 'Qwen3MoeMLP' object has no attribute "
            "'experts'.; use kernels: torch")):
        apply_kernels(spec, "liger", CUDA, liger_fns={"qwen3_moe": broken})
    assert vars(modeling_qwen3_moe) == qwen3_moe_file  # a later model in this process runs transformers' code


def test_expert_banks_keep_transformers_forward_and_class(qwen3_moe_file):
    """Liger 0.8's fused experts run fp32 GEMMs as TF32: the swap of every module owning a weight matrix
    is undone (on the instance and in the modeling file); norms and dense MLPs keep Liger's."""
    cfg = tiny_config("qwen3_moe", num_hidden_layers=4)  # layers 1 and 3 sparse
    plain, spec = discover(cfg), discover(cfg)
    g = torch.Generator().manual_seed(0)
    flats = {u.name: torch.randn(u.numel, generator=g) * 0.2 for u in plain.units}
    mb = tiny_batches(n_micro=1)[0]
    calls: Counter[str] = Counter()

    swapped = apply_kernels(spec, "liger", CUDA, liger_fns={"qwen3_moe": partial(fake_liger_qwen3_moe, calls)})

    assert sorted(swapped) == sorted(["model.norm"] + [f"model.layers.{i}.{part}" for i in range(4) for part in
                                                      ("input_layernorm", "post_attention_layernorm")]
                                     + ["model.layers.0.mlp", "model.layers.2.mlp"])
    assert modeling_qwen3_moe.Qwen3MoeExperts is qwen3_moe_file["Qwen3MoeExperts"]
    assert modeling_qwen3_moe.Qwen3MoeRMSNorm is nn.RMSNorm  # Liger's other class swaps stay
    experts = [m for n, m in spec.skeleton.named_modules() if n.endswith("mlp.experts")]
    assert len(experts) == 2 and not any("forward" in vars(m) or "_get_name" in vars(m) for m in experts)
    torch.testing.assert_close(_forward(spec, flats, mb), _forward(plain, flats, mb))
    assert calls == {"rms_norm": 9, "swiglu": 2} and not FakeFusedExperts.calls


def test_expert_bank_of_liger_class_is_refused(qwen3_moe_file):
    """A model built after Liger swapped the experts class (outside mt-ray, and never undone) holds
    Liger's experts by class, which no instance undo can reach."""
    modeling_qwen3_moe.Qwen3MoeExperts = type("LigerExperts", (FakeFusedExperts,),
                                              {"__module__": "liger_kernel.transformers.swiglu"})
    spec = discover(tiny_config("qwen3_moe", num_hidden_layers=2))
    with pytest.raises(ModelNotSupportedError, match="'model.layers.1.mlp.experts' .* is Liger's LigerExperts.*TF32"):
        apply_kernels(spec, "liger", CUDA, liger_fns={"qwen3_moe": partial(fake_liger_qwen3_moe, Counter())})


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
