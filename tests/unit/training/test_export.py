"""Exports generate as the chat template asks (eos and pad ids, generation_config.json), with ordinary file
permissions; `mt-ray export` names the step it exported and refuses a checkpoint that fails its check unless told
to fall back to the previous one."""

import json
import stat

import yaml
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from mt_ray.cli.main import main
from mt_ray.config.run import load_run_config
from mt_ray.data import load_tiny_tokenizer
from mt_ray.data.templates import TEMPLATES
from mt_ray.training.launch import run


def test_an_exported_model_stops_at_the_templates_end_of_turn(tmp_path, capsys):
    overrides = [f"training.storage={tmp_path}", "training.run_name=r", "training.steps=2", "checkpoint.every_steps=1",
                 "engine.device=cpu", "tracking.enabled=false", "data.max_seq_len=64", "data.template=qwen",
                 "model.overrides={eos_token_id: null, pad_token_id: null}"]
    run(load_run_config(None, overrides))
    tokenizer = load_tiny_tokenizer()
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    folder = tmp_path / "r" / "hf_model"
    generation = GenerationConfig.from_pretrained(folder)
    assert generation.eos_token_id[0] == end_of_turn and tokenizer.eos_token_id in generation.eos_token_id
    assert generation.pad_token_id == tokenizer.pad_token_id
    exported = AutoTokenizer.from_pretrained(folder)  # the template the run trained with, not the tokenizer's own
    assert exported.chat_template == TEMPLATES["qwen"].jinja != tokenizer.chat_template
    config = AutoConfig.from_pretrained(folder)
    assert (config.eos_token_id, config.pad_token_id) == (end_of_turn, tokenizer.pad_token_id)
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json"):
        assert stat.S_IMODE((folder / name).stat().st_mode) == 0o644, name

    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump({"training": {"storage": str(tmp_path), "run_name": "r"},
                                           "data": {"template": "qwen"}}))
    capsys.readouterr()
    export = ["export", "--config", str(config_file), "--out", str(tmp_path / "out")]
    assert main(export) == 0
    assert capsys.readouterr().out.strip() == (
        f"exported step 2 ({tmp_path}/r/checkpoints/step-00000002) to {tmp_path}/out")
    manifest = json.loads((tmp_path / "r" / "checkpoints" / "step-00000002" / "manifest.json").read_text())
    shard = tmp_path / "r" / "checkpoints" / "step-00000002" / next(iter(manifest["files"]))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert main(export) == 2
    err = capsys.readouterr().err
    assert "step-00000002" in err and "pass --fall-back" in err and len(err.strip().splitlines()) == 1
    assert main([*export, "--fall-back"]) == 0
    assert capsys.readouterr().out.strip().startswith("exported step 1 (")
