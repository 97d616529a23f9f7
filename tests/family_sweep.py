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
from tests.family_checks import OPT, documents, packed_micro_batch, reference_step

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
    # windows shorter than a document, so they bite
    sliding_window=4, attention_chunk_size=4, sliding_window_size=4, attention_window_size=4,
    # older and encoder-decoder families' own names
    rotary_dim=4, decoder_attention_heads=4, encoder_attention_heads=4, decoder_ffn_dim=64, encoder_ffn_dim=64,
    decoder_layers=LAYERS, encoder_layers=LAYERS, num_encoder_layers=LAYERS, num_decoder_layers=LAYERS,
)
_DERIVED = ("head_dim",)  # None in some defaults (derived from the hidden size), yet read as it is by the model
_ZEROED = ("dropout", "pdrop", "jitter", "layerdrop")  # training-time noise: the reference must be deterministic

# Per family: what its tiny model needs beyond the scaled sizes (each line says why).
FAMILY_OVERRIDES: dict[str, dict] = {
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},  # one layer of each kind; the default lists 24
    "mamba2": {"num_heads": 8},  # heads x head_dim = expand x hidden
    "reformer": {"is_decoder": True},  # its causal-LM class requires it
    # two hybrid layers, so that they share the one transformer block; its attention is twice the hidden size wide
    "zamba2": {"num_hidden_layers": 4, "layer_types": ["linear_attention", "hybrid"] * 2, "head_dim": 16,
               "attention_head_dim": 16},
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


def tiny_config(model_type: str) -> PretrainedConfig:
    """`model_type`'s default config with every size in `_SIZES` it has scaled down (sub-configs too)."""
    cls = causal_lm_config_class(model_type)
    default = cls()
    kw = _scaled(default)
    for key in getattr(default, "sub_configs", None) or {}:
        sub = getattr(default, key, None)
        if isinstance(sub, PretrainedConfig):
            kw[key] = _scaled(sub)
    kw.update(FAMILY_OVERRIDES.get(model_type, {}))
    return cls(**kw)


def _settable(config: PretrainedConfig, key: str) -> bool:
    """Whether the config takes `key` (some derive it, e.g. Mamba's `layer_types`, or refuse it)."""
    probe = copy.copy(config)
    try:
        setattr(probe, key, getattr(config, key))
    except (AttributeError, NotImplementedError, ValueError, TypeError):
        return False
    return True


def _scaled(config: PretrainedConfig) -> dict:
    kw = {k: v for k, v in _SIZES.items()
          if (getattr(config, k, None) is not None or k in _DERIVED) and hasattr(config, k) and _settable(config, k)}
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


def save_tiny(model_type: str, folder: Path) -> None:
    """A random tiny model of `model_type` written by transformers; saved buffers get random values."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type))
    saved = model.state_dict(keep_vars=True)
    for name, buf in model.named_buffers():
        if name in saved and buf.is_floating_point():
            buf.normal_()
    model.save_pretrained(folder)


def sweep_case(model_type: str, folder: Path) -> Outcome:
    """Build, save, train and compare one model type (see the module docstring)."""
    try:
        save_tiny(model_type, folder)
    except Exception as e:  # noqa: BLE001 - anything transformers raises building its own model
        return Outcome(model_type, "skipped", f"transformers cannot build it tiny: {_short(e)}")
    try:
        engine = StreamingEngine(discover(str(folder)), EngineConfig(device="cpu"), OPT, total_steps=1)
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
            ref_loss, before, ref_state = reference_step(folder, docs)
        except Exception as e:  # noqa: BLE001
            return Outcome(model_type, "skipped", f"transformers' eager model cannot train it on the CPU: {_short(e)}")
        engine.load_pretrained(folder)
        result = engine.train_step([packed_micro_batch(docs)])
        state = {k: v.clone() for k, v in engine.state_dict().items()}
    except Exception as e:  # noqa: BLE001
        return Outcome(model_type, "error", _trace(e))
    finally:
        engine.close()
    problem = _difference(state, before, ref_state, result.loss.item(), ref_loss)
    if problem is None:
        return Outcome(model_type, "matched", "documents run alone" if engine.context.isolate_documents else "")
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
            torch.testing.assert_close(state[name] - before[name], w - before[name], rtol=rtol, atol=atol)
        except AssertionError as e:
            return f"update of {name}: {_short(e)}"
    return None


def _trace(e: BaseException) -> str:
    return f"{_short(e)}\n{traceback.format_exc()}"


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


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

        alone = {t for t, o in outcomes.items() if o.status == "matched" and o.reason}
        matched = ", ".join(f"`{t}`" + ("*" if t in alone else "") for t in by("matched"))
        lines += ["", f"**{mapping}** (`{summary_line(outcomes)}`)", "",
                  f"Trained at parity ({len(by('matched'))}; * each document of a packed row runs alone): {matched}.",
                  "", "| refused `model_type` | why |", "|---|---|"]
        lines += [f"| `{t}` | {short_reason(outcomes[t])} |" for t in by("refused")]
        lines += ["", "| skipped `model_type` | reason outside mt-ray |", "|---|---|"]
        lines += [f"| `{t}` | {short_reason(outcomes[t])} |" for t in by("skipped")]
    return "\n".join([*lines, README_END])


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
