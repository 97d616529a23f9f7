"""Image-text models train in the engine exactly as transformers' own model trains.

A tiny Qwen-VL (2.5, 3, 3 with MoE layers, and 3.5, whose linear attention runs each document alone) is saved
with `save_pretrained` beside its processor; documents with 0, 1 and 2 generated images go through the folder's
own processor and are packed into one row (the engine), or run one by one (transformers' eager model, frozen as
LLaMA-Factory freezes it). One step must give the same loss and the same update of every weight; a frozen tower
stays bit-identical and holds no Adam moments. Qwen3-VL adds deepstack features after its first two layers, so
its checkpoint boundaries (K=1) cut through them and a trained tower takes their gradient.
"""

from __future__ import annotations

import pytest
import torch

from mt_ray.engine import EngineConfig, StreamingEngine
from mt_ray.engine.batch import prepare_micro_batch
from mt_ray.engine.sizing import vision_sizes
from mt_ray.errors import ConfigError, DatasetError
from mt_ray.models.attention import resolve_attention
from mt_ray.models.context import LayerContextBuilder
from mt_ray.models.discovery import discover
from mt_ray.models.varlen import TOWER_VARLEN
from tests.family_checks import OPT, assert_same_step
from tests.tiny_models import reference_train
from tests.vlm_models import (
    gemma3_document,
    image_document,
    llava_document,
    make_image,
    paligemma_document,
    paligemma_processor,
    reference_model,
    save_gemma3,
    save_llava,
    save_paligemma,
    save_qwen_vl,
)

QWEN_FAMILIES = ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5"]

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=QWEN_FAMILIES)
def folder(request, tmp_path_factory):
    return save_qwen_vl(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def documents(folder):
    docs = [image_document(folder, f"{IMAGE}what is this? a cat", [make_image(0)], 3),
            image_document(folder, "some text only here and more", [], 2),
            image_document(folder, f"two {IMAGE} and {IMAGE} pictures ok", [make_image(1, 8, 16), make_image(2)], 4)]
    for doc in docs:
        doc["labels"][0, 0] = -100  # in a packed row, a document's first token is predicted from the previous one
        doc.pop("attention_mask")
    return docs


def packed(docs: list[dict]) -> dict:
    """The documents in one row, positions restarting at each; each image's own tensors, in order."""
    images = []
    for doc in docs:
        if "image_grid_thw" in doc:  # Qwen: patches of all images in one tensor
            pixels = doc["pixel_values"].split(doc["image_grid_thw"].prod(-1).tolist())
            images += [{"pixel_values": p, "image_grid_thw": doc["image_grid_thw"][k:k + 1]} for k, p in enumerate(pixels)]
        elif "pixel_values" in doc:  # one [3, H, W] picture per image
            images += [{"pixel_values": p[None]} for p in doc["pixel_values"]]
    return {"input_ids": torch.cat([d["input_ids"] for d in docs], 1),
            "labels": torch.cat([d["labels"] for d in docs], 1),
            "position_ids": torch.cat([torch.arange(d["input_ids"].shape[1]) for d in docs])[None],
            "images": [images]}


def engine_steps(folder, steps: list[list[dict]], freeze=(True, False), **engine_kw):
    spec = discover(str(folder), freeze_vision_tower=freeze[0], freeze_multi_modal_projector=freeze[1])
    engine = StreamingEngine(spec, EngineConfig(device="cpu", **engine_kw), OPT, total_steps=len(steps))
    try:
        engine.load_pretrained(folder)
        before = {k: v.clone() for k, v in engine.state_dict().items()}
        losses = [engine.train_step(mbs).loss.item() for mbs in steps]
        return losses, before, {k: v.clone() for k, v in engine.state_dict().items()}, engine.store
    finally:
        engine.close()


@pytest.mark.parametrize(("engine_kw", "freeze"), [
    ({}, (True, False)),  # LLaMA-Factory's defaults: tower frozen, projector trained
    ({"schedule": "resident"}, (False, False)),
    ({"checkpoint_every": 1}, (False, True)),
    ({"checkpoint_every": 1, "checkpoint_placement": "host"}, (False, False)),  # the image features' gradient too
    ({"attn_implementation": "varlen"}, (False, False)),  # the language model's documents apart by their bounds
], ids=["stream-frozen-tower", "resident-all-trained", "K1-frozen-projector", "K1-host-checkpoints", "varlen"])
def test_qwen_vl_step_equals_transformers(folder, documents, engine_kw, freeze):
    [loss], before, state, store = engine_steps(folder, [[packed(documents)]], freeze, **engine_kw)
    ref = reference_model(folder, *freeze)
    [ref_loss] = reference_train(ref, [documents], OPT)
    assert_same_step(state, before, ref.state_dict(), loss, ref_loss)
    tower = [k for k in state if ".visual." in k and ".merger." not in k]
    projector = [k for k in state if ".visual.merger." in k]
    for frozen, names in ((freeze[0], tower), (freeze[1], projector)):
        for name in names:
            assert torch.equal(state[name], before[name]) is frozen, name
    trained = sum(t.numel() for name, t in state.items() if (name in tower and not freeze[0]) or
                  (name in projector and not freeze[1]) or ".visual." not in name)
    assert store.exp_avg.numel() == store.exp_avg_sq.numel() == trained  # frozen units hold no moments


@pytest.mark.parametrize("engine_kw", [{"schedule": "resident"}, {"checkpoint_every": 1}], ids=["resident", "K1"])
def test_micro_batches_with_and_without_images_step_as_one_batch(folder, documents, engine_kw):
    """Three micro-batches, the first without images: the vision units still arrive first, and each micro-batch's
    image features (Qwen3-VL's deepstack ones too) take their own gradients."""
    steps = [[packed(documents[1:2]), packed(documents[:1]), packed(documents[2:])]]
    [loss], before, state, _ = engine_steps(folder, steps, (False, False), **engine_kw)
    ref = reference_model(folder, False, False)
    [ref_loss] = reference_train(ref, [documents], OPT)
    assert_same_step(state, before, ref.state_dict(), loss, ref_loss)


def test_each_document_that_runs_alone_is_a_get_image_features_call_of_its_own(folder, documents):
    """Qwen3.5's linear attention runs each document of a packed row alone: each document with images takes them to
    the body and to a get_image_features call of its own (the step above equals transformers' on each document).
    The others run the micro-batch's images in one call."""
    spec = discover(str(folder))
    context = LayerContextBuilder(spec, torch.device("cpu"))
    mb = prepare_micro_batch(packed(documents), torch.device("cpu"), context.document_images)
    alone = spec.config.model_type == "qwen3_5"
    assert context.isolate_documents == alone
    assert [len(images["image_grid_thw"]) for images in mb.image_calls] == ([1, 2] if alone else [3])
    assert (mb.images is None) == alone and (mb.documents.images is not None) == alone


def test_evaluate_scores_images_as_transformers_does(folder, documents):
    """Forward only, in eval mode: the summed loss of the packed image row is transformers' on each document."""
    engine = StreamingEngine(discover(str(folder)), EngineConfig(device="cpu"), OPT, total_steps=1)
    try:
        engine.load_pretrained(folder)
        result = engine.evaluate([packed(documents)])
    finally:
        engine.close()
    ref = reference_model(folder).eval()
    with torch.no_grad():
        ref_sum = sum(ref(**doc, use_cache=False).loss.item() * int((doc["labels"][:, 1:] != -100).sum())
                      for doc in documents)
    assert result.loss_sum.item() == pytest.approx(ref_sum, rel=1e-5)


def test_varlen_runs_the_language_model_causal_and_the_tower_both_ways(folder):
    """`auto` on CUDA: the language model's documents apart by their bounds; the tower's windows and images, which
    attend both ways within `cu_seqlens`, through the same kernel in one call a block (not one per window after a
    device sync). The step on the CPU (`varlen` above) runs it as SDPA per window: transformers' own arithmetic."""
    setting = resolve_attention(discover(str(folder)), "auto", torch.device("cuda"), torch.bfloat16)
    assert setting == {"": "varlen", "text_config": "varlen", "vision_config": TOWER_VARLEN}


def test_a_step_without_images_leaves_the_projector_and_its_adam_count(folder, documents):
    """transformers gives the projector no gradient (None) in a text-only step: AdamW skips it, so its
    bias-correction count stays behind the language model's for the next step with images."""
    text_only = [documents[1]]
    losses, before, state, _ = engine_steps(folder, [[packed(text_only)], [packed(documents)]])
    ref = reference_model(folder)
    ref_losses = reference_train(ref, [text_only, documents], OPT)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert_same_step(state, before, ref.state_dict(), losses[-1], ref_losses[-1])


def test_vision_units_and_freeze_flags_are_discovered(folder):
    spec = discover(str(folder))
    names = [u.name for u in spec.units]
    assert names == ["vision.embed", "vision.blocks.0", "vision.blocks.1", "vision.blocks.2", "vision.projector",
                     "embed", *(f"layers.{i}" for i in range(spec.num_layers)), "head"]
    assert [u.name for u in spec.units if u.frozen] == names[:4]
    covered = {p.hf_name for u in spec.units for p in u.params}
    assert covered == set(spec.skeleton.state_dict())
    assert {p.hf_name for p in spec.unit("vision.projector").params} == {
        n for n in covered if n.startswith("model.visual.merger.")}
    assert not discover(str(folder), False, True).unit("vision.blocks.1").frozen
    # Qwen3-VL's deepstack mergers belong to the tower (LLaMA-Factory's split) but run on image tokens, as the projector
    assert vision_sizes(spec, 0).merged_params == sum(p.numel for u in spec.units for p in u.params
                                                      if ".deepstack_merger_list." in p.hf_name)


def hand_made(document) -> list[dict]:
    """Documents of 1, 0 and 2 images from a family's `document(text_tokens, images, generator)`, each first
    label masked (in a packed row it is predicted from the previous document)."""
    g = torch.Generator().manual_seed(0)
    docs = [document(7, 1, g), document(6, 0, g), document(5, 2, g)]
    for doc in docs:
        doc["labels"][0, 0] = -100
    return docs


@pytest.fixture(scope="module")
def gemma3_documents():
    return hand_made(gemma3_document)


@pytest.mark.parametrize(("engine_kw", "freeze"), [({}, (True, False)), ({"schedule": "resident"}, (False, False))],
                         ids=["stream-frozen-tower", "resident-all-trained"])
def test_gemma3_step_equals_transformers(tmp_path, gemma3_documents, engine_kw, freeze):
    """SigLIP tower, average-pool projector, image tokens attending both ways, sliding-window layers. Two
    steps: the projector starts at zero, so the tower's first gradient is zero."""
    folder = save_gemma3(tmp_path, vision_use_head=False)  # as Gemma 3's checkpoints: no pooling head
    losses, before, state, _ = engine_steps(folder, [[packed(gemma3_documents)]] * 2, freeze, **engine_kw)
    ref = reference_model(folder, *freeze)
    ref_losses = reference_train(ref, [gemma3_documents] * 2, OPT)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert_same_step(state, before, ref.state_dict(), losses[-1], ref_losses[-1])
    tower = [k for k in state if ".vision_tower." in k]
    assert [k for k in tower if torch.equal(state[k], before[k]) is not freeze[0]] == []


def test_varlen_is_refused_where_image_tokens_attend_both_ways(tmp_path):
    """Gemma 3's image blocks are bidirectional, which varlen's causal kernel would drop: `auto` keeps SDPA's mask."""
    spec = discover(str(save_gemma3(tmp_path, vision_use_head=False)))
    with pytest.raises(ConfigError, match="'varlen' computes causal attention only, and 'gemma3' lets some tokens"):
        resolve_attention(spec, "varlen", torch.device("cuda"), torch.bfloat16)
    assert resolve_attention(spec, "auto", torch.device("cuda"), torch.bfloat16) == "sdpa"


@pytest.mark.parametrize("family", ["gemma4", "gemma4_unified"])
def test_varlen_is_refused_where_gemma4s_image_tokens_attend_both_ways(family):
    from tests.vlm_sweep import tiny_vlm_config

    spec = discover(tiny_vlm_config(family))
    with pytest.raises(ConfigError, match=f"'varlen' computes causal attention only, and '{family}' lets some tokens \\(an image's"):
        resolve_attention(spec, "varlen", torch.device("cuda"), torch.bfloat16)


def test_a_trained_tower_leaves_what_get_image_features_never_reads_as_transformers(tmp_path, gemma3_documents):
    """SigLIP's pooling head gets no gradient under Gemma 3: torch's AdamW leaves it unchanged (no decay), and so
    does the engine, while the rest of the tower trains. Two steps: the projector starts at zero."""
    folder = save_gemma3(tmp_path, vision_use_head=True)
    losses, before, state, _ = engine_steps(folder, [[packed(gemma3_documents)]] * 2, (False, False))
    ref = reference_model(folder, False, False)
    ref_losses = reference_train(ref, [gemma3_documents] * 2, OPT)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert_same_step(state, before, ref.state_dict(), losses[-1], ref_losses[-1])
    head = [k for k in state if ".vision_tower.head." in k]
    assert head and all(torch.equal(state[k], before[k]) for k in head)
    [patches] = [k for k in state if k.endswith("patch_embedding.weight")]
    assert not torch.equal(state[patches], before[patches])


@pytest.fixture(scope="module")
def paligemma(tmp_path_factory):
    """A tiny PaliGemma, its processor and three documents as the processor writes them (one image, none, two)."""
    processor = paligemma_processor()
    folder = save_paligemma(tmp_path_factory.mktemp("paligemma"), processor)
    docs = [paligemma_document(processor, "what is it", "a cat", [make_image(0)]),
            paligemma_document(processor, "say more", "no more text", []),
            paligemma_document(processor, "same or not", "they differ", [make_image(1), make_image(2)])]
    return folder, processor, docs


def test_paligemmas_prefix_is_marked_from_the_labels_as_its_processor_marks_it(paligemma):
    """token_type_ids 0 over each document's image, bos and prompt (labels -100), 1 over the suffix it labels; every
    prefix of a packed row is type 0 and the body gives them one block, so each document runs alone."""
    folder, _, docs = paligemma
    context = LayerContextBuilder(discover(str(folder)), torch.device("cpu"))
    mb = prepare_micro_batch(packed(docs), torch.device("cpu"), context.document_images)
    assert torch.equal(mb.documents.token_types, torch.cat([d["token_type_ids"] for d in docs], 1))
    assert context.isolate_documents


def test_a_packed_paligemma_rows_prefix_attends_both_ways_within_its_own_document_only(paligemma):
    """Each document of a packed row reaches the layers alone, with the mask transformers builds for it: its prefix
    sees itself both ways, its suffix sees causally, and none of its tokens sees another document's."""
    folder, processor, _ = paligemma
    docs = [paligemma_document(processor, "a longer prompt than the next", "yes", []),
            paligemma_document(processor, "short", "a longer answer here", [])]
    context = LayerContextBuilder(discover(str(folder)), torch.device("cpu"))
    mb = prepare_micro_batch(packed(docs), torch.device("cpu"), context.document_images)
    _, ctx = context(torch.zeros(*mb.input_ids_BT.shape, 32), mb.input_ids_BT, mb.positions, mb.documents)
    for ((s, e), per_layer), doc in zip(ctx.documents, docs, strict=True):
        prefix, n = int((doc["token_type_ids"] == 0).sum()), e - s
        expected = torch.ones(n, n, dtype=torch.bool).tril()
        expected[:prefix, :prefix] = True
        for kw in per_layer:
            mask = kw["attention_mask"][0, 0]
            assert torch.equal(mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2, expected)


@pytest.mark.parametrize(("engine_kw", "freeze"), [({}, (True, False)), ({"schedule": "resident"}, (False, False))],
                         ids=["stream-frozen-tower", "resident-all-trained"])
def test_paligemma_step_equals_transformers_on_its_processors_documents(paligemma, engine_kw, freeze):
    """The engine marks each prefix from the labels; transformers reads the processor's own token_type_ids."""
    folder, _, docs = paligemma
    losses, before, state, _ = engine_steps(folder, [[packed(docs)]] * 2, freeze, **engine_kw)
    ref = reference_model(folder, *freeze)
    ref_losses = reference_train(ref, [docs] * 2, OPT)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert_same_step(state, before, ref.state_dict(), losses[-1], ref_losses[-1])


def test_evaluate_scores_paligemma_as_transformers_does(paligemma):
    """Forward only: the prefix is marked as in training, and the summed loss is transformers' on each document."""
    folder, _, docs = paligemma
    engine = StreamingEngine(discover(str(folder)), EngineConfig(device="cpu"), OPT, total_steps=1)
    try:
        engine.load_pretrained(folder)
        result = engine.evaluate([packed(docs)])
    finally:
        engine.close()
    ref = reference_model(folder).eval()
    with torch.no_grad():
        ref_sum = sum(ref(**doc, use_cache=False).loss.item() * int((doc["labels"][:, 1:] != -100).sum())
                      for doc in docs)
    assert result.loss_sum.item() == pytest.approx(ref_sum, rel=1e-5)


def test_a_paligemma_row_whose_labels_mark_no_prefix_is_refused(paligemma):
    """Without labels no prefix is marked; labels over an image put it past the prefix: neither is trained."""
    folder, _, docs = paligemma
    images_of = LayerContextBuilder(discover(str(folder)), torch.device("cpu")).document_images
    row = packed(docs)
    with pytest.raises(DatasetError, match="'paligemma' attends both ways over each document's prefix, which its "
                                           "labels mark .* this micro-batch has none"):
        prepare_micro_batch({k: v for k, v in row.items() if k != "labels"}, torch.device("cpu"), images_of)
    with pytest.raises(DatasetError, match=r"the document at tokens \(0, 28\) has an image token at 0, after its first "
                                           "labelled token: its images must lie in its prefix"):
        prepare_micro_batch(row | {"labels": row["input_ids"]}, torch.device("cpu"), images_of)


def test_ernie_vl_routes_each_images_tokens_start_and_end_to_the_vision_experts():
    """ERNIE-VL's layers take `moe_mm_token_type_ids` as its processor marks them (its own code, the token ids the
    config names): an image's tokens, start and end 1, text 0. The sweep's step checks the experts they route to."""
    from transformers import Ernie4_5_VLMoeProcessor

    from tests.vlm_sweep import tiny_vlm_config

    config = tiny_vlm_config("ernie4_5_vl_moe")
    context = LayerContextBuilder(discover(config), torch.device("cpu"))
    start, image, end = config.image_start_token_id, config.image_token_id, config.image_end_token_id
    ids = torch.tensor([[5, start, image, image, end, 6, 7, 8, start, image, end]])
    mb = prepare_micro_batch({"input_ids": ids, "labels": ids}, torch.device("cpu"), context.document_images)
    _, ctx = context(torch.zeros(*ids.shape, config.text_config.hidden_size), mb.input_ids_BT, mb.positions,
                     mb.documents)
    expected = Ernie4_5_VLMoeProcessor.create_moe_mm_token_type_ids(config, ids)
    assert expected.tolist() == [[0, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1]]
    assert all(torch.equal(kw["moe_mm_token_type_ids"], expected) for kw in ctx.whole)


@pytest.mark.parametrize("engine_kw", [{}, {"attn_implementation": "varlen"}], ids=["auto", "varlen"])
def test_llava_step_equals_transformers(tmp_path, engine_kw):
    """CLIP tower whose second-to-last layer's hidden states (collected by transformers' hooks on the layer
    class) feed the projector; the last layer is never read. Two steps, as the projector trains."""
    folder = save_llava(tmp_path)
    docs = hand_made(llava_document)
    losses, before, state, _ = engine_steps(folder, [[packed(docs)]] * 2, **engine_kw)
    ref = reference_model(folder)
    ref_losses = reference_train(ref, [docs] * 2, OPT)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert_same_step(state, before, ref.state_dict(), losses[-1], ref_losses[-1])


def test_llava_with_a_trained_tower_equals_transformers(tmp_path):
    """LLaVA never reads CLIP's post-layernorm nor its last layer (its features come before them): both stay as
    they were, as in transformers, while the layers below train."""
    folder = save_llava(tmp_path)
    docs = hand_made(llava_document)
    losses, before, state, _ = engine_steps(folder, [[packed(docs)]] * 2, (False, False))
    ref = reference_model(folder, False, False)
    ref_losses = reference_train(ref, [docs] * 2, OPT)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert_same_step(state, before, ref.state_dict(), losses[-1], ref_losses[-1])
    unread = [k for k in state if ".post_layernorm." in k or ".layers.2." in k]
    assert unread and all(torch.equal(state[k], before[k]) for k in unread)


@pytest.mark.parametrize(("family", "reason"), [
    ("mllama", "has no get_image_features"),
    ("kosmos-2", "places the image embeddings itself"), ("instructblip", "reads text tokens of its own"),
    ("emu3", "its images become discrete tokens of a VQ-VAE")])
def test_image_text_families_not_trained_are_refused_by_name_and_feature(family, reason):
    from tests.vlm_sweep import image_text_outcome

    outcome = image_text_outcome(family)
    assert outcome.status == "refused" and f"'{family}'" in outcome.reason and reason in outcome.reason


def loader_row(folder, tmp_path, max_seq_len: int) -> tuple[dict, list[dict], int]:
    """LLaMA-Factory rows (one image, none, two) through the folder's processor, packed by the loader into one row;
    that row, its documents as transformers takes each alone (padding left out, its own images' tensors joined), and
    the image token."""
    from mt_ray.data import DataConfig, build_dataloader
    from mt_ray.data.mm_processor import ImageEncoder, load_processor
    from tests.unit.data.test_data_images import chat, mllm_registry

    rows = [chat("<image>What is it?", "A cat.", "0.png"), chat("No picture.", "Fine."),
            chat("<image> and <image>: same?", "No, they differ.", "1.png", "2.png")]
    encoder = ImageEncoder(load_processor(folder))
    config = DataConfig(datasets=["mm"], registry=mllm_registry(tmp_path, rows), max_seq_len=max_seq_len,
                        shuffle=False, packing_window=3)
    batch = next(build_dataloader(config, encoder.processor.tokenizer, 1, images=encoder))
    row = {k: batch[k][:1] for k in ("input_ids", "labels", "position_ids")} | {"images": batch["images"][:1]}
    docs, images = [], iter(batch["images"][0])
    for segment in batch["segment_ids"][0].unique().tolist():
        at = batch["segment_ids"][0] == segment
        ids, labels = batch["input_ids"][0][at][None], batch["labels"][0][at][None]
        if (labels != -100).any():  # not the padding
            runs = "".join("x" if t == encoder.image_token_id else " " for t in ids[0].tolist()).split()
            mine = [next(images) for _ in runs]
            docs.append({"input_ids": ids, "labels": labels} | ({k: torch.cat([m[k] for m in mine]) for k in mine[0]}
                                                                 if mine else {}))
    assert len(docs) >= 2 and any("pixel_values" in d for d in docs)  # a packed row with images
    return row, docs, encoder.image_token_id


def test_the_loaders_packed_image_rows_train_as_transformers_on_each_document(folder, tmp_path):
    """From the registry to the step: the engine's first loss is transformers' on each document alone, its images
    and mrope positions its own."""
    row, docs, image_token = loader_row(folder, tmp_path, 96)
    for doc in docs:
        doc["mm_token_type_ids"] = (doc["input_ids"] == image_token).int()
    [loss], _, _, _ = engine_steps(folder, [[row]])
    [ref_loss] = reference_train(reference_model(folder), [docs], OPT)
    assert loss == pytest.approx(ref_loss, rel=1e-5)


def test_the_loaders_packed_paligemma_rows_train_as_transformers_on_each_document(paligemma, tmp_path):
    """PaliGemma's folder with its processor: each image expands to its tokens, bos and newline in the user's turn,
    so the prefix (up to the answer, which alone carries labels) holds it; transformers gets the token types its
    processor would give that prompt and answer."""
    folder, processor, _ = paligemma
    processor.save_pretrained(folder)
    row, docs, _ = loader_row(folder, tmp_path, 160)
    for doc in docs:
        doc["token_type_ids"] = (doc["labels"] != -100).long().cummax(1).values
    [loss], _, _, _ = engine_steps(folder, [[row]])
    [ref_loss] = reference_train(reference_model(folder), [docs], OPT)
    assert loss == pytest.approx(ref_loss, rel=1e-5)


# Gemma 4's released layouts beyond the sweep's tiny one: keys and values shared across layers, with per-layer
# inputs (E2B, E4B); experts beside each MLP (26B-A4B); keys as values on the global layers and no per-layer
# inputs (31B)
GEMMA4_LAYOUTS = {
    "kv_shared": dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2,
                      num_kv_shared_layers=2),
    "experts": dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16),
    "keys_as_values": dict(attention_k_eq_v=True, num_global_key_value_heads=1, hidden_size_per_layer_input=0),
}


@pytest.mark.parametrize("layout", GEMMA4_LAYOUTS)
def test_gemma4s_released_layouts_train_at_parity(tmp_path, layout):
    """Tower frozen and trained, image tokens attending to each other both ways, the audio tower held."""
    from tests.vlm_sweep import image_text_case, tiny_vlm_config

    config = tiny_vlm_config("gemma4")
    fields = {k: v for k, v in config.text_config.to_dict().items() if k != "per_layer_config"}
    config.text_config = type(config.text_config)(**{**fields, "global_head_dim": 16, **GEMMA4_LAYOUTS[layout]})
    outcome = image_text_case("gemma4", tmp_path, config=config)
    assert outcome.status == "matched", outcome.reason


def test_an_image_embedder_without_a_tower_trains_at_parity_resident(tmp_path):
    """Gemma 4 Unified's vision side is its projector alone: no record pass, no blocks (the sweep streams it)."""
    from tests.vlm_sweep import image_text_case

    outcome = image_text_case("gemma4_unified", tmp_path, schedule="resident")
    assert outcome.status == "matched", outcome.reason


def test_an_image_embedder_without_a_tower_is_sized_as_a_projector():
    """No blocks keep outputs on the device; the embedder runs on image tokens, trained as the projector."""
    from tests.vlm_sweep import tiny_vlm_config

    spec = discover(tiny_vlm_config("gemma4_unified"))
    sizes = vision_sizes(spec, 16)
    assert (sizes.depth, sizes.kept_bytes(4, 2), sizes.merged_params, sizes.tower_trains) == (0, 0, 0, False)
    assert sizes.projector_trains and sizes.projector_params == spec.unit("vision.projector").numel > 0
