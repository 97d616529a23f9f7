"""Paths to the assets shipped in the package: the demo registry and the tiny tokenizer."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

_ASSETS = Path(__file__).resolve().parents[1] / "assets"


def demo_registry_path() -> Path:
    """The built-in ``dataset_info.json`` (entries ``demo_alpaca`` and ``demo_sharegpt``)."""
    return _ASSETS / "demo_data" / "dataset_info.json"


def tiny_tokenizer_path() -> Path:
    """Folder of the tiny byte-level BPE tokenizer (ChatML template, ~800 tokens)."""
    return _ASSETS / "tiny_tokenizer"


def load_tiny_tokenizer() -> PreTrainedTokenizerBase:
    """The tiny tokenizer, loaded from the package: no download, for tests and demos."""
    return AutoTokenizer.from_pretrained(str(tiny_tokenizer_path()))
