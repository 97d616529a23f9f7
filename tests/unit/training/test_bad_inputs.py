"""A bad model folder, tokenizer or device is one line on stderr that names the key, the problem and the fix."""

import pytest
import torch

from jobs.train import main
from mt_ray.data import load_tiny_tokenizer
from tests.tiny_models import tiny_config


@pytest.fixture
def folder(tmp_path):
    """A model folder with config.json and the tokenizer, and no weights."""
    path = tmp_path / "model"
    tiny_config("llama").save_pretrained(path)
    load_tiny_tokenizer().save_pretrained(path)
    return path


def error_line(tmp_path, capsys, *overrides: str) -> str:
    code = main([f"training.storage={tmp_path / 'runs'}", "tracking.enabled=false", "training.steps=1", *overrides])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    return err.strip()


def test_missing_model_folder(tmp_path, capsys):
    assert error_line(tmp_path, capsys, f"model.path={tmp_path}/nowhere") == (
        f"error: model.path: {tmp_path}/nowhere does not exist (nothing is downloaded, so it must be a local folder)")


def test_model_folder_without_tokenizer_files(tmp_path, capsys, folder):
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (folder / name).unlink(missing_ok=True)
    assert error_line(tmp_path, capsys, f"model.path={folder}") == (
        f"error: model.path: {folder} has no tokenizer files (one of tokenizer.json, tokenizer.model, vocab.json, "
        "vocab.txt, spiece.model); copy them from the base model, or set model.tokenizer to a folder that has them")


def test_unreadable_config_json(tmp_path, capsys, folder):
    (folder / "config.json").write_text('{"model_type": "llama",\n  hidden_size: 32}')
    assert error_line(tmp_path, capsys, f"model.path={folder}") == (
        f"error: model.path: {folder}/config.json is not valid JSON at line 2, column 3; restore it from the base model")


def test_no_weights_but_init_pretrained(tmp_path, capsys, folder):
    assert error_line(tmp_path, capsys, f"model.path={folder}", "model.init=pretrained") == (
        f"error: model.init: pretrained, but {folder} holds no *.safetensors weights; copy the weights in, or set "
        "model.init=random to train from random weights")
    assert error_line(tmp_path, capsys, "model.init=pretrained").startswith(
        "error: model.init: pretrained needs model.path")


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for CUDA where there is none")
def test_cuda_asked_for_without_cuda(tmp_path, capsys):
    why = (f"this torch ({torch.__version__}) is built without CUDA" if torch.version.cuda is None
           else "no CUDA device is visible (check the driver and CUDA_VISIBLE_DEVICES)")
    assert error_line(tmp_path, capsys, "engine.device=cuda") == (
        f"error: engine.device: cuda was asked for, but {why}; use engine.device=auto (CUDA when present, else CPU) "
        "or engine.device=cpu")
