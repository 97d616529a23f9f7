"""Label masks are exactly right: expected ids and labels are built here by tokenizing
hand-written ChatML pieces, independently of the template rendering under test."""

from __future__ import annotations

import copy
import json

import pytest

from mt_ray.data.processor import Processor, infer_seqlen
from mt_ray.data.schema import IGNORE_INDEX, ChatExample, Message, TextExample
from mt_ray.errors import ConfigError

CALL = json.dumps({"name": "multiply", "arguments": {"a": 2, "b": 3}})


def expected(tokenizer, pieces: list[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    """Token ids and labels of hand-written (text, trained) pieces; the first label is always masked."""
    ids: list[int] = []
    labels: list[int] = []
    for text, trained in pieces:
        piece = tokenizer.encode(text, add_special_tokens=False)
        ids += piece
        labels += piece if trained else [IGNORE_INDEX] * len(piece)
    labels[0] = IGNORE_INDEX
    return ids, labels


def run(tokenizer, example, template: str = "tokenizer", max_seq_len: int = 512):
    out = Processor(tokenizer, template, max_seq_len)(example)
    assert len(out) == 1
    return list(out[0].input_ids), list(out[0].labels)


def test_alpaca_mask_trains_only_the_response_and_its_end_of_turn(tokenizer) -> None:
    example = ChatExample(messages=(Message("user", "Add.\n2 3"), Message("assistant", "5")))
    assert run(tokenizer, example) == expected(tokenizer, [
        ("<|im_start|>user\nAdd.\n2 3<|im_end|>\n<|im_start|>assistant\n", False),
        ("5<|im_end|>", True),
        ("\n", False),
    ])


def test_multi_turn_sharegpt_with_system_tools_function_call_and_observation(tokenizer) -> None:
    example = ChatExample(
        messages=(Message("user", "2*3?"), Message("function_call", CALL), Message("observation", '{"r": 6}'),
                  Message("assistant", "6"), Message("user", "Thanks"), Message("assistant", "Welcome")),
        system="Sys", tools=({"name": "multiply"},))
    assert run(tokenizer, example) == expected(tokenizer, [
        ('<|im_start|>system\nSys\n\n# Tools\n<tools>\n{"name": "multiply"}\n</tools><|im_end|>\n'
         "<|im_start|>user\n2*3?<|im_end|>\n<|im_start|>assistant\n", False),
        ('<tool_call>{"name": "multiply", "arguments": {"a": 2, "b": 3}}</tool_call><|im_end|>', True),
        ('\n<|im_start|>tool\n{"r": 6}<|im_end|>\n<|im_start|>assistant\n', False),
        ("6<|im_end|>", True),
        ("\n<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n", False),
        ("Welcome<|im_end|>", True),
        ("\n", False),
    ])


def test_system_without_tools_and_named_template_matches(tokenizer) -> None:
    example = ChatExample(messages=(Message("user", "Hi"), Message("assistant", "Yo")), system="Be brief.")
    want = expected(tokenizer, [
        ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", False),
        ("Yo<|im_end|>", True),
        ("\n", False),
    ])
    assert run(tokenizer, example) == want
    assert run(tokenizer, example, template="chatml") == want


def test_plain_text_trains_every_token_and_ends_with_eos(tokenizer) -> None:
    ids = tokenizer.encode("The capital of France is Paris.", add_special_tokens=False) + [tokenizer.eos_token_id]
    assert run(tokenizer, TextExample("The capital of France is Paris.")) == (ids, [IGNORE_INDEX] + ids[1:])


def test_long_text_is_cut_into_chunks_that_each_start_masked(tokenizer) -> None:
    text = " ".join(["river stone garden planet"] * 20)
    full = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    chunks = Processor(tokenizer, "tokenizer", 16)(TextExample(text))
    assert [i for c in chunks for i in c.input_ids] == full
    assert all(len(c) <= 16 and list(c.labels) == [IGNORE_INDEX, *c.input_ids[1:]] for c in chunks)


@pytest.mark.parametrize(("args", "want"), [
    ((3000, 2000, 1000), (600, 400)), ((2000, 3000, 1000), (400, 600)), ((1000, 100, 1000), (900, 100)),
    ((100, 1000, 1000), (100, 900)), ((100, 500, 1000), (100, 500)), ((500, 100, 1000), (500, 100)),
    ((10, 10, 1000), (10, 10)),
])
def test_infer_seqlen_matches_llamafactory(args: tuple[int, int, int], want: tuple[int, int]) -> None:
    assert infer_seqlen(*args) == want


def test_truncation_keeps_prompt_and_response_budget_and_mask_alignment(tokenizer) -> None:
    example = ChatExample(messages=(Message("user", "Tell me. " * 30), Message("assistant", "Sure thing. " * 30)))
    full_ids, full_labels = run(tokenizer, example)
    ids, labels = run(tokenizer, example, max_seq_len=64)
    assert len(ids) == 64
    n_prompt = full_labels.index(next(label for label in full_labels if label != IGNORE_INDEX))
    n_src, n_tgt = infer_seqlen(n_prompt, len(full_ids) - n_prompt, 64)
    assert ids == full_ids[:n_src] + full_ids[n_prompt:n_prompt + n_tgt]
    assert labels == [IGNORE_INDEX] * n_src + full_labels[n_prompt:n_prompt + n_tgt]


def test_example_with_nothing_left_to_train_is_dropped(tokenizer) -> None:
    example = ChatExample(messages=(Message("user", "Hi"), Message("assistant", "Yo")))
    assert Processor(tokenizer, "tokenizer", 1)(example) == []


def test_template_errors(tokenizer) -> None:
    with pytest.raises(ConfigError, match="unknown template 'nope'"):
        Processor(tokenizer, "nope", 64)
    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    with pytest.raises(ConfigError, match="has no chat template"):
        Processor(bare, "tokenizer", 64)
    # A template that rewrites earlier turns (here: it drops all but the last two) cannot be masked turn by turn.
    bare.chat_template = "{% for m in messages[-2:] %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    example = ChatExample(messages=(Message("user", "a"), Message("assistant", "b"),
                                    Message("user", "c"), Message("assistant", "d")))
    with pytest.raises(ConfigError, match="not prefix-stable"):
        Processor(bare, "tokenizer", 64)(example)
