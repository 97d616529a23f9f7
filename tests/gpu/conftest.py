"""Fixtures of the CUDA tests."""

import importlib

import pytest
from transformers import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING


@pytest.fixture
def family_module_restored(monkeypatch):
    """Liger patches the family's modeling module for the whole process (rotary function, classes);
    put every name back after the test so later tests run transformers' own code. Called with the
    family's model_type; the module is its causal LM class's own, which the model_type need not name
    (gemma3_text's is models/gemma3)."""
    def keep(model_type: str) -> None:
        causal_lm = MODEL_FOR_CAUSAL_LM_MAPPING[CONFIG_MAPPING[model_type]]
        module = importlib.import_module(causal_lm.__module__)
        for name, value in list(vars(module).items()):
            if not name.startswith("__"):
                monkeypatch.setattr(module, name, value)
    return keep
