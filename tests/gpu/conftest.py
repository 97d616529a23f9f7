"""Fixtures of the CUDA tests."""

import importlib

import pytest


@pytest.fixture
def family_module_restored(monkeypatch):
    """Liger patches the family's modeling module for the whole process (rotary function, classes);
    put every name back after the test so later tests run transformers' own code."""
    def keep(model_type: str) -> None:
        module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        for name, value in list(vars(module).items()):
            if not name.startswith("__"):
                monkeypatch.setattr(module, name, value)
    return keep
