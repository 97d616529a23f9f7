"""Fixtures shared by the data-pipeline tests: the tiny tokenizer and the LLaMA-Factory fixture folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from mt_ray.data import load_tiny_tokenizer

# CI clones the repo with shared/ beside it, as ../shared.
LLAMAFACTORY_FIXTURES = Path(__file__).resolve().parents[3] / ".." / "shared" / "fixtures" / "llamafactory"


@pytest.fixture(scope="session")
def tokenizer():
    return load_tiny_tokenizer()


@pytest.fixture
def llamafactory_dir() -> Path:
    if not LLAMAFACTORY_FIXTURES.is_dir():
        pytest.skip(f"LLaMA-Factory fixtures not found at {LLAMAFACTORY_FIXTURES} (shared/ is not beside the repo)")
    return LLAMAFACTORY_FIXTURES
