"""Every model type transformers maps to a causal LM (and to an image-text model) ends in one of three states:
trained exactly as transformers trains it, refused by name before any state is built, or skipped for a reason
outside mt-ray. Zero errors and zero mismatches; the README's families table is these outcomes.

Each causal-LM type is built tiny from its own config class (tests/family_sweep.py), saved with
`save_pretrained`, loaded with `load_pretrained` and trained one step on packed rows of unequal documents,
against transformers' eager model trained on each document alone (loss to 1e-5 relative, every weight's
update). The summary line of each mapping is printed at the end of the run (tests/conftest.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
)

from tests.family_sweep import RESULTS, families_table, outcome_of, readme_table, run_in_tmp
from tests.vlm_sweep import IMAGE_TEXT, image_text_outcome

CAUSAL_LM = "causal-LM"
README = Path(__file__).resolve().parents[3] / "README.md"


pytestmark = pytest.mark.usefixtures("one_thread")


def _check(outcome) -> None:
    if outcome.status in ("error", "mismatch"):
        pytest.fail(f"{outcome.status}: {outcome.reason}")
    if outcome.status == "skipped":
        pytest.skip(outcome.reason)


@pytest.mark.parametrize("model_type", sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
def test_causal_lm_trains_at_parity_or_is_refused_by_name(model_type):
    _check(outcome_of(CAUSAL_LM, model_type, run_in_tmp))


@pytest.mark.parametrize("model_type", sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES))
def test_image_text_model_is_verified_or_refused_by_name(model_type):
    _check(outcome_of(IMAGE_TEXT, model_type, image_text_outcome))


def test_the_readme_families_table_is_the_sweeps():
    """Regenerate with `python -m tests.family_sweep` when transformers or mt-ray changes an outcome."""
    outcomes = {
        CAUSAL_LM: {t: outcome_of(CAUSAL_LM, t, run_in_tmp) for t in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)},
        IMAGE_TEXT: {t: outcome_of(IMAGE_TEXT, t, image_text_outcome)
                     for t in sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)},
    }
    assert readme_table(README) == families_table(outcomes), "README drifted: run `python -m tests.family_sweep`"
    assert RESULTS  # the summary line reads these
