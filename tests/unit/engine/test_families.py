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

from mt_ray.data.packing import collate
from mt_ray.data.schema import TokenizedExample
from mt_ray.engine import EngineConfig, OptimizerConfig, StreamingEngine
from mt_ray.errors import ConfigError
from mt_ray.models.discovery import discover
from tests.tiny_models import CHECKPOINT_FAMILIES, VOCAB, checkpoint_config, reference_train, tiny_batches

# eps = 1 makes Adam's first update ~ lr * gradient (not lr * sign), so comparing one step's weights
# compares the gradients themselves; clipping and decay are on, as in training.
OPT = OptimizerConfig(lr=0.1, eps=1.0, weight_decay=0.01, max_grad_norm=1.0)
ROW = 24
DOCUMENTS = [(9, 3), (6, 2), (7, 3), (13, 4), (11, 5)]  # (length, prompt tokens): rows [9 6 7 +2 pad], [13 11]


def documents(seed: int = 0) -> list[TokenizedExample]:
    g = torch.Generator().manual_seed(seed)
    docs = []
    for n, prompt in DOCUMENTS:
        ids = torch.randint(3, VOCAB, (n,), generator=g).tolist()
        docs.append(TokenizedExample(tuple(ids), tuple([-100] * prompt + ids[prompt:])))
    return docs


def packed_micro_batch(docs: list[TokenizedExample]) -> dict[str, torch.Tensor]:
    batch = collate([docs[:3], docs[3:]], ROW, pad_id=0)  # the data pipeline's own packing
    return {k: batch[k] for k in ("input_ids", "labels", "position_ids")}


def save_checkpoint(family: str, folder, **overrides) -> None:
    """A random model of `family` written by transformers; saved buffers (DeepSeek-V3's per-layer
    routing bias) get random values, so a layer computing with another layer's values shows."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(checkpoint_config(family, **overrides))
    saved = model.state_dict(keep_vars=True)
    for name, buf in model.named_buffers():
        if name in saved and buf.is_floating_point():
            buf.normal_()
    model.save_pretrained(folder)


def engine_step(folder, micro_batches, **engine_kw):
    engine = StreamingEngine(discover(str(folder)), EngineConfig(device="cpu", **engine_kw), OPT, total_steps=1)
    try:
        engine.load_pretrained(folder)
        result = engine.train_step(micro_batches)
        return result, {k: v.clone() for k, v in engine.state_dict().items()}
    finally:
        engine.close()


def eager_reference(folder) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").float()


def assert_same_step(state, ref, before, loss, ref_loss):
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    for name, w in ref.state_dict().items():
        if name in state:  # a tied head is the embedding
            torch.testing.assert_close(state[name] - before[name], w - before[name], rtol=1e-4, atol=3e-7, msg=name)


@pytest.mark.parametrize("family", list(CHECKPOINT_FAMILIES))
def test_family_trains_from_its_checkpoint_on_packed_rows(family, tmp_path):
    save_checkpoint(family, tmp_path)
    docs = documents()
    result, state = engine_step(tmp_path, [packed_micro_batch(docs)])

    ref = eager_reference(tmp_path)
    before = {k: v.clone() for k, v in ref.state_dict().items()}
    alone = [{"input_ids": torch.tensor([d.input_ids]), "labels": torch.tensor([d.labels])} for d in docs]
    [ref_loss] = reference_train(ref, [alone], OPT)
    assert_same_step(state, ref, before, result.loss.item(), ref_loss)


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
    assert_same_step(state, ref, before, result.loss.item(), ref_loss)
