"""A LLaMA-Factory training YAML runs as it is: `mt-ray train qwen3_full_sft.yaml` maps each argument to mt-ray's
keys (printed once), trains the number of epochs it asks for, and refuses what has no equivalent in one line.

The YAMLs are LLaMA-Factory's own examples (tests/fixtures/llamafactory_yaml/README.md), run from a folder
whose `data/` is LLaMA-Factory's data folder (its default dataset_dir), with `model_name_or_path` pointed at a
tiny local Qwen3 folder. Training runs in fp32 on shorter rows to stay quick; the mapping is checked as the file
gives it.
"""

from pathlib import Path

import pytest

from mt_ray.cli.main import main
from mt_ray.config.run import load_run_config
from mt_ray.data import load_tiny_tokenizer
from mt_ray.errors import ConfigError
from tests.tiny_models import tiny_config
from tests.unit.data.conftest import LLAMAFACTORY_FIXTURES

YAMLS = Path(__file__).resolve().parents[1] / "fixtures" / "llamafactory_yaml"
QUICK = ["engine.device=cpu", "engine.compute_dtype=fp32", "data.max_seq_len=128", "data.max_samples=2"]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A folder as LLaMA-Factory is run from: `data/` (its datasets) and a tiny model under `model/`."""
    if not LLAMAFACTORY_FIXTURES.is_dir():
        pytest.skip(f"LLaMA-Factory fixtures not found at {LLAMAFACTORY_FIXTURES}")
    (tmp_path / "data").symlink_to(LLAMAFACTORY_FIXTURES.resolve())
    monkeypatch.chdir(tmp_path)
    tokenizer = load_tiny_tokenizer()
    tiny_config("qwen3", vocab_size=len(tokenizer), num_hidden_layers=2, max_position_embeddings=4096,
                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id).save_pretrained("model")
    tokenizer.save_pretrained("model")
    return tmp_path


def _as_it_is(name: str, folder: Path) -> Path:
    """LLaMA-Factory's file with only model_name_or_path pointed at the tiny local model."""
    text = (YAMLS / name).read_text()
    path = folder / name
    path.write_text("\n".join("model_name_or_path: model" if line.startswith("model_name_or_path:") else line
                              for line in text.splitlines()))
    return path


@pytest.mark.parametrize("stage, lr, accum, datasets", [
    ("sft", 1e-5, 2, ["identity", "alpaca_en_demo"]),
    ("dpo", 5e-6, 8, ["dpo_en_demo"]),
    ("kto", 5e-6, 8, ["kto_en_demo"]),
])
def test_train_full_yaml_maps_to_mt_rays_keys(workdir, capsys, stage, lr, accum, datasets):
    path = _as_it_is(f"qwen3_full_{stage}.yaml", workdir)
    cfg = load_run_config(path)
    assert cfg.training.stage == stage and cfg.training.epochs == 3.0
    assert (cfg.training.micro_batch_size, cfg.training.grad_accum_steps, cfg.training.seed) == (1, accum, 42)
    assert cfg.data.datasets == datasets and cfg.data.template == "qwen3_nothink"
    assert (cfg.data.max_seq_len, cfg.data.max_samples, cfg.data.packing) == (2048, 1000, False)
    assert str(cfg.data.registry) == "data" and cfg.model.path == "model"
    assert cfg.optimizer.lr == lr and cfg.optimizer.schedule == "cosine" and cfg.optimizer.warmup_ratio == 0.1
    assert cfg.engine.compute_dtype == "bf16" and not cfg.tracking.enabled
    assert (cfg.training.storage, cfg.training.run_name) == ("saves/qwen3-4b/full", stage)
    assert cfg.checkpoint.every_steps == 500
    if stage != "sft":
        assert cfg.pref.beta == 0.1 and cfg.pref.loss == "sigmoid"
    out = capsys.readouterr().out
    assert "finetuning_type: 'full' -> not needed" in out and "cutoff_len: 2048 -> data.max_seq_len: 2048" in out


@pytest.mark.parametrize("stage, epoch_rows, steps", [("sft", 4, 6), ("dpo", 2, 3), ("kto", 2, 3)])
def test_train_full_yaml_trains_its_epochs(workdir, capsys, stage, epoch_rows, steps):
    """3 epochs of max_samples=2 rows a dataset: sft's two datasets give 4 rows, 2 steps of 1 x 2 an epoch."""
    assert main(["train", str(_as_it_is(f"qwen3_full_{stage}.yaml", workdir)), *QUICK]) == 0
    out = capsys.readouterr().out
    assert out.count("LLaMA-Factory arguments -> mt-ray keys") == 1
    assert f"an epoch is {epoch_rows} rows" in out and f"training {steps} steps" in out
    run = workdir / "saves" / "qwen3-4b" / "full" / stage
    assert (run / "hf_model" / "model.safetensors").is_file() and (run / "summary.json").is_file()


def test_lora_and_unknown_arguments_are_refused_in_one_line_each(workdir, capsys):
    assert main(["train", str(_as_it_is("qwen3_lora_sft.yaml", workdir))]) == 2
    err = capsys.readouterr().err
    assert "finetuning_type: 'lora' is refused: mt-ray trains every weight at full precision" in err
    assert "lora_rank" not in err  # read only with LoRA: nothing to say once LoRA itself is refused
    bad = workdir / "bad.yaml"
    bad.write_text("model_name_or_path: model\nstage: sft\nlearning_rat: 1.0e-5\ntemplate: qwen9\nstage_x: 1\n")
    assert main(["train", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "learning_rat: not a LLaMA-Factory training argument mt-ray knows; did you mean 'learning_rate'?" in err


def test_resume_and_overwrite_arguments_map_as_transformers_reads_them(tmp_path):
    """`resume_from_checkpoint: true` resumes the newest; `<output_dir>/checkpoint-N` the mt-ray run's step N where
    it has one; a transformers checkpoint elsewhere is refused naming what works; `overwrite_output_dir: true` starts
    a run only in an output_dir without checkpoints (`training.resume: never`)."""
    out = tmp_path / "saves" / "sft"
    (out / "checkpoints" / "step-00000500").mkdir(parents=True)

    def load(**arguments) -> str:
        path = tmp_path / "lf.yaml"
        path.write_text("".join(f"{k}: {v}\n" for k, v in {"stage": "sft", "output_dir": out, **arguments}.items()))
        return load_run_config(path).training.resume

    assert load(resume_from_checkpoint="true") == "auto"
    assert load(resume_from_checkpoint=f"{out}/checkpoint-500") == f"{out}/checkpoints/step-00000500"
    assert load(overwrite_output_dir="true") == "never"
    assert load(overwrite_output_dir="true", resume_from_checkpoint="true") == "auto"
    with pytest.raises(ConfigError, match=r"resume_from_checkpoint: .* is refused: this output_dir's run has no "
                                          r"checkpoint at step 300"):
        load(resume_from_checkpoint=f"{out}/checkpoint-300")
    with pytest.raises(ConfigError, match=r"is refused: mt-ray resumes its own checkpoints .* resume_from_checkpoint: "
                                          r"true .* model_name_or_path: /elsewhere/checkpoint-9"):
        load(resume_from_checkpoint="/elsewhere/checkpoint-9")
