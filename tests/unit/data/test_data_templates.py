"""LLaMA-Factory's template names render the text its formatters write (slots copied from its template.py), and
mask as every template does: prompts (with the default system, the assistant header) untrained."""

from __future__ import annotations

import pytest

from mt_ray.data.processor import Processor
from mt_ray.data.schema import IGNORE_INDEX, ChatExample, Message
from mt_ray.data.templates import TEMPLATES
from mt_ray.errors import ConfigError

CHAT = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "q2"}]
# LLaMA-Factory's `_encode` of CHAT: prefix, system (fused into the first user turn for Gemma/Mistral), then slots.
EXPECTED = {
    "qwen": "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n"
            "<|im_start|>user\nq2<|im_end|>\n<|im_start|>assistant\n",
    "llama3": "<|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nhi"
              "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nyo<|eot_id|><|start_header_id|>user"
              "<|end_header_id|>\n\nq2<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    "gemma": "<start_of_turn>user\nS\n\nhi<end_of_turn>\n<start_of_turn>model\nyo<end_of_turn>\n<start_of_turn>user\n"
             "q2<end_of_turn>\n<start_of_turn>model\n",
    "mistral": "[INST] S\n\nhi[/INST] yo<|endoftext|>[INST] q2[/INST]",
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_llamafactory_templates_write_its_text(tokenizer, name):
    assert tokenizer.apply_chat_template(CHAT, chat_template=TEMPLATES[name].jinja, tokenize=False) == EXPECTED[name]


def test_default_system_and_reasoning_thought(tokenizer):
    """qwen's default system prompt stands in for a missing one; qwen3 trains an empty thought, qwen3_nothink none."""
    example = ChatExample(messages=(Message("user", "hi"), Message("assistant", "yo")))
    texts = {}
    for name in ("qwen", "qwen3", "qwen3_nothink"):
        (piece,) = Processor(tokenizer, name, 128)(example)
        texts[name] = tokenizer.decode(piece.input_ids)
        trained = tokenizer.decode([t for t, label in zip(piece.input_ids, piece.labels, strict=True)
                                    if label != IGNORE_INDEX])
        assert trained == ("<think>\n\n</think>\n\nyo<|im_end|>" if name == "qwen3" else "yo<|im_end|>")
    assert texts["qwen"].startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")
    assert texts["qwen3_nothink"].startswith("<|im_start|>user\nhi")


def test_tools_are_refused_by_name(tokenizer):
    example = ChatExample(messages=(Message("user", "hi"), Message("assistant", "yo")),
                          tools=({"type": "function", "function": {"name": "f"}},))
    with pytest.raises(ConfigError, match="data.template 'qwen': tool schemas are not rendered"):
        Processor(tokenizer, "qwen", 128)(example)


def test_a_template_whose_special_tokens_the_tokenizer_splits_is_refused(tokenizer):
    """llama3 on the (ChatML) tiny tokenizer: `<|eot_id|>` would train as ordinary text and never end a turn."""
    with pytest.raises(ConfigError) as refused:
        Processor(tokenizer, "llama3", 128)
    message = str(refused.value)
    assert message.startswith("data.template: llama3's special tokens are not single tokens of this tokenizer: "
                              "<|start_header_id|> (15 tokens), <|end_header_id|> (14 tokens), <|eot_id|> (10 tokens)")
    assert "set data.template to tokenizer" in message and "\n" not in message
    fitting = message.rsplit("fits this tokenizer: ", 1)[1].split(", ")
    assert {"chatml", "qwen", "qwen3_nothink", "alpaca"} <= set(fitting)
    assert not {"llama3", "gemma", "phi4", "deepseek3"} & set(fitting)
