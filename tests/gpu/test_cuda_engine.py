"""CUDA path: the streamed engine with real streams matches plain PyTorch on the GPU.

Runs only where a GPU is present (the lent device machine); CPU CI skips it.
"""

import importlib
import importlib.util

import pytest
import torch

from mt_ray.engine import EngineConfig, OptimizerConfig, StreamingEngine
from mt_ray.models.discovery import discover
from tests.tiny_models import reference_model, reference_train, tiny_batches, tiny_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

OPT = OptimizerConfig(lr=2e-3, weight_decay=0.1, max_grad_norm=1.0, warmup_steps=1)


@pytest.mark.parametrize("family", ["llama", "qwen2-tied", "gemma3_text"])
@pytest.mark.parametrize("clip", [1.0, 0.0])
@pytest.mark.parametrize("schedule", ["stream", "resident"])
def test_cuda_streams_match_pytorch(family, clip, schedule):
    cfg = tiny_config(family, num_hidden_layers=2 if family == "llama" else 5)
    opt = OPT.model_copy(update={"max_grad_norm": clip})
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_config(cfg).float().cuda()
    mbs = tiny_batches()
    steps = [mbs] * 4
    engine = StreamingEngine(discover(cfg), EngineConfig(device="cuda", compute_dtype="fp32", checkpoint_every=2,
                                                         grad_slabs=1, schedule=schedule), opt, total_steps=4)
    try:
        engine.load_state_dict({k: v.cpu() for k, v in ref.state_dict().items()})
        results = [engine.train_step(mbs) for mbs in steps]
        losses = [r.loss.item() for r in results]
        state = engine.state_dict()
    finally:
        engine.close()
    assert all(torch.isfinite(torch.tensor(losses)))
    ref_losses = reference_train(ref, [[{k: v.cuda() for k, v in mb.items()} for mb in s] for s in steps], opt)
    assert losses == pytest.approx(ref_losses, rel=1e-4)
    for name, w in ref.state_dict().items():
        if name in state:
            torch.testing.assert_close(state[name], w.cpu(), atol=1e-4, rtol=1e-3, msg=name)


def test_bf16_stream_master_runs_and_learns():
    cfg = tiny_config("llama")
    engine = StreamingEngine(discover(cfg), EngineConfig(device="cuda", stream_master=True, grad_dtype="compute"),
                             OPT, total_steps=6)
    try:
        engine.load_random()
        losses = [engine.train_step(tiny_batches()).loss.item() for _ in range(6)]
    finally:
        engine.close()
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("schedule", ["stream", "resident"])
def test_qwen2_5_1_5b_shape_matches_pytorch_for_20_steps_in_bf16(schedule):
    """The full-size 1.5B shape, bf16 compute streamed from fp32 masters, against fp32 PyTorch."""
    from transformers import AutoModelForCausalLM

    from mt_ray.models.presets import preset_config

    cfg = preset_config("qwen2.5-1.5b")
    cfg._attn_implementation = "sdpa"
    opt = OptimizerConfig(lr=1e-4, weight_decay=0.1, max_grad_norm=1.0, warmup_steps=2)
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(cfg).float().cuda()
    mbs = tiny_batches(n_micro=4, batch=2, seq=256, prompt=16)
    steps = [mbs] * 20  # one batch again and again: the loss must fall far, not just drift
    engine = StreamingEngine(discover(cfg), EngineConfig(device="cuda", compute_dtype="bf16", schedule=schedule), opt,
                             total_steps=20)
    try:
        engine.load_state_dict({k: v.cpu() for k, v in ref.state_dict().items()})
        losses = [engine.train_step(s).loss.item() for s in steps]
    finally:
        engine.close()
    ref_losses = reference_train(ref, [[{k: v.cuda() for k, v in mb.items()} for mb in s] for s in steps], opt)
    assert ref_losses[-1] < 0.5 * ref_losses[0]
    assert losses == pytest.approx(ref_losses, rel=3e-2, abs=5e-2)


def _train_with_kernels(cfg, kernels: str, schedule: str, state: dict, steps: list, opt: OptimizerConfig):
    ecfg = EngineConfig(device="cuda", compute_dtype="fp32", checkpoint_every=2, grad_slabs=1, schedule=schedule,
                        kernels=kernels)
    engine = StreamingEngine(discover(cfg), ecfg, opt, total_steps=len(steps))
    try:
        swapped = (engine.templates["head"].module.norm._get_name(), engine.layer_templates[0].module.mlp._get_name())
        engine.load_state_dict(state)
        losses = [engine.train_step(s).loss.item() for s in steps]
        return losses, engine.state_dict(), swapped
    finally:
        engine.close()


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="needs liger-kernel")
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("schedule", ["stream", "resident"])
def test_liger_kernels_match_torch_kernels(family, schedule, family_module_restored):
    """Liger's fused RMSNorm, SwiGLU and rotary train to the same losses and weights in fp32."""
    cfg = tiny_config(family, num_hidden_layers=3)
    family_module_restored(cfg.model_type)
    state = {k: v.cpu() for k, v in reference_model(cfg).state_dict().items()}
    steps = [tiny_batches()] * 4
    # torch first: Liger's rotary swap would reach a torch engine built after it in this process.
    ref_losses, ref_state, ref_names = _train_with_kernels(cfg, "torch", schedule, state, steps, OPT)
    losses, liger_state, liger_names = _train_with_kernels(cfg, "liger", schedule, state, steps, OPT)
    # The swap reached the templates and the attention's rotary function.
    assert liger_names == ("LigerRMSNorm", "LigerSwiGLUMLP") != ref_names
    modeling = importlib.import_module(f"transformers.models.{cfg.model_type}.modeling_{cfg.model_type}")
    assert modeling.apply_rotary_pos_emb.__module__ == "liger_kernel.transformers.rope"
    assert losses == pytest.approx(ref_losses, rel=5e-4)
    for name, w in ref_state.items():
        torch.testing.assert_close(liger_state[name], w, atol=5e-4, rtol=1e-3, msg=name)
