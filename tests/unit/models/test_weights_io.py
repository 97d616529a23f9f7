"""Loading safetensors folders straight into the store, and exporting Hugging Face folders."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from mt_ray.engine import EngineConfig, OptimizerConfig, StreamingEngine
from mt_ray.errors import CheckpointError
from mt_ray.models.discovery import discover
from tests.tiny_models import reference_model, tiny_batches, tiny_config


def make_engine(cfg, steps=2):
    return StreamingEngine(discover(cfg), EngineConfig(device="cpu", compute_dtype="fp32"),
                           OptimizerConfig(lr=1e-3), total_steps=steps)


@pytest.mark.parametrize("family", ["llama", "qwen2-tied"])
def test_load_sharded_safetensors_folder(tmp_path, family):
    cfg = tiny_config(family)
    ref = reference_model(cfg)
    ref.save_pretrained(tmp_path, max_shard_size="20KB")
    assert json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    engine = make_engine(cfg)
    try:
        engine.load_pretrained(tmp_path)
        state = engine.state_dict()
        for name, w in ref.state_dict().items():
            if name in state:
                assert torch.equal(state[name], w), name
    finally:
        engine.close()


def test_missing_weight_is_named(tmp_path):
    cfg = tiny_config("llama")
    ref = reference_model(cfg)
    sd = {k: v for k, v in ref.state_dict().items() if "layers.3.mlp.up_proj" not in k}
    from safetensors.torch import save_file

    save_file(sd, tmp_path / "model.safetensors")
    engine = make_engine(cfg)
    try:
        with pytest.raises(CheckpointError, match="layers.3.mlp.up_proj"):
            engine.load_pretrained(tmp_path)
    finally:
        engine.close()


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen2-tied"])
def test_export_reloads_with_identical_logits(tmp_path, family):
    cfg = tiny_config(family)
    engine = make_engine(cfg)
    try:
        engine.load_random(seed=3)
        engine.train_step(tiny_batches())
        out = engine.export(tmp_path / "hf")
        state = engine.state_dict()
    finally:
        engine.close()
    assert not (tmp_path / "hf.tmp").exists()
    model = AutoModelForCausalLM.from_pretrained(out).float().eval()
    for name, w in model.state_dict().items():
        if "lm_head" in name and cfg.tie_word_embeddings:
            name = "model.embed_tokens.weight"
        assert torch.equal(w, state[name]), name
    ids = tiny_batches(n_micro=1)[0]["input_ids"]
    twin = reference_model(cfg)
    twin.load_state_dict(state, strict=False)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, twin.eval()(ids).logits, rtol=0, atol=0)


def test_random_init_follows_family_init():
    cfg = tiny_config("llama", initializer_range=0.5)
    engine = make_engine(cfg)
    try:
        engine.load_random(seed=0)
        state = engine.state_dict()
    finally:
        engine.close()
    q = state["model.layers.0.self_attn.q_proj.weight"]
    assert 0.4 < q.std().item() < 0.6  # normal(0, initializer_range)
    assert torch.equal(state["model.norm.weight"], torch.ones(cfg.hidden_size))
