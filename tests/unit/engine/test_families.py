"""Every decoder family trains from its own checkpoint exactly as transformers defines it, packed rows included.

Each family is built tiny, saved with transformers' own `save_pretrained` (so MoE experts are stored one
matrix per expert, as hub checkpoints hold them), loaded with `StreamingEngine.load_pretrained` and trained
one step, with the engine's default settings, on packed rows of unequal documents (position ids restart
per document, each document's first label masked). The reference is transformers' eager model loaded from
the same folder and run on each document alone.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from mt_ray.errors import ConfigError
from tests.family_checks import (
    OPT,
    assert_same_step,
    documents,
    eager_reference,
    engine_step,
    packed_micro_batch,
    reference_step,
    save_checkpoint,
)
from tests.tiny_models import CHECKPOINT_FAMILIES, reference_train, tiny_batches


@pytest.mark.parametrize("family", list(CHECKPOINT_FAMILIES))
def test_family_trains_from_its_checkpoint_on_packed_rows(family, tmp_path):
    save_checkpoint(family, tmp_path)
    docs = documents()
    result, state = engine_step(tmp_path, [packed_micro_batch(docs)])
    ref_loss, before, ref_state = reference_step(tmp_path, docs)
    assert_same_step(state, before, ref_state, result.loss.item(), ref_loss)


def test_softcapping_is_not_dropped(tmp_path):
    """Gemma 2's attention soft-capping changes its loss (so the test above would see SDPA dropping it);
    `auto` runs it with eager attention, and naming SDPA for it is refused."""
    save_checkpoint("gemma2", tmp_path)
    mb = packed_micro_batch(documents())
    ref = eager_reference(tmp_path)
    uncapped = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").float()
    with torch.no_grad():
        capped_logits = ref(**mb, use_cache=False).logits
        assert not torch.allclose(capped_logits, uncapped(**mb, use_cache=False).logits, rtol=1e-3, atol=1e-4)
    with pytest.raises(ConfigError, match="engine.attn_implementation: 'sdpa' does not implement the attention "
                                          "soft-capping that 'gemma2' uses"):
        engine_step(tmp_path, [mb], attn_implementation="sdpa")


def test_gpt_oss_sinks_are_refused_where_the_backend_lacks_them(tmp_path):
    save_checkpoint("gpt_oss", tmp_path)
    with pytest.raises(ConfigError, match="does not implement the attention sinks that 'gpt_oss' uses"):
        engine_step(tmp_path, [packed_micro_batch(documents())], attn_implementation="flash_attention_2")


def test_transformers_own_packed_rows_leak_where_the_engine_isolates(tmp_path):
    """Why documents run alone: transformers on the packed row itself lets LFM2's short convolution and
    GPT-OSS's masks (built without the position ids) carry one document into the next."""
    docs = documents()
    mb = packed_micro_batch(docs)
    for family in ("lfm2", "gpt_oss"):
        folder = tmp_path / family
        save_checkpoint(family, folder)
        ref = eager_reference(folder)
        with torch.no_grad():
            packed = ref(**mb, use_cache=False).logits[0, 9:15]  # the row's second document
            alone = ref(input_ids=torch.tensor([docs[1].input_ids]), use_cache=False).logits[0]
        assert not torch.allclose(packed, alone, atol=1e-4), family


def loss_tokens(mb: dict[str, torch.Tensor]) -> int:
    return int((mb["labels"][:, 1:] != -100).sum())


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss", "qwen3_next"])
def test_router_aux_loss_is_added_as_transformers_adds_it(family, tmp_path):
    """With output_router_logits, each micro-batch adds coef x the family's load-balancing loss over its
    tokens, as transformers' forward does; micro-batches are weighted by their share of the loss tokens
    (with one micro-batch: exactly transformers' loss). The gradient reaches every router."""
    coef = 0.5
    save_checkpoint(family, tmp_path, output_router_logits=True, router_aux_loss_coef=coef)
    mbs = tiny_batches(n_micro=2, seq=12)
    mbs[1]["labels"][:, :7] = -100  # fewer loss tokens than the first
    result, state = engine_step(tmp_path, mbs)

    ref = eager_reference(tmp_path)
    before = {k: v.clone() for k, v in ref.state_dict().items()}
    auxes = []

    def weighted(out, mb, n):
        auxes.append(out.aux_loss.item() * loss_tokens(mb) / n)
        return out.loss + coef * out.aux_loss * (loss_tokens(mb) / n - 1)

    [ref_loss] = reference_train(ref, [mbs], OPT, objective=weighted)
    assert result.aux_loss.item() == pytest.approx(sum(auxes), rel=1e-5)
    assert_same_step(state, before, ref.state_dict(), result.loss.item(), ref_loss)
