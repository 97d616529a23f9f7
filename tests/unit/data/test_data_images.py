"""LLaMA-Factory's multimodal rows: images through the model folder's own processor, image and prompt tokens
masked, packed rows kept in order; bad images and placeholders named by row and path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mt_ray.data import DataConfig, build_dataloader, demo_registry_path
from mt_ray.data.mm_processor import ImageEncoder, check_processor_files, load_processor
from mt_ray.data.prefetch import BackgroundLoader
from mt_ray.errors import ConfigError, DatasetError
from tests.vlm_models import make_image, save_qwen_vl

TAGS = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_qwen_vl(tmp_path_factory.mktemp("qwen2_5_vl"))


@pytest.fixture(scope="module")
def encoder(folder):
    return ImageEncoder(load_processor(folder))


def mllm_registry(tmp_path: Path, rows: list[dict], formatting: str = "sharegpt") -> Path:
    """A registry like LLaMA-Factory's mllm_demo entry, images relative to it."""
    (tmp_path / "pics").mkdir(exist_ok=True)
    for i in range(3):
        make_image(i, 8 + 8 * i, 16).save(tmp_path / "pics" / f"{i}.png")
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    if formatting == "sharegpt":
        entry = {"file_name": "rows.json", "formatting": "sharegpt", "tags": TAGS,
                 "columns": {"messages": "messages", "images": "images"}}
    else:
        entry = {"file_name": "rows.json", "columns": {"prompt": "instruction", "response": "output", "images": "images"}}
    (tmp_path / "dataset_info.json").write_text(json.dumps({"mm": entry}))
    return tmp_path


def chat(user: str, answer: str, *images: str) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}],
            "images": [f"pics/{i}" for i in images]}


def loader(registry: Path, tokenizer, encoder, **data):
    config = DataConfig(datasets=["mm"], registry=registry, max_seq_len=data.pop("max_seq_len", 256), shuffle=False,
                        packing_window=data.pop("packing_window", 4), **data)
    return build_dataloader(config, tokenizer, 2, images=encoder)


def test_image_placeholders_expand_and_image_tokens_carry_no_loss(tmp_path, encoder):
    rows = [chat("<image>What is it?", "A cat.", "0.png"), chat("No picture here.", "Fine."),
            chat("<image> and <image>: same?", "No.", "1.png", "2.png")]
    batch = next(loader(mllm_registry(tmp_path, rows), encoder.processor.tokenizer, encoder, packing=False))
    ids, labels = batch["input_ids"], batch["labels"]
    image = ids == encoder.image_token_id
    assert not (labels[image] != -100).any()
    grids = [img["image_grid_thw"] for row in batch["images"] for img in row]
    assert int(image.sum()) == sum(int(g.prod()) // 4 for g in grids)  # merge 2x2: the processor's own count
    # Each row's images, in token order, with their own pixel values (16 patches of 3*2*4*4 values per grid cell).
    for row_ids, row_images in zip(ids, batch["images"], strict=True):
        runs = [len(r) for r in "".join("x" if t == encoder.image_token_id else " " for t in row_ids).split()]
        assert runs == [int(img["image_grid_thw"].prod()) // 4 for img in row_images]
        for img in row_images:
            assert img["pixel_values"].shape == (int(img["image_grid_thw"].prod()), 3 * 2 * 4 * 4)
    trained = labels != -100
    assert trained.any()
    text = encoder.processor.tokenizer.decode(ids[0][trained[0]])
    assert "What is it" not in text and "A cat." in text  # the prompt is masked too


def test_alpaca_rows_take_images_too(tmp_path, encoder):
    rows = [{"instruction": "<image>Describe it.", "output": "Red.", "images": ["pics/0.png"]}]
    batch = next(loader(mllm_registry(tmp_path, rows, "alpaca"), encoder.processor.tokenizer, encoder))
    tokens = int((batch["input_ids"][0] == encoder.image_token_id).sum())
    assert batch["images"][0] and tokens == sum(int(img["image_grid_thw"].prod()) // 4 for img in batch["images"][0])


def test_packed_rows_keep_their_images_in_token_order(tmp_path, encoder):
    rows = [chat(f"<image>Picture {i}?", f"Answer {i}.", f"{i % 3}.png") for i in range(4)]
    batch = next(loader(mllm_registry(tmp_path, rows), encoder.processor.tokenizer, encoder, packing=True))
    assert max(len(r) for r in batch["images"]) > 1  # several image documents share a row
    for row_ids, row_images in zip(batch["input_ids"], batch["images"], strict=True):
        runs = [len(r) for r in "".join("x" if t == encoder.image_token_id else " " for t in row_ids).split()]
        assert runs == [int(img["image_grid_thw"].prod()) // 4 for img in row_images]  # images differ in size


@pytest.mark.parametrize(("row", "message"), [
    (chat("<image>Hi", "Yo.", "missing.png"), r"rows.json row 1: image 'pics/missing.png' not found at .*missing.png"),
    (chat("<image>Hi", "Yo.", "broken.png"), r"rows.json row 1: image 'pics/broken.png' at .*broken.png cannot be read"),
    (chat("<image><image>Hi", "Yo.", "0.png"), r"rows.json row 1: 2 <image> placeholders but 1 images"),
    (chat("Hi", "Yo.", "0.png"), r"rows.json row 1: 0 <image> placeholders but 1 images"),
])
def test_bad_images_and_placeholders_name_the_row(tmp_path, encoder, row, message):
    registry = mllm_registry(tmp_path, [row, chat("<image>Fine", "Yes.", "0.png")])
    (tmp_path / "pics" / "broken.png").write_bytes(b"not an image")
    with pytest.raises(DatasetError, match=message):
        next(loader(registry, encoder.processor.tokenizer, encoder))
    skipping = loader(registry, encoder.processor.tokenizer, encoder, on_bad_row="skip")
    next(skipping)
    assert skipping.stats()["bad_rows"] == {"mm": 1}


def test_an_image_that_does_not_fit_names_the_row(tmp_path, encoder):
    registry = mllm_registry(tmp_path, [chat("<image>Hi", "Yo.", "2.png"), chat("Hi", "Yo.")])
    with pytest.raises(DatasetError, match=r"row 1: its 1 images take 6 image tokens, which do not all fit in "
                                           r"data.max_seq_len=8"):
        next(loader(registry, encoder.processor.tokenizer, encoder, max_seq_len=8))


def test_image_rows_for_a_text_model_are_refused(tmp_path, encoder):
    registry = mllm_registry(tmp_path, [chat("<image>Hi", "Yo.", "0.png")])
    with pytest.raises(DatasetError, match="row 1: the row has images, but the model is not an image-text model"):
        next(loader(registry, encoder.processor.tokenizer, None))


def test_missing_processor_files_are_listed(tmp_path, folder):
    for name in ("config.json", "tokenizer.json"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    with pytest.raises(ConfigError, match=r"lacks the image processor \(preprocessor_config.json or "
                                          r"processor_config.json\)"):
        check_processor_files(tmp_path)
    (tmp_path / "preprocessor_config.json").write_bytes((folder / "preprocessor_config.json").read_bytes())
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match=r"lacks the tokenizer \(one of tokenizer.json"):
        check_processor_files(tmp_path)


def test_the_demo_mllm_entry_loads(encoder):
    config = DataConfig(datasets=["demo_mllm"], registry=demo_registry_path(), max_seq_len=128)
    batch = next(build_dataloader(config, encoder.processor.tokenizer, 4, images=encoder))
    assert sum(len(r) for r in batch["images"]) >= 4


def test_the_loader_worker_resumes_exactly(tmp_path, encoder):
    """Batches come from the worker thread; its state is the position after the last batch handed out."""
    rows = [chat(f"<image>Picture {i}?", f"Answer {i}.", f"{i % 3}.png") for i in range(9)]
    registry = mllm_registry(tmp_path, rows)
    plain = loader(registry, encoder.processor.tokenizer, encoder, packing_window=2)
    expected = [next(plain)["input_ids"] for _ in range(5)]
    worker = BackgroundLoader(loader(registry, encoder.processor.tokenizer, encoder, packing_window=2))
    try:
        got = [next(worker)["input_ids"] for _ in range(2)]
        state = worker.state_dict()
        got.append(next(worker)["input_ids"])
        worker.load_state_dict(state)
        got += [next(worker)["input_ids"] for _ in range(3)]
    finally:
        worker.close()
    assert all(torch.equal(a, b) for a, b in zip(got[:3] + got[4:], expected, strict=True))
    assert torch.equal(got[3], expected[2])
