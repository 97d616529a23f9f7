"""A LLaMA-Factory training YAML, read as it is: each of its arguments mapped to mt-ray's keys, or refused.

LLaMA-Factory's YAML is one flat mapping of its arguments (`model_name_or_path`, `stage`, `cutoff_len`,
`per_device_train_batch_size`, ...); mt-ray's has sections. A file whose top level holds a LLaMA-Factory
argument is translated here into mt-ray's values; mt-ray sections in the same file, and `key=value`
overrides, apply on top. Every argument is one of three things, each shown once by `describe_mapping`:

- mapped: it sets mt-ray keys with the same meaning (`cutoff_len` -> `data.max_seq_len`);
- not needed: it tunes something mt-ray does its own way and changes nothing that is learned
  (`deepspeed`, `gradient_checkpointing`, `preprocessing_num_workers`);
- refused, in one line saying why: what it asks for has no equivalent (`finetuning_type: lora`,
  `pure_bf16`), so training on would not be the training the file describes.

Where LLaMA-Factory's default differs from mt-ray's (`cutoff_len` 2048, `packing` off for sft/dpo/kto,
3 epochs, a linear schedule, fp32 compute unless `bf16`), an absent argument takes LLaMA-Factory's default.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

from mt_ray.errors import ConfigError

Assignments = list[tuple[str, Any]]
Rule = Callable[[Any, dict[str, Any]], "Assignments | str"]
"""A value (and the whole file) -> mt-ray keys to set, or a sentence saying why nothing needs setting."""

_FULL = ("mt-ray trains every weight at full precision (fp32 master weights and Adam state in host memory); "
         "use finetuning_type: full")
_STREAMING = ("mt-ray keeps the fp32 master weights and Adam state in host memory and streams the layers through "
              "the GPU itself (ZeRO-3 with offload's part); cluster.num_workers spreads a step over GPUs")


class Refused(Exception):
    """An argument mt-ray cannot honour; the message says why."""


def to(*keys: str, convert: Callable[[Any], Any] = lambda v: v) -> Rule:
    """Set each of `keys` to the (converted) value."""
    return lambda value, _: [(k, convert(value)) for k in keys]


def unused(why: str) -> Rule:
    return lambda value, _: why


def refused(why: str) -> Rule:
    def rule(value: Any, _: dict[str, Any]) -> Assignments:
        raise Refused(why)
    return rule


def only(accepted: Any, why_unused: str, why_refused: str) -> Rule:
    """`accepted` (a value, or a tuple of them) needs nothing; any other value is refused."""
    ok = accepted if isinstance(accepted, tuple) else (accepted,)

    def rule(value: Any, _: dict[str, Any]) -> str:
        if value not in ok:
            raise Refused(why_refused)
        return why_unused
    return rule


def _stage(value: Any, _: dict[str, Any]) -> Assignments:
    if value in ("sft", "dpo", "kto"):
        return [("training.stage", value)]
    why = {"pt": "LLaMA-Factory's pt joins documents into rows that attend across them (packing, its pt default) or "
                 "truncates each at cutoff_len, and mt-ray does neither; pre-train with an mt-ray config instead: "
                 "training.stage: sft on text datasets (columns: {prompt: text}) trains every token of each document, "
                 "cut into rows of data.max_seq_len",
           "rm": "reward-model training has no equivalent", "ppo": "PPO has no equivalent; mt-ray runs GRPO (its "
           "own YAML, training.stage: grpo)"}.get(value, "mt-ray trains sft, dpo and kto from LLaMA-Factory files")
    raise Refused(why)


def _output_dir(value: Any, _: dict[str, Any]) -> Assignments:
    """`saves/qwen3-4b/full/sft`: the run's folder, i.e. storage `saves/qwen3-4b/full`, run name `sft`."""
    path = PurePosixPath(str(value))
    return [("training.storage", str(path.parent)), ("training.run_name", path.name)]


def _epochs(value: Any, file: dict[str, Any]) -> Assignments | str:
    if (file.get("max_steps") or -1) > 0:
        return "max_steps is given, and wins, as in transformers"
    return [("training.epochs", float(value))]


def _max_steps(value: Any, _: dict[str, Any]) -> Assignments | str:
    return [("training.steps", int(value))] if value and value > 0 else "-1: the length comes from num_train_epochs"


def _warmup_ratio(value: Any, file: dict[str, Any]) -> Assignments | str:
    if file.get("warmup_steps"):
        return "warmup_steps is given, and wins, as in transformers"
    return [("optimizer.warmup_ratio", float(value))] if value else "no warmup"


def _schedule(value: Any, file: dict[str, Any]) -> Assignments:
    warm = file.get("warmup_steps") or file.get("warmup_ratio")
    mapped = {"cosine": "cosine", "linear": "linear", "constant_with_warmup": "constant"}.get(value)
    if value == "constant" and not warm:
        mapped = "constant"
    if mapped is None:
        raise Refused("mt-ray's schedules are linear, cosine and constant_with_warmup (constant without warmup)")
    return [("optimizer.schedule", mapped)]


def _betas(index: int) -> Rule:
    def rule(value: Any, file: dict[str, Any]) -> Assignments:
        betas = [file.get("adam_beta1", 0.9), file.get("adam_beta2", 0.999)]
        betas[index] = value
        return [("optimizer.betas", betas)]
    return rule


def _packing(value: Any, file: dict[str, Any]) -> Assignments:
    """LLaMA-Factory turns packing on for neat_packing."""
    value = bool(value) or bool(file.get("neat_packing"))
    if value and not file.get("neat_packing"):
        raise Refused("mt-ray packs with each example attending only to itself (LLaMA-Factory's neat_packing); "
                      "add neat_packing: true, or set packing: false")
    return [("data.packing", bool(value))]


def _precision(dtype: str) -> Rule:
    def rule(value: Any, file: dict[str, Any]) -> Assignments | str:
        if value:
            return [("engine.compute_dtype", dtype)]
        other = "fp16" if dtype == "bf16" else "bf16"
        return f"{other} sets the compute dtype" if file.get(other) else [("engine.compute_dtype", "fp32")]
    return rule


def _report_to(value: Any, _: dict[str, Any]) -> Assignments:
    targets = [value] if isinstance(value, str) else list(value or ["none"])
    if targets == ["none"]:
        return [("tracking.enabled", False)]
    if set(targets) <= {"mlflow", "all"}:
        return [("tracking.enabled", True)]
    raise Refused("mt-ray logs to MLflow (tracking.*); use report_to: mlflow or none")


def _eval_strategy(value: Any, file: dict[str, Any]) -> Assignments | str:
    if value == "no":
        return "no evaluation during training (a run with val_size or eval_dataset is still scored at its end)"
    if value == "steps" and file.get("eval_steps"):
        return [("training.eval_every", int(file["eval_steps"]))]
    raise Refused("mt-ray evaluates every eval_steps steps; use eval_strategy: steps with eval_steps")


def _save_strategy(value: Any, _: dict[str, Any]) -> Assignments | str:
    if value == "steps":
        return "checkpoints every save_steps steps"
    if value == "no":
        return [("checkpoint.every_steps", None)]
    raise Refused("mt-ray checkpoints every save_steps steps; use save_strategy: steps")


def _resume(value: Any, file: dict[str, Any]) -> Assignments | str:
    """`true`: the run's newest checkpoint, which mt-ray's `auto` resumes; `<output_dir>/checkpoint-N`, the name
    transformers' Trainer gives step N's checkpoint: the same step of the mt-ray run in that output_dir."""
    if value is None or value is False:
        return "mt-ray continues a run of the same config from its newest checkpoint (training.resume: auto)"
    if value is True:
        return [("training.resume", "auto")]
    path = PurePosixPath(str(value))
    step = re.fullmatch(r"checkpoint-(\d+)", path.name)
    output_dir = PurePosixPath(str(file.get("output_dir", "")))
    if step is None or path.parent != output_dir:
        raise Refused("mt-ray resumes its own checkpoints (<output_dir>/checkpoints/step-NNNNNNNN), not a transformers "
                      "Trainer's; use resume_from_checkpoint: true for this output_dir's newest, or "
                      f"model_name_or_path: {value} to start a new run from its weights")
    checkpoint = f"{output_dir}/checkpoints/step-{int(step.group(1)):08d}"
    if not checkpoint.startswith("s3://") and not Path(checkpoint).is_dir():
        raise Refused(f"this output_dir's run has no checkpoint at step {int(step.group(1))} ({checkpoint}); use "
                      "resume_from_checkpoint: true for its newest")
    return [("training.resume", checkpoint)]


def _overwrite(value: Any, file: dict[str, Any]) -> Assignments | str:
    """transformers starts over in a used output_dir only when told to; mt-ray never deletes a run, so `true` starts
    a run only where output_dir holds no checkpoints (`training.resume: never` refuses one that does, by name)."""
    if not value:
        return "mt-ray continues a run of the same config and refuses another config under the same output_dir"
    if file.get("resume_from_checkpoint"):
        return "resume_from_checkpoint is given, and wins, as in transformers"
    return [("training.resume", "never")]


def _attention(value: Any, _: dict[str, Any]) -> Assignments:
    mapped = {"auto": "auto", "sdpa": "sdpa", "fa2": "flash_attention_2", "disabled": "eager"}.get(value)
    if mapped is None:
        raise Refused("use one of auto, sdpa, fa2, disabled")
    return [("engine.attn_implementation", mapped)]


def _weights(value: Any, _: dict[str, Any]) -> Assignments:
    probs = [float(p) for p in value.split(",")] if isinstance(value, str) else list(value)
    return [("data.weights", probs)]


_LORA = unused("only read with finetuning_type: lora")
_VIDEO = unused("mt-ray trains on images; a row with videos is refused")
_NOT_LEARNED = "how many processes prepare the data; mt-ray tokenizes ahead of the steps in a background thread"

RULES: dict[str, Rule] = {
    # model
    "model_name_or_path": to("model.path"),
    "trust_remote_code": unused("mt-ray runs the model classes transformers ships, never a model's own code"),
    "use_fast_tokenizer": unused("transformers' fast tokenizer is loaded where the model has one"),
    "cache_dir": unused("nothing is downloaded: model_name_or_path is a local folder"),
    "image_max_pixels": to("data.image_max_pixels", convert=int),
    "image_min_pixels": to("data.image_min_pixels", convert=int),
    "video_max_pixels": _VIDEO,
    "video_min_pixels": _VIDEO,
    "video_fps": _VIDEO,
    "video_maxlen": _VIDEO,
    "use_reentrant_gc": unused("the engine recomputes blocks of engine.checkpoint_every layers without torch's "
                               "checkpointing"),
    "flash_attn": _attention,
    "enable_liger_kernel": lambda v, _: [("engine.kernels", "liger")] if v else "torch's kernels",
    "adapter_name_or_path": refused("LoRA adapters have no equivalent: " + _FULL),
    "quantization_bit": refused("quantized training has no equivalent: " + _FULL),
    "resize_vocab": only(False, "the vocabulary stays as the model has it",
                         "resizing the vocabulary has no equivalent yet"),
    # method
    "stage": _stage,
    "do_train": only(True, "mt-ray train trains", "mt-ray train trains; drop do_train: false"),
    "do_eval": only(False, "no separate evaluation run", "evaluation runs during training: use val_size or "
                    "eval_dataset with eval_strategy: steps"),
    "do_predict": only(False, "no prediction run", "prediction has no equivalent in mt-ray train"),
    "finetuning_type": only("full", "every weight is trained (full)", _FULL),
    "lora_rank": _LORA, "lora_alpha": _LORA, "lora_dropout": _LORA, "lora_target": _LORA,
    "additional_target": _LORA, "loraplus_lr_ratio": _LORA, "use_dora": _LORA, "use_rslora": _LORA,
    "pissa_init": _LORA, "create_new_adapter": _LORA,
    "freeze_vision_tower": to("model.freeze_vision_tower", convert=bool),
    "freeze_multi_modal_projector": to("model.freeze_multi_modal_projector", convert=bool),
    "freeze_language_model": only(False, "the language model is trained", "a frozen language model has no "
                                  "equivalent: " + _FULL),
    "deepspeed": unused(_STREAMING),
    "pref_beta": to("pref.beta", convert=float),
    "pref_loss": to("pref.loss"),
    "pref_ftx": to("pref.ftx", convert=float),
    "dpo_label_smoothing": to("pref.label_smoothing", convert=float),
    "simpo_gamma": to("pref.simpo_gamma", convert=float),
    "kto_chosen_weight": to("pref.kto_chosen_weight", convert=float),
    "kto_rejected_weight": to("pref.kto_rejected_weight", convert=float),
    "pref_bco_weight": only(0.0, "no BCO term", "the BCO term has no equivalent"),
    "ref_model": refused("the reference model is the starting weights (the model being trained), as TRL's "
                         "default; a separate ref_model has no equivalent"),
    # dataset
    "dataset": to("data.datasets"),
    "eval_dataset": to("data.eval_datasets"),
    "dataset_dir": to("data.registry"),
    "template": to("data.template"),
    "cutoff_len": to("data.max_seq_len", convert=int),
    "max_samples": to("data.max_samples", convert=int),
    "val_size": to("data.val_size", convert=float),
    "mix_strategy": to("data.mix_strategy"),
    "interleave_probs": _weights,
    "packing": _packing,
    "neat_packing": unused("read with packing"),
    "preprocessing_num_workers": unused(_NOT_LEARNED),
    "preprocessing_batch_size": unused(_NOT_LEARNED),
    "dataloader_num_workers": unused(_NOT_LEARNED),
    "dataloader_pin_memory": unused(_NOT_LEARNED),
    "dataloader_persistent_workers": unused(_NOT_LEARNED),
    "overwrite_cache": unused("mt-ray keeps no tokenized cache"),
    "streaming": unused("mt-ray reads the files row by row; nothing is loaded whole"),
    "buffer_size": unused("data.shuffle_buffer is mt-ray's shuffle block"),
    "tokenized_path": refused("mt-ray keeps no tokenized copy of the data; drop tokenized_path"),
    "train_on_prompt": only(False, "prompts are masked", "training on prompts has no equivalent yet"),
    "mask_history": only(False, "every turn's response is trained", "mask_history has no equivalent yet"),
    "enable_thinking": only(True, "a reasoning template adds and trains an empty thought, as by default",
                            "use a _nothink template (e.g. qwen3_nothink)"),
    "default_system": refused("has no equivalent yet; put the system prompt in the data (its system column)"),
    "tool_format": refused("has no equivalent yet; use template: tokenizer (the model's own template) for tools"),
    "media_dir": refused("images are read relative to the dataset_info.json's folder; drop media_dir"),
    # output
    "output_dir": _output_dir,
    "logging_steps": to("training.log_every", convert=int),
    "logging_dir": unused("metrics go to MLflow (tracking.*)"),
    "logging_first_step": unused("the first logged step is log_every"),
    "save_steps": to("checkpoint.every_steps", convert=int),
    "save_strategy": _save_strategy,
    "save_total_limit": to("checkpoint.keep_last", convert=int),
    "save_only_model": unused("mt-ray's checkpoints always hold the optimizer state, so a resumed run is exact"),
    "save_safetensors": unused("mt-ray writes safetensors"),
    "plot_loss": unused("MLflow plots the loss (tracking.*)"),
    "overwrite_output_dir": _overwrite,
    "report_to": _report_to,
    "run_name": unused("the run, and its MLflow run, are named after output_dir's last folder"),
    # train
    "per_device_train_batch_size": to("training.micro_batch_size", convert=int),
    "gradient_accumulation_steps": to("training.grad_accum_steps", convert=int),
    "learning_rate": to("optimizer.lr", convert=float),
    "num_train_epochs": _epochs,
    "max_steps": _max_steps,
    "lr_scheduler_type": _schedule,
    "warmup_ratio": _warmup_ratio,
    "warmup_steps": lambda v, _: [("optimizer.warmup_steps", int(v))],
    "weight_decay": to("optimizer.weight_decay", convert=float),
    "adam_beta1": _betas(0),
    "adam_beta2": _betas(1),
    "adam_epsilon": to("optimizer.eps", convert=float),
    "max_grad_norm": to("optimizer.max_grad_norm", convert=float),
    "optim": only(("adamw_torch", "adamw_torch_fused", "adamw_hf"), "AdamW", "mt-ray's optimizer is AdamW "
                  "(adamw_torch)"),
    "bf16": _precision("bf16"),
    "fp16": _precision("fp16"),
    "pure_bf16": only(False, "fp32 master weights", "mt-ray keeps fp32 master weights; drop pure_bf16"),
    "tf32": unused("the engine computes in engine.compute_dtype"),
    "seed": to("training.seed", convert=int),
    "ddp_timeout": unused("multi-GPU runs are Ray workers (cluster.*)"),
    "ddp_find_unused_parameters": unused("multi-GPU runs are Ray workers (cluster.*)"),
    "gradient_checkpointing": unused("the engine recomputes blocks of engine.checkpoint_every layers itself"),
    "gradient_checkpointing_kwargs": unused("the engine recomputes blocks of engine.checkpoint_every layers itself"),
    "resume_from_checkpoint": _resume,
    "per_device_eval_batch_size": unused("evaluation runs micro-batches of per_device_train_batch_size"),
    "eval_strategy": _eval_strategy,
    "evaluation_strategy": _eval_strategy,
    "eval_steps": unused("read with eval_strategy"),
}

# LLaMA-Factory's (transformers') default where it differs from mt-ray's; applied when the file leaves it out.
DEFAULTS: dict[str, Any] = {
    "cutoff_len": 2048, "learning_rate": 5e-5, "num_train_epochs": 3.0, "lr_scheduler_type": "linear",
    "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "seed": 42, "packing": False, "bf16": False,
    "dataset_dir": "data", "save_steps": 500, "warmup_steps": 0,
}


def is_llamafactory(values: dict[str, Any]) -> bool:
    """Whether a YAML's top level holds LLaMA-Factory arguments (mt-ray's holds sections)."""
    return any(key in RULES for key in values)


def translate(values: dict[str, Any], sections: set[str]) -> tuple[dict[str, Any], list[str]]:
    """A LLaMA-Factory file as mt-ray values (its mt-ray `sections` merged on top), and the mapping's lines.

    Raises `ConfigError` naming every argument refused or unknown, each on its line.
    """
    given = {k: v for k, v in values.items() if k not in sections}
    absent = {k: v for k, v in DEFAULTS.items() if k not in given and not (k == "num_train_epochs"
                                                                            and (given.get("max_steps") or -1) > 0)}
    file = {**given, **absent}
    out: dict[str, Any] = {}
    lines, problems = [], []
    for key, value in file.items():
        rule = RULES.get(key)
        if rule is None:
            close = difflib.get_close_matches(key, RULES, n=1, cutoff=0.7)
            problems.append(f"{key}: not a LLaMA-Factory training argument mt-ray knows"
                            + (f"; did you mean '{close[0]}'?" if close else ""))
            continue
        try:
            result = rule(value, file)
        except Refused as e:
            problems.append(f"{key}: {value!r} is refused: {e}")
            continue
        shown = f"{key}: {value!r}" + (" (LLaMA-Factory's default)" if key in absent else "")
        if isinstance(result, str):
            lines.append(f"{shown} -> not needed: {result}")
            continue
        for target, mapped in result:
            _set(out, target, mapped)
        lines.append(f"{shown} -> " + ", ".join(f"{t}: {m!r}" for t, m in result))
    if problems:
        raise ConfigError("LLaMA-Factory config:\n  " + "\n  ".join(problems))
    for section in sections & values.keys():  # mt-ray's own sections in the same file, on top
        for key, value in (values[section] or {}).items():
            _set(out, f"{section}.{key}", value)
    return out, lines


def describe_mapping(path: str, lines: list[str]) -> str:
    """The mapping, once, as the run starts: one line per argument."""
    return f"{path}: LLaMA-Factory arguments -> mt-ray keys\n  " + "\n  ".join(lines)


def _set(values: dict[str, Any], dotted: str, value: Any) -> None:
    section, key = dotted.split(".", 1)
    values.setdefault(section, {})[key] = value
