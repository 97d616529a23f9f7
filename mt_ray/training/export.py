"""Exports that generate: the checkpoint's weights with the tokenizer (carrying the chat template the run trained
with), and `generation_config.json` naming the tokens that end a turn, so `generate` stops where that template
ends a response.

`mt-ray export` turns a checkpoint's fp32 master weights into a Hugging Face folder, no engine needed. It says
which step it exported, and a checkpoint that fails its SHA-256 check is refused, unless asked
(`fall_back`) to take the newest one before it that passes.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

from transformers import GenerationConfig, PreTrainedTokenizerBase

from mt_ray.config.run import RunConfig, load_run_config
from mt_ray.data.mm_processor import processor_files
from mt_ray.data.processor import TOKENIZER_TEMPLATE
from mt_ray.data.templates import TEMPLATES
from mt_ray.engine.host_store import plan_layout
from mt_ray.errors import CheckpointError
from mt_ray.models.discovery import ModelSpec
from mt_ray.models.weights import export_hf
from mt_ray.tracking import CheckpointCorruptedError, CheckpointManager
from mt_ray.tracking.ckpt_format import parse_step
from mt_ray.training.model_source import load_model_and_tokenizer
from mt_ray.training.run_dir import RunDir

_PROBE = "mt-ray-end-of-turn-probe"


@dataclass(frozen=True)
class Exported:
    """Where `mt-ray export` wrote the model, and which checkpoint (and step) it came from."""

    folder: Path
    checkpoint: str
    step: int

    def describe(self) -> str:
        return f"exported step {self.step} ({self.checkpoint}) to {self.folder}"


def generation_config(cfg: RunConfig, spec: ModelSpec, tokenizer: PreTrainedTokenizerBase) -> GenerationConfig:
    """The model's own `generation_config.json` (in `model.path`), else one from its config, whose `eos_token_id`
    lists the template's end-of-turn tokens, then the tokenizer's and the model's eos; `pad_token_id` the
    tokenizer's pad (else the first eos)."""
    own = cfg.model.path is not None and (Path(cfg.model.path) / "generation_config.json").is_file()
    generation = (GenerationConfig.from_pretrained(cfg.model.path) if own
                  else GenerationConfig.from_model_config(spec.config.get_text_config()))
    model_eos = generation.eos_token_id if isinstance(generation.eos_token_id, list) else [generation.eos_token_id]
    ends = [tokenizer.convert_tokens_to_ids(w) for w in _stop_words(cfg.data.template, tokenizer)]
    eos = list(dict.fromkeys(i for i in [*ends, tokenizer.eos_token_id, *model_eos]
                             if i is not None and i != tokenizer.unk_token_id))
    generation.eos_token_id = eos[0] if len(eos) == 1 else eos or None
    if generation.pad_token_id is None:
        generation.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos or [None])[0]
    if generation.bos_token_id is None:
        generation.bos_token_id = tokenizer.bos_token_id
    return generation


def trained_tokenizer(cfg: RunConfig, tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """The tokenizer an export writes: a named template the run trained with becomes its `chat_template` (on a copy),
    so `apply_chat_template` at inference writes the turns the model learned, not the tokenizer's own."""
    if cfg.data.template == TOKENIZER_TEMPLATE:
        return tokenizer
    exported = copy.deepcopy(tokenizer)
    exported.chat_template = TEMPLATES[cfg.data.template].jinja
    return exported


def _stop_words(template: str, tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """A named template's stop words; for the tokenizer's own, the special token its template ends a turn with."""
    if template != TOKENIZER_TEMPLATE:
        return list(TEMPLATES[template].stop_words) if template in TEMPLATES else []
    if not tokenizer.chat_template:
        return []
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}],
                                         tokenize=False)
    after = tokenizer.encode(text[text.rfind(_PROBE) + len(_PROBE):], add_special_tokens=False)
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    return [tokenizer.convert_ids_to_tokens(i) for i in after if i in special][:1]


def export_checkpoint(config_path: str, checkpoint: str | None, out: str, fall_back: bool = False) -> Exported:
    """Export `checkpoint` (default: the run's newest) of the configured model; one that fails its check is
    refused, unless `fall_back` takes the newest one before it that passes."""
    cfg = load_run_config(config_path)
    spec, tokenizer = load_model_and_tokenizer(cfg)
    manager = CheckpointManager(RunDir(cfg).checkpoint_config)
    uri = checkpoint or manager.latest()
    if uri is None:
        raise CheckpointError(f"no checkpoint under {manager.config.uri}; train first or pass --checkpoint")
    try:
        tensors, _ = manager.load(uri)
    except CheckpointCorruptedError as e:
        if not fall_back:
            raise CheckpointError(f"{e}; pass --fall-back to export the newest earlier checkpoint that passes its "
                                  "check, or --checkpoint URI for another one") from None
        tensors, uri = _newest_valid_before(manager, uri)
    master = tensors["master"]
    layout = plan_layout(spec, None)
    if master.numel() != layout.total:
        raise CheckpointError(f"checkpoint holds {master.numel()} parameters, the configured model {layout.total}")
    state = {}
    for unit in spec.units:
        off = layout.offsets[unit.name]
        for p in unit.params:
            state[p.hf_name] = master[off : off + p.numel].view(p.shape)
            off += p.numel
    extra = processor_files(cfg.model.path) if spec.vision is not None else ()
    folder = export_hf(spec, state, out, trained_tokenizer(cfg, tokenizer), extra_files=extra,
                       generation=generation_config(cfg, spec, tokenizer))
    return Exported(folder, uri, manager.read_meta(uri)["step"])


def _newest_valid_before(manager: CheckpointManager, uri: str) -> tuple[dict, str]:
    """The tensors and URI of the newest checkpoint of this run before `uri` that passes its check."""
    step = parse_step(uri.rstrip("/").rsplit("/", 1)[-1]) or 0
    problems = []
    for info in reversed(manager.list()):
        if info.step < step:
            try:
                return manager.load(info.uri)[0], info.uri
            except CheckpointCorruptedError as e:
                problems.append(str(e))
    raise CheckpointError(f"no checkpoint before step {step} passes its check either" +
                          (": " + "; ".join(problems) if problems else ""))
