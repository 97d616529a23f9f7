"""GRPO's prompts: the prompt side of the rows of `data.datasets` (alpaca or sharegpt SFT entries), rendered with
the run's chat template and a generation prompt, and drawn in a seeded order, epoch after epoch.

As TRL tells its two dataset kinds apart, a sharegpt row is conversational: its prompt also keeps its messages
(`messages`, Hugging Face's chat form, system first), which the reward functions get instead of the text; an
alpaca row is standard, and they get the rendered text. One run's datasets are all of one kind.

Each row's other columns (`answer`, ...) travel with its prompt to the reward functions. A prompt
longer than `grpo.max_prompt_length` keeps its last tokens (the generation prompt included) and is
counted, as SFT counts cut examples.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from mt_ray.data import DataConfig
from mt_ray.data.converters import convert_prompt
from mt_ray.data.loader import resolve_entries
from mt_ray.data.processor import TOKENIZER_TEMPLATE, check_template_fits, to_hf_messages
from mt_ray.data.templates import TEMPLATES
from mt_ray.errors import ConfigError, DatasetError


@dataclass(frozen=True)
class Prompt:
    """One prompt: its rendered text (what the reward functions read), its tokens, and its row's other columns."""

    text: str
    ids: list[int]
    columns: dict[str, Any]
    cut: bool
    messages: list[dict[str, Any]] | None = None
    """The prompt's messages for a conversational (sharegpt) row; None for a standard (alpaca) one."""


def read_prompts(data: DataConfig, tokenizer: PreTrainedTokenizerBase, max_prompt_length: int) -> list[Prompt]:
    """Every prompt of `data.datasets`, in file order."""
    template = None if data.template == TOKENIZER_TEMPLATE else TEMPLATES[data.template].jinja
    if template is not None:
        check_template_fits(data.template, tokenizer)
    prompts = []
    entries = resolve_entries(data, data.datasets, stage="sft")
    if len({e.formatting == "sharegpt" for e in entries}) > 1:
        raise ConfigError(f"data.datasets {data.datasets}: GRPO's reward functions take standard (alpaca) or "
                          "conversational (sharegpt) prompts, as TRL's do, not both in one run; train on one kind")
    for entry in entries:
        for raw in entry.rows():
            example, columns = convert_prompt(entry, raw)
            messages = to_hf_messages(example)
            text = tokenizer.apply_chat_template(messages, tools=list(example.tools or []) or None,
                                                 chat_template=template, tokenize=False, add_generation_prompt=True)
            ids = tokenizer.encode(text, add_special_tokens=False)
            prompts.append(Prompt(text, ids[-max_prompt_length:], columns, len(ids) > max_prompt_length,
                                  messages if entry.formatting == "sharegpt" else None))
    if not prompts:
        raise DatasetError(f"data.datasets {data.datasets} hold no prompt")
    return prompts


def cut_prompts_line(prompts: list[Prompt], max_prompt_length: int) -> str | None:
    """One line saying how many prompts `grpo.max_prompt_length` cuts (each keeps its end), and the key to raise;
    None when none is cut."""
    cut = sum(p.cut for p in prompts)
    if not cut:
        return None
    return (f"grpo.max_prompt_length {max_prompt_length}: {cut} of {len(prompts)} prompts are longer and keep only "
            f"their last {max_prompt_length} tokens; raise grpo.max_prompt_length to keep them whole")


class PromptStream:
    """The prompts in a seeded shuffle per epoch; its position is its state (a resumed run draws the same ones)."""

    def __init__(self, prompts: list[Prompt], seed: int):
        self.prompts = prompts
        self.seed = seed
        self.epoch = 0
        self.index = 0
        self.drawn = 0
        self.cut = 0
        self._order = self._shuffled()

    def take(self, n: int) -> list[Prompt]:
        out = []
        while len(out) < n:
            if self.index == len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._shuffled()
            out.append(self.prompts[self._order[self.index]])
            self.index += 1
        self.drawn += n
        self.cut += sum(p.cut for p in out)
        return out

    def _shuffled(self) -> list[int]:
        order = list(range(len(self.prompts)))
        random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index, "drawn": self.drawn, "cut": self.cut}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.index, self.drawn, self.cut = state["epoch"], state["index"], state["drawn"], state["cut"]
        self._order = self._shuffled()
