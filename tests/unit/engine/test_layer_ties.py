"""Weights tied between decoder layers (Zamba2's shared transformer block, used by every hybrid layer): loaded as
`save_pretrained` stores them (once), trained as one tensor (one gradient summed over the layers using it, one
Adam state), exported as transformers writes them, and loaded back by transformers."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from mt_ray.engine import EngineConfig, StreamingEngine
from mt_ray.errors import CheckpointError, ConfigError
from mt_ray.models.discovery import discover
from tests.family_checks import OPT, documents, eager_reference, packed_micro_batch
from tests.family_sweep import save_tiny
from tests.tiny_models import reference_train

OWNER = "model.layers.1.shared_transformer.self_attn.q_proj.weight"
MIRROR = "model.layers.3.shared_transformer.self_attn.q_proj.weight"
STEPS = 2

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("zamba2")
    save_tiny("zamba2", path)  # two hybrid layers sharing one transformer block
    return path


@pytest.fixture(scope="module")
def reference(folder):
    """transformers' eager model trained STEPS steps on each document alone: (weights before, weights after)."""
    ref = eager_reference(folder)
    before = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    alone = [{"input_ids": torch.tensor([d.input_ids]), "labels": torch.tensor([d.labels])} for d in documents()]
    reference_train(ref, [alone] * STEPS, OPT)
    return before, {k: v.detach() for k, v in ref.state_dict().items()}


def test_save_pretrained_stores_the_shared_block_once(folder):
    stored = load_file(folder / "model.safetensors")
    assert OWNER in stored and MIRROR not in stored
    spec = discover(str(folder))
    [mirror] = [p for p in spec.unit("layers.3").params if p.hf_name == MIRROR]
    assert mirror.tied_to == OWNER and not mirror.trainable
    assert spec.unit("layers.1").kind != spec.unit("layers.3").kind  # mirrors lay the flat buffer out apart


@pytest.mark.parametrize("engine_kw", [{}, {"checkpoint_every": 1}, {"schedule": "resident"}],
                         ids=["stream", "K1", "resident"])
def test_tied_weights_train_as_one_tensor(folder, reference, engine_kw, tmp_path):
    """Two steps (so a second Adam state would show), each packed row its own micro-batch, against transformers, whose
    tied weight is one parameter; then the export writes it once and transformers loads exactly the trained weights."""
    before, ref_state = reference
    packed = packed_micro_batch(documents())
    rows = [{k: v[r : r + 1] for k, v in packed.items()} for r in range(2)]
    engine = StreamingEngine(discover(str(folder)), EngineConfig(device="cpu", **engine_kw), OPT, total_steps=STEPS)
    try:
        engine.load_pretrained(folder)
        for _ in range(STEPS):
            engine.train_step(rows)
        state = {k: v.clone() for k, v in engine.state_dict().items()}
        engine.export(tmp_path / "out")
    finally:
        engine.close()
    for name, w in ref_state.items():
        if name in state:  # the tied LM head is the embedding
            torch.testing.assert_close(state[name] - before[name], w - before[name], rtol=1e-4, atol=3e-7, msg=name)
    assert torch.equal(state[MIRROR], state[OWNER])
    assert MIRROR not in load_file(tmp_path / "out" / "model.safetensors")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    for name, w in reloaded.items():
        if name in state:
            torch.testing.assert_close(w, state[name], rtol=0, atol=0, msg=name)


def test_a_checkpoint_without_the_shared_block_is_refused_naming_it(folder, tmp_path):
    stored = load_file(folder / "model.safetensors")
    del stored[OWNER]
    save_file(stored, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    engine = StreamingEngine(discover(str(tmp_path)), EngineConfig(device="cpu"), OPT, total_steps=1)
    try:
        with pytest.raises(CheckpointError, match=f"lacks 1 tensors the model needs .*: {OWNER} "):
            engine.load_pretrained(tmp_path)
    finally:
        engine.close()


def test_tied_weights_with_the_master_on_disk_are_refused(folder, tmp_path):
    cfg = EngineConfig(device="cpu", state_placement="nvme", nvme_path=str(tmp_path))
    with pytest.raises(ConfigError, match="'zamba2' ties weights between layers"):
        StreamingEngine(discover(str(folder)), cfg, OPT, total_steps=1)
