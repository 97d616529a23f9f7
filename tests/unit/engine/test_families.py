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
from mt_ray.engine import EngineConfig, StreamingEngine
from mt_ray.errors import ConfigError, ModelNotSupportedError
from mt_ray.models.discovery import discover
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
from tests.tiny_models import CHECKPOINT_FAMILIES, VOCAB, reference_train, tiny_batches


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Models this small gain nothing from intra-op threads; on a shared 2-core machine their wake-ups
    (the engine's optimizer thread runs beside the step) made this module 10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("family", list(CHECKPOINT_FAMILIES))
def test_family_trains_from_its_checkpoint_on_packed_rows(family, tmp_path):
    save_checkpoint(family, tmp_path)
    docs = documents()
    result, state = engine_step(tmp_path, [packed_micro_batch(docs)])
    ref_loss, before, ref_state = reference_step(tmp_path, docs)
    assert_same_step(state, before, ref_state, result.loss.item(), ref_loss)


@pytest.mark.parametrize("family", [f for f in CHECKPOINT_FAMILIES if f not in ("gemma2", "gpt_oss")])  # eager's
def test_varlen_trains_every_family_on_packed_rows_as_documents_alone(family, tmp_path):
    """The varlen backend (`auto`'s choice on CUDA) keeps documents apart from their bounds alone, with no mask.
    On the CPU each document runs through SDPA alone with the arguments the flash kernel gets on CUDA
    (the bounds, each layer's sliding window and scale, grouped or MLA heads), so this checks all of them."""
    save_checkpoint(family, tmp_path)
    docs = documents()
    result, state = engine_step(tmp_path, [packed_micro_batch(docs)], attn_implementation="varlen")
    ref_loss, before, ref_state = reference_step(tmp_path, docs)
    assert_same_step(state, before, ref_state, result.loss.item(), ref_loss)


@pytest.mark.parametrize("family", list(CHECKPOINT_FAMILIES))
def test_chunked_norms_and_mlps_train_every_family_as_documents_alone(family, tmp_path):
    """`mlp_chunk_tokens` runs the norms and dense MLPs over 5 tokens at a time (chunks cross documents
    and rows) and recomputes them chunk by chunk in backward, with a recompute block per layer: the same step."""
    save_checkpoint(family, tmp_path)
    docs = documents()
    result, state = engine_step(tmp_path, [packed_micro_batch(docs)], mlp_chunk_tokens=5, checkpoint_every=1)
    ref_loss, before, ref_state = reference_step(tmp_path, docs)
    assert_same_step(state, before, ref_state, result.loss.item(), ref_loss)


def test_set_attention_switches_the_backend_between_steps(tmp_path):
    """A step after switching to varlen is the step an engine started on varlen takes (benchmarks rely on it)."""
    save_checkpoint("mistral", tmp_path)
    mb = packed_micro_batch(documents())
    engine = StreamingEngine(discover(str(tmp_path)), EngineConfig(device="cpu", attn_implementation="sdpa"), OPT,
                             total_steps=1)
    try:
        engine.load_pretrained(tmp_path)
        assert engine.set_attention("varlen") == "varlen"
        loss = engine.train_step([mb]).loss.item()
        state = engine.state_dict()
    finally:
        engine.close()
    result, ref_state = engine_step(tmp_path, [mb], attn_implementation="varlen")
    assert loss == pytest.approx(result.loss.item(), rel=1e-6)
    for name, w in ref_state.items():
        torch.testing.assert_close(state[name], w, msg=name)


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_next", "falcon_h1", "deepseek_v3"])
@pytest.mark.parametrize("engine_kw", [{"schedule": "resident"}, {"checkpoint_every": 1}], ids=["resident", "K1"])
def test_schedules_keep_documents_apart_across_micro_batches(family, engine_kw, tmp_path):
    """The same step, each packed row its own micro-batch: resident (no recompute), or a recompute per layer."""
    save_checkpoint(family, tmp_path)
    docs = documents()
    packed = packed_micro_batch(docs)
    rows = [{k: v[r : r + 1] for k, v in packed.items()} for r in range(2)]
    result, state = engine_step(tmp_path, rows, **engine_kw)
    ref_loss, before, ref_state = reference_step(tmp_path, docs)
    assert_same_step(state, before, ref_state, result.loss.item(), ref_loss)


def test_softcapping_changes_what_gemma2_computes(tmp_path):
    """So the family test above would see SDPA dropping it: `auto` runs Gemma 2 with eager attention."""
    save_checkpoint("gemma2", tmp_path)
    mb = packed_micro_batch(documents())
    with torch.no_grad():
        capped = eager_reference(tmp_path)(**mb, use_cache=False).logits
        uncapped = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").float()
        assert not torch.allclose(capped, uncapped(**mb, use_cache=False).logits, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize(("family", "backend", "message"), [
    ("gemma2", "sdpa", "'sdpa' does not implement the attention soft-capping that 'gemma2' uses"),
    ("gpt_oss", "flash_attention_2", "'flash_attention_2' does not implement the attention sinks that 'gpt_oss' uses"),
    ("gpt_oss", "sdpa", "'sdpa' does not implement the attention sinks that 'gpt_oss' uses"),
    ("llama", "flex_attention", "'flex_attention' trains on CUDA only"),
])
def test_an_attention_backend_that_cannot_train_the_family_is_refused(tmp_path, family, backend, message):
    save_checkpoint(family, tmp_path)
    with pytest.raises(ConfigError, match=f"engine.attn_implementation: {message}"):
        engine_step(tmp_path, [packed_micro_batch(documents())], attn_implementation=backend)


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


@pytest.mark.parametrize(("model_type", "reason"), [
    ("cpmant", "its body embeds other tokens than the row's"),
    ("reformer", "its body does not run with mt-ray's layer stand-ins"),
])
def test_a_family_the_layer_context_refuses_is_refused_before_any_state(model_type, reason):
    """Refused by name before the host store is sized: with no host memory to spare, the refusal still comes
    first, not an out-of-memory error for a model that could never train. (The image-text families whose documents
    must run alone, which it refused, train now with each document's own images.)"""
    from tests.family_sweep import tiny_config  # noqa: PLC0415 - the sweep's tiny configs (Reformer's sizes)

    spec = discover(tiny_config(model_type))
    with pytest.raises(ModelNotSupportedError, match=f"'{model_type}': {reason}"):
        StreamingEngine(spec, EngineConfig(device="cpu", host_memory_limit_gb=1e-6), OPT, total_steps=1)


def test_doge_on_unpacked_rows_trains_as_transformers_eager_model(tmp_path):
    """Doge builds its attention's additive mask from the mask it is given, and under SDPA transformers gives an
    unpacked row none, so each token would attend to later ones: `auto` runs Doge eager (one step over rows of one
    document each equals transformers' eager model), and `sdpa` is refused by name."""
    from transformers import AutoConfig

    config = AutoConfig.for_model("doge", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
                                  eos_token_id=2, max_position_embeddings=64)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    docs = documents()[:2]
    rows = [{"input_ids": torch.tensor([d.input_ids]), "labels": torch.tensor([d.labels]),
             "position_ids": torch.arange(len(d)).unsqueeze(0)} for d in docs]  # unpacked: a document a row
    result, state = engine_step(tmp_path, rows)
    ref_loss, before, ref_state = reference_step(tmp_path, docs)
    assert_same_step(state, before, ref_state, result.loss.item(), ref_loss)
    with pytest.raises(ConfigError, match="engine.attn_implementation: 'sdpa' does not implement the attention "
                                          "dynamic mask that 'doge' uses"):
        engine_step(tmp_path, rows, attn_implementation="sdpa")


def test_dynamic_rope_with_an_unread_original_context_trains_as_documents_alone(tmp_path):
    """Dynamic RoPE rescales the table of a row whose longest position passes max_position_embeddings (16), whatever
    its `original_max_position_embeddings` (8) says: a 20-token document beside a 4-token one in a row would change
    the short one's rotary table, so the probe looks past 16 and the documents run alone, as transformers' eager
    model computes each."""
    save_checkpoint("llama", tmp_path, max_position_embeddings=16, rope_scaling={
        "rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 8})
    g = torch.Generator().manual_seed(0)
    docs = [TokenizedExample(tuple(ids), (-100, *ids[1:])) for n in (20, 4)
            for ids in [torch.randint(3, VOCAB, (n,), generator=g).tolist()]]
    batch = collate([docs], 24, pad_id=0)
    result, state = engine_step(tmp_path, [{k: batch[k] for k in ("input_ids", "labels", "position_ids")}])
    ref_loss, before, ref_state = reference_step(tmp_path, docs)
    assert_same_step(state, before, ref_state, result.loss.item(), ref_loss)
