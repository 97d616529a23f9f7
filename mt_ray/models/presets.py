"""Built-in model shapes: the demo model, and public checkpoints' shapes for random-init runs.

The shapes match the public configs (Qwen2.5, Llama-3.1, Mistral); nothing is downloaded:
a run that names a preset and no `model.path` trains a random-initialised model of that shape.
"""

from __future__ import annotations

from transformers import AutoConfig, PretrainedConfig

from mt_ray.errors import ConfigError

PRESETS: dict[str, dict] = {
    "tiny": dict(model_type="qwen2", hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=832, tie_word_embeddings=True,
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
}


def preset_config(name: str, **overrides) -> PretrainedConfig:
    """A transformers config of the named shape (max_position_embeddings 32k unless given)."""
    if name not in PRESETS:
        raise ConfigError(f"model.preset: unknown preset '{name}'; choose one of {sorted(PRESETS)}")
    kw = {"max_position_embeddings": 32768, **PRESETS[name], **overrides}
    return AutoConfig.for_model(kw.pop("model_type"), **kw)
