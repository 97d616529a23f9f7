"""Packed rows: exact layout, and the same loss as training the examples one by one
on a tiny random Llama (attention kept inside each example by position-id resets)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.masking_utils import find_packed_sequence_indices

from mt_ray.data.packing import build_row, collate, count_valid_tokens, pack_first_fit_decreasing
from mt_ray.data.processor import Processor
from mt_ray.data.schema import IGNORE_INDEX, ChatExample, Message, TextExample, TokenizedExample

M = IGNORE_INDEX


def test_first_fit_decreasing_places_every_example_once_within_capacity() -> None:
    lengths = [5, 3, 8, 2, 7, 1, 4]
    bins = pack_first_fit_decreasing(lengths, 10)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins)
    assert len(bins) == 3  # 30 tokens in bins of 10: optimal here
    assert bins == pack_first_fit_decreasing(lengths, 10)
    with pytest.raises(ValueError, match="does not fit"):
        pack_first_fit_decreasing([11], 10)


def test_build_row_layout_positions_segments_and_padding() -> None:
    a = TokenizedExample(input_ids=(10, 11, 12), labels=(M, 11, 12))
    b = TokenizedExample(input_ids=(20, 21), labels=(M, 21))
    row = build_row([a, b], 8, pad_id=9)
    assert row == {
        "input_ids": [10, 11, 12, 20, 21, 9, 9, 9],
        "labels": [M, 11, 12, M, 21, M, M, M],
        "position_ids": [0, 1, 2, 0, 1, 0, 1, 2],
        "segment_ids": [0, 0, 0, 1, 1, 2, 2, 2],
    }
    with pytest.raises(ValueError, match="more than the row length"):
        build_row([a, b], 4, pad_id=9)


def test_tokenized_example_refuses_a_trained_first_token() -> None:
    with pytest.raises(ValueError, match="labels\\[0\\]"):
        TokenizedExample(input_ids=(1, 2), labels=(1, 2))


def test_segment_ids_equal_what_hf_derives_from_position_ids(tokenizer) -> None:
    examples = tokenized_examples(tokenizer)
    batch = collate([examples[:3], examples[3:5], examples[5:6]], None, tokenizer.pad_token_id)
    assert torch.equal(find_packed_sequence_indices(batch["position_ids"]), batch["segment_ids"])


def tokenized_examples(tokenizer) -> list[TokenizedExample]:
    """Chat (alpaca-like, multi-turn, tool call) and text examples of varied lengths."""
    call = '{"name": "multiply", "arguments": {"a": 2, "b": 3}}'
    chats = [
        ChatExample(messages=(Message("user", "What is the capital of Peru?"), Message("assistant", "Lima"))),
        ChatExample(messages=(Message("user", "What is 2 plus 3?"), Message("assistant", "2 plus 3 is 5."),
                              Message("user", "And doubled?"), Message("assistant", "Doubled, 5 is 10.")),
                    system="You are a concise assistant."),
        ChatExample(messages=(Message("user", "Use the calculator: 2 times 3"), Message("function_call", call),
                              Message("observation", '{"result": 6}'), Message("assistant", "2 times 3 is 6.")),
                    tools=({"name": "multiply"},)),
        ChatExample(messages=(Message("user", "Reverse the word.\ntiger"), Message("assistant", "regit"))),
    ]
    texts = [TextExample("The river runs past the stone garden."), TextExample("apple")]
    processor = Processor(tokenizer, "tokenizer", 96)
    return [t for ex in (*chats, *texts) for t in processor(ex)]


def tiny_llama(tokenizer, attn: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=tokenizer.pad_token_id)
    # float64 so that the 1e-5 tolerance tests the masking, not float32 summation order.
    config._attn_implementation = attn
    return LlamaForCausalLM(config).double().eval()


def summed_loss(model: LlamaForCausalLM, batch: dict[str, torch.Tensor], **kwargs) -> torch.Tensor:
    """Sum of token losses; labels are unshifted, so logits at t score labels[t + 1]."""
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], **kwargs).logits
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("rows", [1, 3], ids=["batch1", "batch3"])
def test_packed_loss_equals_unpacked_loss(tokenizer, attn: str, rows: int) -> None:
    examples = tokenized_examples(tokenizer)
    model = tiny_llama(tokenizer, attn)
    pad = tokenizer.pad_token_id
    groups = [examples] if rows == 1 else [examples[:2], examples[2:4], examples[4:]]
    length = sum(len(e) for e in groups[0]) + 5 if rows == 1 else 128
    packed = collate(groups, length, pad)
    assert packed["input_ids"].shape == (rows, length)
    with torch.no_grad():
        got = summed_loss(model, packed, use_cache=False)
        one_by_one = sum(summed_loss(model, collate([[e]], None, pad), use_cache=False) for e in examples)
        padded = summed_loss(model, collate([[e] for e in examples], None, pad), use_cache=False)
        hf_mean = model(**{k: packed[k] for k in ("input_ids", "labels", "position_ids")}, use_cache=False).loss
    assert got.item() == pytest.approx(one_by_one.item(), abs=1e-5)
    assert padded.item() == pytest.approx(one_by_one.item(), abs=1e-5)
    # Hugging Face's own loss (computed in float32) is the mean over exactly the tokens count_valid_tokens counts.
    assert (hf_mean * count_valid_tokens(packed)).item() == pytest.approx(got.item(), rel=1e-6)


def test_hf_ignores_position_resets_when_a_kv_cache_is_created(tokenizer) -> None:
    """Documents a trap: LlamaConfig.use_cache defaults to True, and with a cache Hugging Face
    skips packed-sequence detection, so attention silently crosses example boundaries.
    The engine must call the model with use_cache=False."""
    examples = tokenized_examples(tokenizer)
    model = tiny_llama(tokenizer, "sdpa")
    packed = collate([examples], None, tokenizer.pad_token_id)
    with torch.no_grad():
        isolated = summed_loss(model, packed, use_cache=False)
        leaky = summed_loss(model, packed)
    assert model.config.use_cache
    assert abs(leaky.item() - isolated.item()) > 1e-3
