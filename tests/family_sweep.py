"""Every model type of an installed transformers mapping, built tiny and trained one step: its outcome.

`tiny_config(model_type)` scales the family's own default config down (sizes, layers, experts, vocabulary)
and keeps its switches as they are, bar the few a tiny model needs (`FAMILY_OVERRIDES`). `sweep_case` then
saves it with `save_pretrained`, loads it with `load_pretrained`, trains one step on packed rows of unequal
documents and compares with transformers' eager model trained on each document alone, and says which of
the four outcomes it is: matched, refused by name (mt-ray's own error, naming the model type), skipped
(transformers itself cannot build or train it tiny on the CPU, or a package is absent) or failed.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import tempfile
import traceback
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
)

from mt_ray.engine import EngineConfig, StreamingEngine
from mt_ray.errors import ConfigError, ModelNotSupportedError
from mt_ray.models.discovery import discover
from tests.family_checks import OPT, documents, packed_micro_batch, reference_step, shifts_labels

# What a matched outcome's reason notes (a mark each in the README's table).
ALONE = "documents run alone"
UNSHIFTED = "its own forward's loss is unshifted: scored on next-token prediction"
SWEEP_VOCAB = 128  # documents draw ids below 96 (tests.tiny_models.VOCAB): special and image ids sit above
LAYERS = 2

# Sizes every family is scaled down to, set where its config has the field and the default is not None
# (None means the feature is off, and stays off).
_SIZES: dict[str, object] = dict(
    vocab_size=SWEEP_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
    num_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64, n_positions=64,
    initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    # mixtures of experts
    num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4, num_experts_per_tok=2,
    moe_topk=2, moe_k=2, num_experts_per_token=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
    moe_shared_expert_intermediate_size=16, expert_ffn_hidden_size=16, n_shared_experts=1, num_shared_experts=1,
    moe_num_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, num_expert_group=1,
    # low-rank (MLA) attention and sparse-attention indexers
    kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, index_head_dim=8,
    index_n_heads=2,
    # linear attention, Mamba and convolutions
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
    linear_conv_kernel_dim=4, linear_num_heads=4, linear_head_dim=8, mamba_d_state=8, mamba_n_heads=4,
    mamba_d_head=8, mamba_chunk_size=8, mamba_d_ssm=32, mamba_headdim=8, mamba_head_dim=8, mamba_num_heads=4,
    mamba_expand=1, mamba_n_groups=1, mamba_ngroups=1, n_groups=1, state_size=8, ssm_state_size=8, chunk_size=8, time_step_rank=8,
    mamba_dt_rank=8,
    # per-layer input embeddings (Gemma 3n, Gemma 4)
    vocab_size_per_layer_input=SWEEP_VOCAB, hidden_size_per_layer_input=8,
    # windows and sparse-attention top-k shorter than a document, so they bite
    sliding_window=4, attention_chunk_size=4, sliding_window_size=4, attention_window_size=4, index_topk=4,
    floor_scale=4,  # Llama 4's attention-temperature floor (8192 in the default): past it the scale changes
    # older and encoder-decoder families' own names
    rotary_dim=4, decoder_attention_heads=4, encoder_attention_heads=4, decoder_ffn_dim=64, encoder_ffn_dim=64,
    decoder_layers=LAYERS, encoder_layers=LAYERS, num_encoder_layers=LAYERS, num_decoder_layers=LAYERS,
)
_DERIVED = ("head_dim",)  # None in some defaults (derived from the hidden size), yet read as it is by the model
_ZEROED = ("dropout", "pdrop", "jitter", "layerdrop", "drop_path")  # training-time noise (stochastic depth too): the reference must be deterministic

# Gemma 4's global layers have their own head width (per-layer config), 512 in the default
_GEMMA4_TEXT = dict(head_dim=8, global_head_dim=16, layer_types=["sliding_attention", "full_attention"])
# Gemma 4's vision tower (None in the default config, so no tower at all; the released checkpoints have one), pooling
# 2x2 patches into a token; a 64-entry position table per axis
GEMMA4_VISION = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=2, head_dim=8, patch_size=4, pooling_kernel_size=2,
                     position_embedding_size=64)
# Gemma 4 Unified's encoder-free image embedder (None in the default too) on 4x4 patches, 2x2 merged from 2x2-pixel
# ones, its width the projection's input
GEMMA4_UNIFIED_VISION = dict(model_type="gemma4_unified_vision", patch_size=2, pooling_kernel_size=2, mm_embed_dim=16,
                             output_proj_dims=16, mm_posemb_size=16)
# a drafter on a Gemma 4 text model without per-layer inputs (the default has no text config)
_GEMMA4_ASSISTANT = dict(backbone_hidden_size=32, num_centroids=8, centroid_intermediate_top_k=2, text_config=dict(
    model_type="gemma4_text", vocab_size=SWEEP_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, sliding_window=4,
    hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, **_GEMMA4_TEXT))
# the sparse-attention indexer is off (None) in the default but its layers are built with it
_QWEN4_EXP = dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=4,
                  indexer_compress_ratio=2, hc_lowrank=8, split_ngram_parts=4)
# rotary halves of 8-wide heads (the default's [22, 22, 20] fits 128)
_COMPASS_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]},
                 "full_attention": None}

# Per family: what its tiny model needs beyond the scaled sizes (each line says why).
FAMILY_OVERRIDES: dict[str, dict] = {
    # released checkpoints carry the rope_theta and clip_qkv its attention reads (the default lacks them);
    # and the experts' width follows d_model as the config is built, before hidden_size is mapped onto it
    "dbrx": {"d_model": 32, "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
             "ffn_config": {"ffn_hidden_size": 64, "moe_top_k": 2}},
    "blt": {"encoder_hash_byte_group_vocab": 64},  # 500,002 hashed n-gram rows in the default: slow to build
    "deepseek_v2": {"num_experts_per_tok": 2},  # None in the default, read as the router's top-k
    "dots1": {"n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2},  # None in the default
    # a sliding layer with rotary positions and a NoPE global layer, as the released checkpoint has
    "cohere_compass_text": {"layer_types": ["sliding_attention", "full_attention"], "rope_parameters": _COMPASS_ROPE},
    # the last two layers reuse the keys and values of the last sliding and global layer before them; the
    # sparsity pattern has one entry per layer and AltUp one prediction per input
    "gemma3n_text": {"layer_types": ["sliding_attention", "full_attention"] * 2, "num_hidden_layers": 4,
                     "num_kv_shared_layers": 2, "laurel_rank": 4, "altup_num_inputs": 2,
                     "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0], "intermediate_size": 64},
    "gemma4": {"text_config": _GEMMA4_TEXT, "vision_config": GEMMA4_VISION},
    "gemma4_assistant": _GEMMA4_ASSISTANT,
    "gemma4_text": _GEMMA4_TEXT,
    "gemma4_unified": {"text_config": _GEMMA4_TEXT, "vision_config": GEMMA4_UNIFIED_VISION},
    "gemma4_unified_assistant": {**_GEMMA4_ASSISTANT, "text_config": {
        **_GEMMA4_ASSISTANT["text_config"], "model_type": "gemma4_unified_text"}},
    "gemma4_unified_text": _GEMMA4_TEXT,
    # the second layer reuses the first one's top-k keys (handed on from layer to layer), so that path runs
    "glm_moe_dsa": {"indexer_types": ["full", "shared"]},
    "hy_v4": {"indexer_types": ["full", "shared"]},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},  # one layer of each kind; the default lists 24
    # a short-convolution layer, then an attention layer with experts (layer kinds are None in the default)
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "lfm2": {"layer_types": ["conv", "full_attention"]},  # the default is all attention; LFM2's checkpoints are not
    # a NoPE layer, whose attention temperature (past `floor_scale`) follows the token's index in the row
    "llama4_text": {"no_rope_layers": [1, 0]},
    "mamba2": {"num_heads": 8},  # heads x head_dim = expand x hidden
    "nemotron": {"num_key_value_heads": 2},  # None in the default, read as a number
    "qwen4_exp": _QWEN4_EXP,
    "qwen4_exp_text": _QWEN4_EXP,
    # an encoder family's causal-LM class is a decoder only with is_decoder (as a user loading it for causal LM sets it)
    **dict.fromkeys(["bert", "bert-generation", "camembert", "data2vec-text", "electra", "ernie",
                     "megatron-bert", "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer",
                     "xlm-roberta", "xlm-roberta-xl"], {"is_decoder": True}),
    # block-sparse attention (the default) is refused; its causal LM trains with full attention
    "big_bird": {"is_decoder": True, "attention_type": "original_full"},
    # and its adapters need a language when the input names none
    "xmod": {"is_decoder": True, "default_language": "en_XX"},
    # its causal-LM class requires is_decoder; axial position embeddings must sum to the hidden size
    "reformer": {"is_decoder": True, "axial_pos_embds_dim": [16, 16], "axial_pos_shape": [8, 8],
                 "attention_head_size": 8, "feed_forward_size": 64, "attn_layers": ["local", "lsh"],
                 "local_attn_chunk_length": 4, "lsh_attn_chunk_length": 4, "num_buckets": 2},
    "xlnet": {"d_head": 8, "d_inner": 64},  # d_model / n_head, fixed at 64 in the default
    "zaya": {"num_experts_per_tok": 1, "router_hidden_size": 8},  # transformers builds top-1 routing only
    # two hybrid layers, so that they share the one transformer block
    "zamba": {"num_hidden_layers": 4, "layer_types": ["linear_attention", "hybrid"] * 2},
    # two hybrid layers, so that they share the one transformer block; its attention is twice the hidden size wide;
    # the Mamba heads span its inner width and the hybrid layers are listed (the config derives both from the
    # default's sizes)
    "zamba2": {"num_hidden_layers": 4, "layer_types": ["linear_attention", "hybrid"] * 2, "head_dim": 16,
               "attention_head_dim": 16, "n_mamba_heads": 4, "hybrid_layer_ids": [1, 3]},
}


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One model type's result: `status` is matched, refused, skipped, error or mismatch; `reason` says why."""

    model_type: str
    status: str
    reason: str = ""


def causal_lm_config_class(model_type: str) -> type[PretrainedConfig]:
    """The config class the mapping's causal-LM class takes (Emu3's is its text config, not the composite)."""
    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]).config_class


def tiny_config(model_type: str, **overrides) -> PretrainedConfig:
    """`model_type`'s default config with every size in `_SIZES` it has scaled down (sub-configs too), then its
    `FAMILY_OVERRIDES` and `overrides` set."""
    cls = causal_lm_config_class(model_type)
    default = cls()
    kw = _scaled(default)
    for key in getattr(default, "sub_configs", None) or {}:
        sub = getattr(default, key, None)
        if isinstance(sub, PretrainedConfig):
            kw[key] = _scaled(sub)
    for key, value in {**FAMILY_OVERRIDES.get(model_type, {}), **overrides}.items():  # a sub-config's overrides join its sizes
        kw[key] = {**kw[key], **value} if isinstance(value, dict) and isinstance(kw.get(key), dict) else value
    return cls(**kw)


def _settable(config: PretrainedConfig, key: str) -> bool:
    """Whether the config takes `key` (some derive it, e.g. Mamba's `layer_types`, or refuse it)."""
    probe = copy.copy(config)
    try:
        setattr(probe, key, _value(config, key))
    except (AttributeError, NotImplementedError, ValueError, TypeError):
        return False
    return True


def _value(config: PretrainedConfig, key: str, missing: object = None) -> object:
    """`config.key`, or `missing` where the config has no global value (Gemma 4's per-layer head_dim)."""
    try:
        return getattr(config, key)
    except Exception:  # noqa: BLE001 - AttributeError, or transformers' AmbiguousGlobalPerLayerAttributeError
        return missing


def _scaled(config: PretrainedConfig) -> dict:
    absent = object()
    kw = {k: v for k, v in _SIZES.items()
          if _value(config, k, absent) is not absent and (_value(config, k) is not None or k in _DERIVED)
          and _settable(config, k)}
    if getattr(config, "kv_lora_rank", None) is not None:  # MLA: every head has its own keys and values
        kw["num_key_value_heads"] = kw["num_attention_heads"]
    for k, v in config.to_dict().items():
        if any(z in k for z in _ZEROED) and isinstance(v, float):
            kw[k] = 0.0
        elif (k.endswith(("_token_id", "_token_index")) and isinstance(v, int)
              and k not in ("pad_token_id", "bos_token_id", "eos_token_id")):
            kw[k] = SWEEP_VOCAB - 1
    types = getattr(config, "layer_types", None)
    if isinstance(types, list) and types and _settable(config, "layer_types"):
        kinds = list(dict.fromkeys(types))  # each kind of layer once, in the family's order
        layers = kinds * (max(LAYERS, len(kinds)) // len(kinds)) if len(kinds) <= LAYERS else kinds
        kw["num_hidden_layers"], kw["layer_types"] = len(layers), layers
    return kw


def save_tiny(model_type: str, folder: Path, **overrides) -> None:
    """A random tiny model of `model_type` (its config's fields set to `overrides` beyond `tiny_config`) written by
    transformers; saved buffers get random values."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides))
    saved = model.state_dict(keep_vars=True)
    for name, buf in model.named_buffers():
        if name in saved and buf.is_floating_point():
            buf.normal_()
    model.save_pretrained(folder)


def sweep_case(model_type: str, folder: Path, device: str = "cpu", tolerances: dict | None = None,
               **engine_kw) -> Outcome:
    """Build, save, train and compare one model type (see the module docstring), on `device` with the engine's
    default settings bar `engine_kw`; `tolerances` are `_difference`'s (tests/gpu/test_families_cuda.py's)."""
    try:
        save_tiny(model_type, folder)
    except Exception as e:  # noqa: BLE001 - anything transformers raises building its own model
        return Outcome(model_type, "skipped", f"transformers cannot build it tiny: {_short(e)}")
    try:
        engine = StreamingEngine(discover(str(folder)), EngineConfig(device=device, **engine_kw), OPT, total_steps=1)
    except (ModelNotSupportedError, ConfigError) as e:
        named = {model_type, json.loads((folder / "config.json").read_text())["model_type"]}  # GPT-SW3 saves 'gpt2'
        if not any(f"'{n}'" in str(e) for n in named):
            return Outcome(model_type, "error", f"refused without naming the model type: {e}")
        return Outcome(model_type, "refused", str(e))
    except Exception as e:  # noqa: BLE001
        return Outcome(model_type, "error", _trace(e))
    try:
        docs = documents()
        try:
            ref_loss, before, ref_state = reference_step(folder, docs, device)
        except Exception as e:  # noqa: BLE001
            return Outcome(model_type, "skipped", f"transformers' eager model cannot train it on the CPU: {_short(e)}")
        engine.load_pretrained(folder)
        result = engine.train_step([packed_micro_batch(docs)])
        state = {k: v.clone() for k, v in engine.state_dict().items()}
    except Exception as e:  # noqa: BLE001
        return Outcome(model_type, "error", _trace(e))
    finally:
        engine.close()
    problem = _difference(state, before, ref_state, result.loss.item(), ref_loss, **(tolerances or {}))
    if problem is None:
        notes = [ALONE] if engine.context.isolate_documents else []
        notes += [] if shifts_labels(getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])) else [UNSHIFTED]
        return Outcome(model_type, "matched", "; ".join(notes))
    if _eager_and_sdpa_disagree(folder, docs):
        return Outcome(model_type, "skipped", "transformers' own eager and SDPA attention compute different losses "
                       "for it (no reference to train against)")
    return Outcome(model_type, "mismatch", problem)


def _eager_and_sdpa_disagree(folder: Path, docs) -> bool:
    """Moshi's eager attention is not causal without an attention mask; its SDPA attention is."""
    losses = []
    for backend in ("eager", "sdpa"):
        try:
            model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation=backend).float()
        except ValueError:  # a family without SDPA: nothing to disagree with
            return False
        with torch.no_grad():
            d = docs[0]
            losses.append(model(input_ids=torch.tensor([d.input_ids]), labels=torch.tensor([d.labels])).loss.item())
    return abs(losses[0] - losses[1]) > 1e-5 * abs(losses[1])


def _difference(state, before, ref_state, loss, ref_loss, rel=1e-5, rtol=1e-4, atol=3e-7) -> str | None:
    if abs(loss - ref_loss) > rel * abs(ref_loss):
        return f"loss {loss} != reference {ref_loss}"
    for name, w in ref_state.items():
        if name not in state:
            continue  # a tied head is the embedding
        try:
            if before[name].isfinite().all():
                torch.testing.assert_close(state[name] - before[name], w - before[name], rtol=rtol, atol=atol)
            else:  # an unbounded clip of Gemma 4's towers (no update: inf - inf is nan), equal as it is
                torch.testing.assert_close(state[name], w, rtol=0, atol=0)
        except AssertionError as e:
            return f"update of {name}: {_short(e)}"
    return None


def _trace(e: BaseException) -> str:
    return f"{_short(e)}\n{traceback.format_exc()}"


def _short(e: BaseException) -> str:
    """The exception's type and first line of text (transformers' ImportError opens with an empty line)."""
    lines = [line for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


# Every outcome of this session, by mapping name ("causal-LM", "image-text"), for the summary line
# (tests/conftest.py) and the README table (`families_table`).
RESULTS: dict[str, dict[str, Outcome]] = {}

README_START = "<!-- families table: generated by `python -m tests.family_sweep`; do not edit -->"
README_END = "<!-- end of the families table -->"


def outcome_of(mapping: str, model_type: str, run) -> Outcome:
    """`run(model_type)`'s outcome, computed once per session."""
    found = RESULTS.setdefault(mapping, {})
    if model_type not in found:
        found[model_type] = run(model_type)
    return found[model_type]


def run_in_tmp(model_type: str) -> Outcome:
    with tempfile.TemporaryDirectory() as folder:
        return sweep_case(model_type, Path(folder))


def summary_line(outcomes: dict[str, Outcome]) -> str:
    n = {s: sum(o.status == s for o in outcomes.values()) for s in ("matched", "refused", "skipped", "error", "mismatch")}
    return (f"{n['matched']} matched, {n['refused']} refused by name, {n['skipped']} skipped (reasons listed), "
            f"{n['error']} errors, {n['mismatch']} mismatches")


def short_reason(outcome: Outcome) -> str:
    """The reason's first clause, without the model type it names (one line of the table)."""
    text = outcome.reason.splitlines()[0] if outcome.reason else ""
    text = re.sub(r"^'[^']+'(: | )", "", text)
    text = re.sub(r"; this (image-text )?family cannot be trained yet$", "", text)
    return text.replace("|", "/")


def families_table(mappings: dict[str, dict[str, Outcome]]) -> str:
    """The README's families section between its markers, from the sweep's outcomes."""
    lines = [README_START]
    for mapping, outcomes in mappings.items():
        def by(status: str, outcomes: dict[str, Outcome] = outcomes) -> list[str]:
            return sorted(t for t, o in outcomes.items() if o.status == status)

        matched = ", ".join(f"`{t}`" + _marks(outcomes[t]) for t in by("matched"))
        lines += ["", f"**{mapping}** (`{summary_line(outcomes)}`)", "",
                  f"Trained at parity ({len(by('matched'))}; * each document of a packed row runs alone; † its "
                  "causal-LM class's own loss does not shift the labels, so it is checked on next-token prediction, "
                  f"transformers' `ForCausalLMLoss` of its logits): {matched}.",
                  "", "| refused `model_type` | why |", "|---|---|"]
        lines += [f"| `{t}` | {short_reason(outcomes[t])} |" for t in by("refused")]
        lines += ["", "| skipped `model_type` | reason outside mt-ray |", "|---|---|"]
        lines += [f"| `{t}` | {short_reason(outcomes[t])} |" for t in by("skipped")]
    return "\n".join([*lines, README_END])


def _marks(outcome: Outcome) -> str:
    return ("*" if ALONE in outcome.reason else "") + ("†" if UNSHIFTED in outcome.reason else "")


def readme_table(readme: Path) -> str:
    text = readme.read_text()
    return text[text.index(README_START):text.index(README_END) + len(README_END)]


def write_readme(readme: Path, table: str) -> None:
    text = readme.read_text()
    readme.write_text(text.replace(readme_table(readme), table))


if __name__ == "__main__":  # python -m tests.family_sweep: rewrite the README's table from a fresh sweep
    from tests.vlm_sweep import IMAGE_TEXT, image_text_outcome  # noqa: PLC0415 - only the writer needs both

    torch.set_num_threads(1)
    results = {"causal-LM": {t: run_in_tmp(t) for t in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)},
               IMAGE_TEXT: {t: image_text_outcome(t) for t in sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)}}
    write_readme(Path(__file__).resolve().parents[1] / "README.md", families_table(results))
    for name, outcomes in results.items():
        print(f"{name}: {summary_line(outcomes)}")
