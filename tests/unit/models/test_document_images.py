"""A packed row's images go to the documents whose image tokens they fill, and each document's rotary positions
are what the family's `get_rope_index` gives it alone."""

from __future__ import annotations

import pytest
import torch

from mt_ray.models.discovery import discover
from mt_ray.models.document_images import DocumentImages, image_runs, suffix_mask
from tests.vlm_sweep import tiny_vlm_config


@pytest.fixture(scope="module")
def qwen3_5():
    return discover(tiny_vlm_config("qwen3_5")).vision


def _image(k: int) -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.full((1, 2), float(k)), "image_grid_thw": torch.tensor([[1, 4, 4]])}


def test_each_image_run_is_one_image():
    assert [image_runs(torch.tensor(m, dtype=torch.bool)) for m in ([], [0, 0], [1, 1, 0], [0, 1, 0, 1, 1], [1, 0, 1])] \
        == [0, 0, 1, 2, 2]


def test_a_documents_suffix_starts_at_its_own_first_labelled_token():
    """PaliGemma's prefix: what comes before each document's first labelled token (a document labelled nowhere is all
    prefix, whatever the documents before it hold)."""
    labelled = torch.tensor([0, 0, 1, 0, 1, 0, 0, 0, 1, 1, 0], dtype=torch.bool)
    assert suffix_mask(labelled, [(0, 5), (5, 8), (8, 11)]).int().tolist() == [0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 1]


def test_a_documents_images_are_its_runs_of_image_tokens_row_after_row(qwen3_5):
    X = qwen3_5.image_token_id
    ids = torch.tensor([[X, X, 5, X, 6, 7, 8, 9],    # a document with two images, one with none
                        [X, 5, 6, 7, X, X, X, 4]])  # one image each
    spans = [(0, 5), (5, 8), (8, 12), (12, 16)]
    split = DocumentImages(qwen3_5, per_document=True).split(ids, spans, [_image(k) for k in range(4)])
    assert [[int(i["pixel_values"][0, 0]) for i in d] for d in split] == [[0, 1], [], [2], [3]]
    with pytest.raises(ValueError, match="3 images but its image tokens make 4"):
        DocumentImages(qwen3_5, per_document=True).split(ids, spans, [_image(k) for k in range(3)])


def test_where_the_family_fixes_each_images_tokens_a_run_may_hold_several_images():
    """PaliGemma's processor writes a document's images as one run, `num_image_tokens` (16 here) each."""
    paligemma = discover(tiny_vlm_config("paligemma")).vision
    X = paligemma.image_token_id
    ids = torch.tensor([[X] * 32 + [5, 6] + [X] * 16 + [7]])
    split = DocumentImages(paligemma, per_document=True).split(ids, [(0, 34), (34, 51)], [_image(k) for k in range(3)])
    assert [[int(i["pixel_values"][0, 0]) for i in d] for d in split] == [[0, 1], [2]]


def test_images_are_split_only_where_something_reads_the_split(qwen3_5):
    llava = discover(tiny_vlm_config("llava")).vision
    ids = torch.tensor([[llava.image_token_id, 5, 6]])
    assert DocumentImages(llava, per_document=False).split(ids, [(0, 3)], [_image(0)]) is None
    assert DocumentImages(llava, per_document=True).split(ids, [(0, 3)], [_image(0)]) is not None
    assert DocumentImages(qwen3_5, per_document=True).split(ids, [(0, 3)], []) is None


def test_rope_positions_number_each_document_as_it_is_alone(qwen3_5):
    X = qwen3_5.image_token_id
    first, second = [5, X, X, X, X, 6, 7], [8, 9, X, X, X, X, 4, 3, 2]  # a 4x4 grid: 2x2 merged tokens
    ids = torch.tensor([first + second])
    positions = torch.cat([torch.arange(len(first)), torch.arange(len(second))])[None]
    images_of = DocumentImages(qwen3_5, per_document=True)
    spans = [(0, len(first)), (len(first), ids.shape[1])]
    rope = images_of.rope_positions(ids, positions, spans, images_of.split(ids, spans, [_image(0), _image(1)]))
    assert torch.equal(rope[0], positions)  # the text positions, which keep the documents apart
    for (s, e), doc in zip(spans, (first, second), strict=True):
        alone = torch.tensor([doc])
        expected, _ = qwen3_5.outer.get_rope_index(alone, mm_token_type_ids=(alone == X).int(),
                                                   image_grid_thw=torch.tensor([[1, 4, 4]]))
        assert torch.equal(rope[1:, :, s:e], expected)
