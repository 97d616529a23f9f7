"""Loading safetensors folders straight into the store, and exporting Hugging Face folders."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from mt_ray.engine import EngineConfig, OptimizerConfig, StreamingEngine
from mt_ray.errors import CheckpointError
from mt_ray.models.discovery import discover
from tests.family_sweep import tiny_config as sweep_config
from tests.tiny_models import (
    CHECKPOINT_FAMILIES,
    FAMILIES,
    checkpoint_config,
    reference_model,
    tiny_batches,
    tiny_config,
)


def make_engine(cfg, steps=2):
    return StreamingEngine(discover(cfg), EngineConfig(device="cpu", compute_dtype="fp32"),
                           OptimizerConfig(lr=1e-3), total_steps=steps)


def saved_state(model) -> dict[str, torch.Tensor]:
    """Parameters and saved buffers (DeepSeek-V3's routing bias) under the model's own names."""
    return model.state_dict()


@pytest.mark.parametrize("config", [tiny_config("llama"), tiny_config("qwen2-tied"), checkpoint_config("mixtral"),
                                    checkpoint_config("deepseek_v3")], ids=["llama", "qwen2-tied", "mixtral",
                                                                            "deepseek_v3"])
def test_load_sharded_safetensors_folder(tmp_path, config):
    """Experts stored one matrix per expert across shards load fused, through transformers' own mapping."""
    ref = reference_model(config)
    for name, buf in ref.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.normal_()
    ref.save_pretrained(tmp_path, max_shard_size="20KB")
    assert json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    engine = make_engine(config)
    try:
        engine.load_pretrained(tmp_path)
        state = engine.state_dict()
        for name, w in saved_state(ref).items():
            if name in state or not config.tie_word_embeddings:
                assert torch.equal(state[name], w), name
    finally:
        engine.close()


def write_checkpoint(folder, config, edit) -> None:
    """`config`'s random model saved by transformers, then its tensors rewritten by `edit`."""
    reference_model(config).save_pretrained(folder)
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def load_error(folder, config) -> str:
    engine = make_engine(config)
    try:
        with pytest.raises(CheckpointError) as e:
            engine.load_pretrained(folder)
    finally:
        engine.close()
    return str(e.value)


def test_missing_tensors_are_named_with_their_shapes(tmp_path):
    def drop(t):
        for i in range(5):
            t.pop(f"model.layers.{i}.mlp.up_proj.weight")

    write_checkpoint(tmp_path, tiny_config("llama"), drop)
    message = load_error(tmp_path, tiny_config("llama"))
    assert "lacks 5 tensors the model needs" in message
    assert "model.layers.0.mlp.up_proj.weight (64, 32), model.layers.1.mlp.up_proj.weight (64, 32)" in message


def test_wrong_shapes_are_named_with_expected_and_found(tmp_path):
    def widen(t):
        t["model.layers.1.mlp.up_proj.weight"] = torch.zeros(80, 32)
        t["model.norm.weight"] = torch.zeros(48)

    write_checkpoint(tmp_path, tiny_config("llama"), widen)
    message = load_error(tmp_path, tiny_config("llama"))
    assert "holds 2 tensors of the wrong shape" in message
    assert "model.layers.1.mlp.up_proj.weight: expected (64, 32), found (80, 32)" in message
    assert "model.norm.weight: expected (32,), found (48,)" in message


def test_extra_tensors_are_named(tmp_path):
    """A sixth layer and a stray module: the checkpoint is for another config, whatever else it holds."""
    def grow(t):
        t["model.layers.5.mlp.up_proj.weight"] = torch.zeros(64, 32)
        t["model.layers.5.input_layernorm.weight"] = torch.zeros(32)
        t["model.adapter.weight"] = torch.zeros(32, 32)

    write_checkpoint(tmp_path, tiny_config("llama"), grow)
    message = load_error(tmp_path, tiny_config("llama"))
    assert "holds 3 tensors this model does not have: model.adapter.weight, " in message
    assert "model.layers.5.input_layernorm.weight, model.layers.5.mlp.up_proj.weight" in message


def test_tensors_transformers_drops_are_not_extra(tmp_path):
    """DeepSeek-V3's multi-token-prediction layer (model.layers.61) and stale rotary tables load as in
    transformers: dropped, not refused."""
    config = checkpoint_config("deepseek_v3")

    def add_dropped(t):
        t["model.layers.61.eh_proj.weight"] = torch.zeros(32, 64)
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(4)

    write_checkpoint(tmp_path, config, add_dropped)
    engine = make_engine(config)
    try:
        engine.load_pretrained(tmp_path)
    finally:
        engine.close()


@pytest.mark.parametrize("with_head", [False, True], ids=["head-omitted", "head-stored"])
def test_a_tied_checkpoint_is_complete_with_or_without_its_head(tmp_path, with_head):
    """save_pretrained omits a tied head; older exports store it beside the embedding. transformers loads
    both, and so does mt-ray: neither is incomplete, nor has an extra tensor."""
    config = checkpoint_config("qwen2-tied")
    ref = reference_model(config)

    def head(t):
        assert "lm_head.weight" not in t  # transformers' own tied format
        if with_head:
            t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()

    write_checkpoint(tmp_path, config, head)
    engine = make_engine(config)
    try:
        engine.load_pretrained(tmp_path)
        state = engine.state_dict()
    finally:
        engine.close()
    assert torch.equal(state["model.embed_tokens.weight"], ref.model.embed_tokens.weight)


def test_a_missing_expert_is_named_by_the_fused_tensor_it_leaves_short(tmp_path):
    config = checkpoint_config("mixtral")

    def drop_expert(t):
        for part in ("w1", "w2", "w3"):
            t.pop(f"model.layers.2.block_sparse_moe.experts.3.{part}.weight")  # the hub layout

    write_checkpoint(tmp_path, config, drop_expert)
    message = load_error(tmp_path, config)
    assert "model.layers.2.mlp.experts.gate_up_proj: expected (4, 128, 32), found (3, 128, 32)" in message


def test_codes_without_their_scales_are_refused(tmp_path):
    """fp8 codes would load as numbers without their scales: refused by tensor dtype, naming the fix (released
    MXFP4 and FP8-block checkpoints, with their scales, load dequantized: tests/unit/models/test_dequantize.py)."""
    config = tiny_config("llama")

    def fp8(t):
        t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"].to(torch.float8_e4m3fn)

    write_checkpoint(tmp_path / "codes", config, fp8)
    message = load_error(tmp_path / "codes", config)
    assert "without their scales (model.layers.0.mlp.up_proj.weight (torch.float8_e4m3fn)" in message
    assert "dequantize=True" in message


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen2-tied", "qwen3_moe", "mixtral", "deepseek_v3",
                                    "qwen3_next", "gpt_oss", "gpt2", "bart", "bert", "big_bird", "electra",
                                    "megatron-bert", "roberta", "modernbert-decoder"])
def test_export_reloads_with_identical_logits(tmp_path, family):
    """The export holds what save_pretrained writes (experts one by one; GPT-2's learned positions, streamed with
    the embedding; BART's decoder's untrained cross-attention; BERT's embedding container and prediction head, its
    decoder bias once, as `cls.predictions.bias`; BigBird's untrained pooler) and loads back to the same logits."""
    cfg = tiny_config(family) if family in FAMILIES else checkpoint_config(family) if family in CHECKPOINT_FAMILIES \
        else AutoModelForCausalLM.from_config(sweep_config(family)).config  # as saved: BART's as a decoder alone
    engine = make_engine(cfg)
    try:
        engine.load_random(seed=3)
        engine.train_step(tiny_batches())
        out = engine.export(tmp_path / "hf")
        state = engine.state_dict()
    finally:
        engine.close()
    assert not (tmp_path / "hf.tmp").exists()
    twin = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float()
    twin.load_state_dict(state, strict=False)
    twin.save_pretrained(tmp_path / "by_transformers")
    assert load_file(out / "model.safetensors").keys() == load_file(tmp_path / "by_transformers/model.safetensors").keys()
    model = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").float().eval()
    embed = next(n for n, p in model.named_parameters() if p is model.get_input_embeddings().weight)
    for name, w in saved_state(model).items():
        if name not in state:  # tied: the embedding (or BERT's decoder bias: `cls.predictions.bias`)
            name = model.all_tied_weights_keys.get(name, embed if "lm_head" in name else name)
        assert torch.equal(w, state[name]), name
    ids = tiny_batches(n_micro=1)[0]["input_ids"]
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
