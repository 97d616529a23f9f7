"""Built-in model shapes: the demo model, and public checkpoints' shapes for random-init runs.

The shapes match the public configs (Qwen2.5, Qwen3, Llama-3.1, Mistral; the mixtures of experts Qwen3-30B-A3B,
GPT-OSS-20B, Mixtral-8x7B and OLMoE-1B-7B); nothing is downloaded: a run that names a preset and no `model.path`
trains a random-initialised model of that shape. `layers` cuts a shape to its first layers, so that a large one
(a 30B mixture of experts: 14 bytes a parameter of host memory) fits the host at hand with its layers as published.
"""

from __future__ import annotations

from transformers import AutoConfig, PretrainedConfig

from mt_ray.errors import ConfigError

PRESETS: dict[str, dict] = {
    "tiny": dict(model_type="qwen2", hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=832, tie_word_embeddings=True,
                 max_position_embeddings=2048),
    # the demo's size with experts (8 of them, 2 a token): CPU smoke runs of the MoE paths
    "tiny-moe": dict(model_type="qwen3_moe", hidden_size=128, intermediate_size=384, moe_intermediate_size=64,
                     num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
                     num_experts_per_tok=2, norm_topk_prob=True, vocab_size=832, tie_word_embeddings=True,
                     max_position_embeddings=2048),
    "qwen2.5-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-3b": dict(model_type="qwen2", hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                       num_attention_heads=16, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "qwen2.5-14b": dict(model_type="qwen2", hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                        num_attention_heads=40, num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     tie_word_embeddings=False),
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                         tie_word_embeddings=False),
    "mistral-7b": dict(model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=32768, tie_word_embeddings=False,
                       sliding_window=None),
    # mixtures of experts, as their released config.json files give them
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                          mlp_only_layers=[], vocab_size=151936, rope_theta=1000000.0, max_position_embeddings=40960,
                          tie_word_embeddings=False),
    "gpt-oss-20b": dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                        num_experts_per_tok=4, sliding_window=128, vocab_size=201088, max_position_embeddings=131072,
                        layer_types=["sliding_attention", "full_attention"] * 12, attention_bias=True,
                        tie_word_embeddings=False),
    "mixtral-8x7b": dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                         vocab_size=32000, rope_theta=1000000.0, sliding_window=None, tie_word_embeddings=False),
    "olmoe-1b-7b": dict(model_type="olmoe", hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
                        num_attention_heads=16, num_key_value_heads=16, num_experts=64, num_experts_per_tok=8,
                        vocab_size=50304, max_position_embeddings=4096, tie_word_embeddings=False),
}


def preset_config(name: str, layers: int | None = None, **overrides) -> PretrainedConfig:
    """A transformers config of the named shape (max_position_embeddings 32k unless given), cut to its first
    `layers` layers when given (or `num_hidden_layers` among the overrides, as `model.overrides` gives it)."""
    if name not in PRESETS:
        raise ConfigError(f"model.preset: unknown preset '{name}'; choose one of {sorted(PRESETS)}")
    layers = overrides.pop("num_hidden_layers", layers)
    kw = {"max_position_embeddings": 32768, **PRESETS[name], **overrides}
    if layers is not None:
        kw = cut_layers(kw, layers)
    return AutoConfig.for_model(kw.pop("model_type"), **kw)


def cut_config(config: PretrainedConfig, layers: int) -> PretrainedConfig:
    """`config` (a local model's) cut to its first `layers` layers, as `preset_config` cuts a preset."""
    kw = config.to_dict()
    return AutoConfig.for_model(kw.pop("model_type"), **cut_layers(kw, layers))


def cut_layers(kw: dict, layers: int) -> dict:
    """Config fields `kw` with its first `layers` layers: the count, and every per-layer list (GPT-OSS's
    `layer_types`) cut to as many entries."""
    total = kw["num_hidden_layers"]
    if not 1 <= layers <= total:
        raise ConfigError(f"layers {layers} (--layers, model.overrides.num_hidden_layers): the shape has {total} "
                          f"layers; cut it to 1 to {total}")
    return {**{k: v[:layers] if isinstance(v, list) and len(v) == total else v for k, v in kw.items()},
            "num_hidden_layers": layers}
