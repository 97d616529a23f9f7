"""Renders examples with a chat template, tokenizes them and builds the label mask.

Masking is done turn by turn, as LLaMA-Factory does: the conversation is rendered one
prefix at a time (``render(turns[:k])``, then with the assistant header, then through
turn ``k``), each new piece of text is tokenized on its own, and the pieces are
concatenated. Prompt pieces (system, user, tool results, assistant headers) get label
``-100``; an assistant piece is trained up to and including its last special token
(the end-of-turn token, e.g. ``<|im_end|>``), and the formatting after it (the newline
between turns) is not, since the model never has to generate it. Tokenizing pieces
separately means token boundaries always fall on turn boundaries, so no token straddles
prompt and response.

Labels are not shifted: ``labels[t]`` is the target for the logits at ``t - 1`` (the
Hugging Face convention; the model shifts). ``labels[0]`` is always ``-100``.

Preference examples (``preference``): a pair gives two sequences, the prompt followed by the chosen
and by the rejected response, with the prompt (earlier turns included) masked and the final response
trained as an SFT response is; a KTO example gives one. The sequences of one example share a row, so
each is cut to half of ``max_seq_len``, prompt and responses as LLaMA-Factory cuts a pair (the longer
response decides).

Images: each ``<image>`` placeholder becomes the family's image text, and after tokenizing, the
run of image tokens the model's processor expands it into (``ImageEncoder``); the images are
decoded here, in the loader's worker. Image tokens are prompt tokens: never trained on. An example
whose image tokens do not all fit in ``max_seq_len`` is refused (a cut image cannot be trained).
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from mt_ray.data.converters import parse_function_call
from mt_ray.data.mm_processor import ImageEncoder
from mt_ray.data.schema import (
    IGNORE_INDEX,
    IMAGE_PLACEHOLDER,
    ROLE_CHOSEN,
    ROLE_DESIRABLE,
    ROLE_REJECTED,
    ROLE_UNDESIRABLE,
    ChatExample,
    Example,
    FeedbackExample,
    Message,
    PairExample,
    TextExample,
    TokenizedExample,
)
from mt_ray.data.templates import TEMPLATES, fitting_templates
from mt_ray.errors import ConfigError, DatasetError

TOKENIZER_TEMPLATE = "tokenizer"

# (prompt token ids, response token ids, response labels) for one prompt/response exchange
_Pair = tuple[list[int], list[int], list[int]]


def infer_seqlen(source_len: int, target_len: int, cutoff_len: int) -> tuple[int, int]:
    """Split ``cutoff_len`` between a prompt and a response (LLaMA-Factory's rule).

    A short response keeps all its tokens and the prompt is cut; a short prompt keeps
    its tokens and the response is cut; otherwise both shrink in proportion.
    """
    if target_len * 2 < cutoff_len:
        max_target_len = cutoff_len
    elif source_len * 2 < cutoff_len:
        max_target_len = cutoff_len - source_len
    else:
        max_target_len = int(cutoff_len * (target_len / (source_len + target_len)))
    new_target_len = min(max_target_len, target_len)
    new_source_len = min(max(cutoff_len - new_target_len, 0), source_len)
    return new_source_len, new_target_len


def to_hf_messages(example: ChatExample) -> list[dict[str, Any]]:
    """Map the schema's roles onto Hugging Face chat-template messages."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": example.system}] if example.system else []
    for m in example.messages:
        if m.role == "function_call":
            calls = [{"type": "function", "function": {"name": c["name"], "arguments": _arguments(c["arguments"])}}
                     for c in parse_function_call(m.content)]
            messages.append({"role": "assistant", "content": "", "tool_calls": calls})
        elif m.role == "observation":
            messages.append({"role": "tool", "content": m.content})
        else:
            messages.append({"role": m.role, "content": m.content})
    return messages


def _arguments(arguments: Any) -> Any:
    """Templates expect arguments as a dict; LLaMA-Factory data sometimes holds a JSON string."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def check_template_fits(template: str, tokenizer: PreTrainedTokenizerBase) -> None:
    """Refuse a named template whose special tokens the tokenizer splits: the model would learn its end of turn as
    ordinary text and never stop generating."""
    split = TEMPLATES[template].split_tokens(tokenizer)
    if split:
        tokens = ", ".join(f"{t} ({n} tokens)" for t, n in split.items())
        raise ConfigError(
            f"data.template: {template}'s special tokens are not single tokens of this tokenizer: {tokens}, so the "
            f"model would never learn to end a turn; set data.template to tokenizer (the model's own template) or one "
            f"that fits this tokenizer: {', '.join(fitting_templates(tokenizer))}")


class Processor:
    """Turns one ``Example`` into ``TokenizedExample``s of at most ``max_seq_len`` tokens."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, template: str, max_seq_len: int,
                 images: ImageEncoder | None = None):
        if template != TOKENIZER_TEMPLATE and template not in TEMPLATES:
            raise ConfigError(f"data.template: unknown template '{template}' (use 'tokenizer' or {sorted(TEMPLATES)})")
        if template == TOKENIZER_TEMPLATE and not tokenizer.chat_template:
            raise ConfigError(
                f"data.template: the tokenizer has no chat template; set it to one of {sorted(TEMPLATES)}")
        if tokenizer.eos_token_id is None:
            raise ConfigError("the tokenizer has no eos token, which ends every text example")
        if template != TOKENIZER_TEMPLATE:
            check_template_fits(template, tokenizer)
        self.tokenizer = tokenizer
        self.template_name = template
        self.chat_template = None if template == TOKENIZER_TEMPLATE else TEMPLATES[template].jinja
        self.max_seq_len = max_seq_len
        self.images = images
        self.special_ids = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
        self.cut = False  # whether the last example was longer than max_seq_len (chunked, or truncated)

    def __call__(self, example: Example) -> list[TokenizedExample]:
        """Tokenized pieces of ``example``; empty if no token is left to train on. Sets ``cut``."""
        self.cut = False
        if isinstance(example, TextExample):
            return self._text(example.text)
        return self._chat(example)

    def preference(self, example: PairExample | FeedbackExample) -> list[TokenizedExample]:
        """The sequences of a preference example (chosen then rejected, or the one KTO sequence); empty when
        a response has no token left to train on. Sets ``cut``."""
        self.cut = False
        if isinstance(example, FeedbackExample):
            chat = example.example
            prompt, responses = chat.messages[:-1], [chat.messages[-1]]
            roles = [ROLE_DESIRABLE if example.desirable else ROLE_UNDESIRABLE]
        else:
            chat = ChatExample(messages=example.prompt, system=example.system, tools=example.tools)
            prompt = example.prompt
            responses, roles = [example.chosen, example.rejected], [ROLE_CHOSEN, ROLE_REJECTED]
        if chat.images:
            raise DatasetError(f"{chat.origin}: preference training on images is not supported yet")
        encoded = [self._final_response(replace(chat, messages=(*prompt, r)))
                   for r in responses]
        prompt_ids = encoded[0][0]
        n_src, n_tgt = infer_seqlen(len(prompt_ids), max(len(t) for _, t, _ in encoded), self.max_seq_len // 2)
        self.cut = n_src < len(prompt_ids) or any(n_tgt < len(t) for _, t, _ in encoded)
        out = []
        for (_, target, labels), role in zip(encoded, roles, strict=True):
            ids = prompt_ids[:n_src] + target[:n_tgt]
            finished = _finish(ids, [IGNORE_INDEX] * n_src + labels[:n_tgt])
            if not finished:
                return []
            out.append(replace(finished[0], role=role, prompt_len=n_src))
        return out

    def _final_response(self, example: ChatExample) -> tuple[list[int], list[int], list[int]]:
        """(prompt ids: every turn before the last response, that response's ids, its labels)."""
        pairs = self._pairs(example)
        prompt = [t for source, target, _ in pairs[:-1] for t in source + target] + pairs[-1][0]
        return prompt, pairs[-1][1], pairs[-1][2]

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def _text(self, text: str) -> list[TokenizedExample]:
        """Every token is trained; a long document is cut into ``max_seq_len`` chunks."""
        # verbose=False: long documents are expected here (they are chunked below), so the
        # tokenizer's "longer than model_max_length" warning would only mislead.
        ids = [*self.tokenizer.encode(text, add_special_tokens=True, verbose=False), self.tokenizer.eos_token_id]
        self.cut = len(ids) > self.max_seq_len
        chunks = [ids[i:i + self.max_seq_len] for i in range(0, len(ids), self.max_seq_len)]
        return [example for chunk in chunks for example in _finish(chunk, chunk)]

    def _chat(self, example: ChatExample) -> list[TokenizedExample]:
        encoded = self._encode_images(example)
        if encoded:
            text = self.images.image_text
            example = replace(example, messages=tuple(Message(m.role, m.content.replace(IMAGE_PLACEHOLDER, text))
                                                      for m in example.messages))
        pending = iter(ids for ids, _ in encoded)
        ids: list[int] = []
        labels: list[int] = []
        remaining = self.max_seq_len
        for source, target, target_labels in self._pairs(example):
            source = self._expand_images(source, pending) if encoded else source
            if remaining <= 0:
                self.cut = True  # whole exchanges left out
                break
            n_src, n_tgt = infer_seqlen(len(source), len(target), remaining)
            self.cut |= n_src < len(source) or n_tgt < len(target)
            remaining -= n_src + n_tgt
            ids += source[:n_src] + target[:n_tgt]
            labels += [IGNORE_INDEX] * n_src + target_labels[:n_tgt]
        if encoded:
            self._check_images_fit(example, ids, encoded)
        return _finish(ids, labels, tuple(tensors for _, tensors in encoded))

    def _encode_images(self, example: ChatExample) -> list[tuple[list[int], dict[str, Any]]]:
        if not example.images:
            return []
        if self.images is None:
            raise DatasetError(f"{example.origin}: the row has images, but the model is not an image-text model "
                               "with a processor; train an image-text model (model.path with its processor files)")
        return [self.images.encode(path) for path in example.images]

    def _expand_images(self, ids: list[int], pending) -> list[int]:
        """Each occurrence of the image text's token ids replaced by the next image's expanded ids."""
        text_ids, n = self.images.text_ids, len(self.images.text_ids)
        out, i = [], 0
        while i < len(ids):
            if ids[i:i + n] == text_ids:
                out += next(pending)
                i += n
            else:
                out.append(ids[i])
                i += 1
        return out

    def _check_images_fit(self, example: ChatExample, ids: list[int], encoded) -> None:
        token = self.images.image_token_id
        need = sum(e.count(token) for e, _ in encoded)
        if ids.count(token) != need:
            raise DatasetError(f"{example.origin}: its {len(encoded)} images take {need} image tokens, which do not "
                               f"all fit in data.max_seq_len={self.max_seq_len} with the text; raise "
                               "data.max_seq_len, or use smaller images (the processor's max_pixels)")

    def _pairs(self, example: ChatExample) -> list[_Pair]:
        """Render turn by turn; each assistant-side turn closes one (prompt, response) pair."""
        messages = to_hf_messages(example)
        tools = list(example.tools) if example.tools else None
        pairs: list[_Pair] = []
        source: list[int] = []
        rendered = ""
        for k in range(1 if example.system else 0, len(messages)):
            if messages[k]["role"] == "assistant":
                head = self._render(messages[:k], tools, rendered, generation_prompt=True)
                body = self._render(messages[:k + 1], tools, head, generation_prompt=False)
                target = self._encode(body[len(head):])
                pairs.append((source + self._encode(head[len(rendered):]), target, self._response_labels(target)))
                source, rendered = [], body
            else:
                text = self._render(messages[:k + 1], tools, rendered, generation_prompt=False)
                source += self._encode(text[len(rendered):])
                rendered = text
        return pairs

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, prefix: str,
                generation_prompt: bool) -> str:
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools, chat_template=self.chat_template, tokenize=False,
                add_generation_prompt=generation_prompt)
        except TemplateError as e:  # a LLaMA-Factory template meets tools (`templates.llamafactory_template`)
            raise ConfigError(f"data.template '{self.template_name}': {e}; use data.template: tokenizer (the "
                              "model's own template) or chatml for data with tools") from None
        if not text.startswith(prefix):
            raise ConfigError(
                f"data.template '{self.template_name}' is not prefix-stable: rendering turn {len(messages)} "
                "rewrote earlier turns, so labels cannot be masked turn by turn; use template='chatml'")
        return text

    def _response_labels(self, target: list[int]) -> list[int]:
        """Train through the last special token (end of turn); the formatting after it is masked."""
        last = max((i for i, t in enumerate(target) if t in self.special_ids), default=len(target) - 1)
        return target[:last + 1] + [IGNORE_INDEX] * (len(target) - last - 1)


def _finish(ids: list[int], labels: list[int], images: tuple[dict[str, Any], ...] = ()) -> list[TokenizedExample]:
    """Mask the first label (in a packed row it would be predicted from the previous
    example); drop the example if no label is left to train on."""
    labels = [IGNORE_INDEX, *labels[1:]]
    if all(label == IGNORE_INDEX for label in labels):
        return []
    return [TokenizedExample(input_ids=tuple(ids), labels=tuple(labels), images=images)]
