"""Named chat templates (Jinja, in the Hugging Face ``chat_template`` convention).

``DataConfig.template`` picks one of these by name, or ``"tokenizer"`` for the tokenizer's own
template. A template must be prefix-stable (rendering one more turn only appends text), because
the processor masks labels by rendering turn by turn.

Besides mt-ray's ``chatml`` (with tools), the names are LLaMA-Factory's (``src/llamafactory/data/
template.py``), each rendering the text LLaMA-Factory's formatters write: its user slot ends with the
assistant header, its default system prompt is used when a conversation has none, and a fused system
(Gemma, Mistral, Llama 2) is written at the start of the first user turn. A reasoning template
(``qwen3``) adds LLaMA-Factory's empty thought, ``<think>\\n\\n</think>\\n\\n``, to a response that has
none, and trains on it, as LLaMA-Factory does with its default ``enable_thinking: true``. These
templates render plain conversations; a tool schema, tool call or tool result is refused by name
(LLaMA-Factory writes each family's tool format differently; the model's own template, ``tokenizer``,
or ``chatml`` handle tools). ``stop_words`` are the tokens that end a response, which an export
writes into ``generation_config.json``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# ChatML. Assistant tool calls render as <tool_call>{json}</tool_call>, tool results as
# a "tool" turn, and the tool schemas go into the system turn, as Qwen-style templates do.
CHATML = (
    "{%- if messages and messages[0].role == 'system' %}{%- set system = messages[0].content %}"
    "{%- else %}{%- set system = '' %}{%- endif %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}{%- if system %}{{- system + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>\\n' }}{%- for tool in tools %}{{- tool | tojson + '\\n' }}{%- endfor %}"
    "{{- '</tools><|im_end|>\\n' }}"
    "{%- elif system %}{{- '<|im_start|>system\\n' + system + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- if message.tool_calls is defined and message.tool_calls %}"
    "{%- for call in message.tool_calls %}"
    "{{- '<tool_call>' + {'name': call.function.name, 'arguments': call.function.arguments} | tojson"
    " + '</tool_call>' }}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role != 'system' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

EMPTY_THOUGHT = "<think>\n\n</think>\n\n"  # LLaMA-Factory's thought_words, empty
_MARK = re.compile(r"(\{content\}|\{bos\}|\{eos\})")
# The markup tokens a template writes that a tokenizer made for it holds as one special token each: ChatML's and
# Llama 3's `<|...|>`, DeepSeek's `<｜...｜>`, Gemma's turn marks. (Llama 2's and Mistral's `[INST]` are text.)
_SPECIAL = re.compile(r"<\|[^|\s']+\|>|<｜[^｜\s']+｜>|<(?:start|end)_of_turn>")


@dataclass(frozen=True)
class ChatTemplate:
    """A named template: its Jinja and the tokens that end a response (for `generation_config.json`)."""

    jinja: str
    stop_words: tuple[str, ...] = ()

    @property
    def special_tokens(self) -> tuple[str, ...]:
        """The markup tokens the template writes, which only a tokenizer holding each as one token can learn: split
        into ordinary tokens, an end of turn is text the model never learns to stop at."""
        return tuple(dict.fromkeys(_SPECIAL.findall(self.jinja)))

    def split_tokens(self, tokenizer: PreTrainedTokenizerBase) -> dict[str, int]:
        """Each special token `tokenizer` does not hold as one token, with the number of tokens it becomes."""
        counts = {t: len(tokenizer.encode(t, add_special_tokens=False)) for t in self.special_tokens}
        return {t: n for t, n in counts.items() if n != 1}


def fitting_templates(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """The named templates whose special tokens are all single tokens of `tokenizer`."""
    return [name for name, template in sorted(TEMPLATES.items()) if not template.split_tokens(tokenizer)]


def _literal(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


def _expr(slot: str, content: str = "content") -> str:
    """A slot (`{content}`, `{bos}`, `{eos}` marked) as one Jinja expression; `{content}` reads variable `content`."""
    parts = []
    for piece in _MARK.split(slot):
        if piece == "{content}":
            parts.append(content)
        elif piece in ("{bos}", "{eos}"):
            parts.append(f"({piece[1:-1]}_token or '')")
        elif piece:
            parts.append(_literal(piece))
    return " + ".join(parts) or "''"


def llamafactory_template(user: str, assistant: str = "{content}{eos}", system: str = "{content}", prefix: str = "",
                          default_system: str = "", fuse_system: bool = False, thinking: bool = False) -> str:
    """Jinja that writes what LLaMA-Factory's `register_template` slots write (see the module docstring)."""
    fused = "{%- if loop.first and system %}{%- set content = " + _expr(system, "system") + " + content %}{%- endif %}"
    return (
        "{%- if tools %}{{- raise_exception('tool schemas are not rendered by this template') }}{%- endif %}"
        "{%- if messages and messages[0].role == 'system' %}{%- set system = messages[0].content %}"
        "{%- set turns = messages[1:] %}{%- else %}{%- set system = " + _literal(default_system) + " %}{%- set turns = messages %}"
        "{%- endif %}"
        "{{- " + _expr(prefix) + " }}"
        + ("" if fuse_system else "{%- if system %}{{- " + _expr(system, "system") + " }}{%- endif %}")
        + "{%- for message in turns %}{%- set content = message.content %}"
        "{%- if message.role == 'user' %}" + (fused if fuse_system else "") + "{{- " + _expr(user) + " }}"
        "{%- elif message.role == 'assistant' and not message.tool_calls %}"
        + ("{%- if '<think>' not in content and '</think>' not in content %}"
           "{%- set content = " + _literal(EMPTY_THOUGHT) + " + content %}{%- endif %}" if thinking else "")
        + "{{- " + _expr(assistant) + " }}"
        "{%- else %}{{- raise_exception('a ' + message.role + ' turn with tool calls or results is not rendered by "
        "this template') }}{%- endif %}{%- endfor %}"
    )


def _lf(user: str, stop_words: tuple[str, ...] = (), **kwargs) -> ChatTemplate:
    return ChatTemplate(llamafactory_template(user, **kwargs), stop_words)


_IM = "<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"
_IM_PARTS = {"assistant": "{content}<|im_end|>\n", "system": "<|im_start|>system\n{content}<|im_end|>\n",
             "stop_words": ("<|im_end|>",)}
_GEMMA = {"assistant": "{content}<end_of_turn>\n", "system": "{content}\n\n", "prefix": "{bos}", "fuse_system": True}
_LLAMA3_USER = ("<|start_header_id|>user<|end_header_id|>\n\n{content}<|eot_id|>"
                "<|start_header_id|>assistant<|end_header_id|>\n\n")

TEMPLATES: dict[str, ChatTemplate] = {
    "chatml": ChatTemplate(CHATML, ("<|im_end|>",)),
    # LLaMA-Factory's, slot for slot.
    "alpaca": _lf("### Instruction:\n{content}\n\n### Response:\n", assistant="{content}{eos}\n\n",
                  default_system="Below is an instruction that describes a task. Write a response that appropriately "
                                 "completes the request.\n\n"),
    "default": _lf("Human: {content}{eos}\nAssistant:", assistant="{content}{eos}\n", system="System: {content}{eos}\n"),
    "empty": _lf("{content}", assistant="{content}"),
    "deepseek3": _lf("<｜User｜>{content}<｜Assistant｜>", prefix="{bos}"),
    "gemma": _lf("<start_of_turn>user\n{content}<end_of_turn>\n<start_of_turn>model\n", ("<end_of_turn>",), **_GEMMA),
    "gemma2": _lf("<start_of_turn>user\n{content}<end_of_turn>\n<start_of_turn>model\n", ("<eos>", "<end_of_turn>"),
                  **_GEMMA),
    "gemma3": _lf("<start_of_turn>user\n{content}<end_of_turn>\n<start_of_turn>model\n", ("<end_of_turn>",), **_GEMMA),
    "llama2": _lf("{bos}[INST] {content} [/INST]", system="<<SYS>>\n{content}\n<</SYS>>\n\n", fuse_system=True),
    "llama3": _lf(_LLAMA3_USER, ("<|eot_id|>", "<|eom_id|>"), assistant="{content}<|eot_id|>",
                  system="<|start_header_id|>system<|end_header_id|>\n\n{content}<|eot_id|>", prefix="{bos}"),
    "mistral": _lf("[INST] {content}[/INST]", assistant=" {content}{eos}", system="{content}\n\n", prefix="{bos}",
                   fuse_system=True),
    "phi4": _lf("<|im_start|>user<|im_sep|>{content}<|im_end|><|im_start|>assistant<|im_sep|>", ("<|im_end|>",),
                assistant="{content}<|im_end|>", system="<|im_start|>system<|im_sep|>{content}<|im_end|>"),
    "qwen": _lf(_IM, **_IM_PARTS, default_system="You are Qwen, created by Alibaba Cloud. You are a helpful assistant."),
    "qwen2_vl": _lf(_IM, **_IM_PARTS, default_system="You are a helpful assistant."),
    "qwen3": _lf(_IM, **_IM_PARTS, thinking=True),
    "qwen3_nothink": _lf(_IM, **_IM_PARTS),
    "qwen3_vl": _lf(_IM, **_IM_PARTS, thinking=True),
    "qwen3_vl_nothink": _lf(_IM, **_IM_PARTS),
    "qwen3_5": _lf(_IM, **_IM_PARTS, thinking=True),
    "qwen3_5_nothink": _lf(_IM, **_IM_PARTS),
    "vicuna": _lf("USER: {content} ASSISTANT:",
                  default_system="A chat between a curious user and an artificial intelligence assistant. The "
                                 "assistant gives helpful, detailed, and polite answers to the user's questions."),
}
