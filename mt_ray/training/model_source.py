"""The configured model and tokenizer, checked before anything loads: each mistake is one clear error.

Nothing is downloaded: `model.path` and `model.tokenizer` are local folders, and a folder that is
missing, lacks its config.json or tokenizer files, or holds no weights for `model.init: pretrained`
is refused with a `ConfigError` naming the key, the file and the fix, before transformers (which
would fall back to the Hub, or to a sentencepiece/tiktoken conversion) is asked.
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from mt_ray.config.run import RunConfig
from mt_ray.data import load_tiny_tokenizer
from mt_ray.data.mm_processor import ImageEncoder, load_processor
from mt_ray.errors import ConfigError
from mt_ray.models.discovery import ModelSpec, discover, load_config
from mt_ray.models.presets import preset_config

# Files any of which lets transformers build a tokenizer without converting or downloading one.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
_NOTHING_DOWNLOADED = "nothing is downloaded, so it must be a local folder"


def load_model_and_tokenizer(cfg: RunConfig) -> tuple[ModelSpec, PreTrainedTokenizerBase]:
    """The tokenizer, then the model spec (the tiny preset's vocabulary sized to that tokenizer)."""
    if cfg.model.path:
        check_model_folder(cfg.model.path)
    tokenizer = load_tokenizer(cfg)
    return build_model_spec(cfg, vocab_size=_padded_vocab(tokenizer)), tokenizer


def build_model_spec(cfg: RunConfig, vocab_size: int | None = None) -> ModelSpec:
    """Discover the configured model (local folder or preset shape, with overrides)."""
    overrides = dict(cfg.model.overrides)
    if cfg.model.path:
        config = load_config(str(check_model_folder(cfg.model.path)))
        for k, v in overrides.items():
            setattr(config, k, v)
    else:
        if vocab_size is not None and cfg.model.preset == "tiny":
            overrides.setdefault("vocab_size", vocab_size)
        config = preset_config(cfg.model.preset, **overrides)
    return discover(config, cfg.model.freeze_vision_tower, cfg.model.freeze_multi_modal_projector)


def load_tokenizer(cfg: RunConfig) -> PreTrainedTokenizerBase:
    """`model.tokenizer`, else the tokenizer in `model.path`, else the built-in tiny one."""
    source = cfg.model.tokenizer or cfg.model.path
    if source is None:
        return load_tiny_tokenizer()
    key = "model.tokenizer" if cfg.model.tokenizer else "model.path"
    folder = _existing_folder(source, key)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"{key}: {folder} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)}); copy "
                          "them from the base model, or set model.tokenizer to a folder that has them")
    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, ImportError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{key}: the tokenizer in {folder} does not load ({first}); copy the tokenizer files "
                          "from the base model again") from None


def load_image_encoder(cfg: RunConfig, spec: ModelSpec) -> ImageEncoder | None:
    """An image-text model's processor (from `model.path`), which turns the data's images into pixel values."""
    if spec.vision is None:
        return None
    if cfg.model.path is None:
        raise ConfigError(f"model.preset: the image-text model '{spec.config.model_type}' needs its processor; set "
                          "model.path to a folder with config.json and the processor files")
    return ImageEncoder(load_processor(cfg.model.path), cfg.data.image_max_pixels, cfg.data.image_min_pixels)


def check_model_folder(path: str) -> Path:
    """`model.path` must be a folder with a readable, valid config.json."""
    folder = _existing_folder(path, "model.path")
    config = folder / "config.json"
    if not config.is_file():
        raise ConfigError(f"model.path: {folder} has no config.json; point model.path at a Hugging Face model "
                          "folder (config.json, *.safetensors, tokenizer files)")
    try:
        json.loads(config.read_text())
    except OSError as e:
        raise ConfigError(f"model.path: cannot read {config} ({e.strerror}); check its permissions") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f" at line {e.lineno}, column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
        raise ConfigError(f"model.path: {config} is not valid JSON{where}; restore it from the base model") from None
    return folder


def pretrained_weights(cfg: RunConfig) -> str | None:
    """The folder to load weights from, or None for random init (`model.init: auto` takes the folder's if it has any)."""
    path, init = cfg.model.path, cfg.model.init
    if init == "random" or (path is None and init == "auto"):
        return None
    if path is None:
        raise ConfigError("model.init: pretrained needs model.path, a folder with the weights; a preset shape has "
                          "none (set model.init=random to train it from random weights)")
    folder = Path(path).expanduser()
    if any(folder.glob("*.safetensors")):
        return str(folder)
    if init == "auto":
        return None
    other = sorted(p.name for p in folder.glob("*.bin")) or sorted(p.name for p in folder.glob("*.pt"))
    found = f" (only {', '.join(other[:3])}, which mt-ray does not read: save it as safetensors)" if other else ""
    raise ConfigError(f"model.init: pretrained, but {folder} holds no *.safetensors weights{found}; copy the weights "
                      "in, or set model.init=random to train from random weights")


def _existing_folder(path: str, key: str) -> Path:
    folder = Path(path).expanduser()
    if not folder.exists():
        raise ConfigError(f"{key}: {path} does not exist ({_NOTHING_DOWNLOADED})")
    if not folder.is_dir():
        raise ConfigError(f"{key}: {path} is a file, not a folder ({_NOTHING_DOWNLOADED})")
    return folder


def _padded_vocab(tokenizer) -> int:
    """Vocabulary rounded up to a multiple of 64 (tensor-core friendly), covering every token id."""
    return (len(tokenizer) + 63) // 64 * 64
