"""The one schema every converter produces and the processor consumes.

Whatever the source format (alpaca, sharegpt, plain text), a row becomes either

* a ``ChatExample``: an optional ``system`` prompt, optional ``tools`` (a list of
  JSON-schema dicts), and ``messages`` that alternate prompt side / response side:

  - prompt side (never trained): ``user`` turns and ``observation`` turns (tool results);
  - response side (trained): ``assistant`` turns and ``function_call`` turns, whose
    content is the JSON text of a call ``{"name": ..., "arguments": {...}}`` (or a list
    of calls);

  the first message is on the prompt side and the last on the response side, so every
  example has at least one trained turn; ``images`` are the files of its ``<image>``
  placeholders, in order (``origin`` names the file and row, for errors found later); or

* a ``TextExample``: plain text for pretraining, every token trained; or, for preference training,

* a ``PairExample`` (a ranking row: one prompt conversation, a chosen and a rejected final response)
  or a ``FeedbackExample`` (a KTO row: a conversation whose last response is desirable or not).

Role names follow LLaMA-Factory's internal roles; the processor maps them onto the
Hugging Face chat-template convention (``tool_calls`` on an assistant turn, ``tool``
role for results).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

IGNORE_INDEX = -100
"""Label of a token that carries no loss (PyTorch's cross-entropy ignore_index)."""

IMAGE_PLACEHOLDER = "<image>"
"""Where an image goes in a message (LLaMA-Factory's placeholder)."""

Role = Literal["user", "assistant", "function_call", "observation"]
PROMPT_ROLES: tuple[Role, ...] = ("user", "observation")
RESPONSE_ROLES: tuple[Role, ...] = ("assistant", "function_call")


@dataclass(frozen=True)
class Message:
    """One turn of a conversation."""

    role: Role
    content: str


@dataclass(frozen=True)
class ChatExample:
    """A conversation; only response-side turns carry loss."""

    messages: tuple[Message, ...]
    system: str | None = None
    tools: tuple[dict[str, Any], ...] | None = None
    images: tuple[Path, ...] = ()
    origin: str = ""


@dataclass(frozen=True)
class TextExample:
    """Plain text (pretraining); every token carries loss."""

    text: str


@dataclass(frozen=True)
class PairExample:
    """A preference pair (LLaMA-Factory's ranking row): ``prompt`` ends on a prompt-side turn, and
    ``chosen`` and ``rejected`` are the two response-side turns that may follow it."""

    prompt: tuple[Message, ...]
    chosen: Message
    rejected: Message
    system: str | None = None
    tools: tuple[dict[str, Any], ...] | None = None


@dataclass(frozen=True)
class FeedbackExample:
    """A KTO row: ``example``'s last response is desirable (its ``kto_tag`` true) or undesirable."""

    example: ChatExample
    desirable: bool


Example = ChatExample | TextExample | PairExample | FeedbackExample

# What each tokenized sequence is to the loss (``TokenizedExample.role``): an SFT sequence, the chosen or
# rejected sequence of a pair, a desirable or undesirable KTO sequence, or a KTO sequence's mismatched
# twin (its prompt with another example's response), whose log-probs estimate KTO's KL term; or a
# completion sampled for GRPO (its prompt, then the sampled tokens as labels).
ROLE_SFT, ROLE_CHOSEN, ROLE_REJECTED, ROLE_DESIRABLE, ROLE_UNDESIRABLE, ROLE_KL, ROLE_COMPLETION = range(7)


@dataclass(frozen=True)
class TokenizedExample:
    """Token ids and unshifted labels of one example (``-100`` = no loss).

    ``labels[0]`` is always ``-100``: the model predicts ``labels[t]`` from token ``t-1``,
    and in a packed row token ``t-1`` belongs to the previous example.
    """

    input_ids: tuple[int, ...]
    labels: tuple[int, ...]
    images: tuple[dict[str, Any], ...] = ()
    """The processor's tensors of each image whose tokens are in ``input_ids``, in order."""
    role: int = ROLE_SFT
    """What the sequence is to a preference loss (``ROLE_*``); SFT sequences are ``ROLE_SFT``."""
    prompt_len: int = 0
    """Tokens before the response (preference sequences; KTO's mismatched twins are built from it)."""

    def __post_init__(self) -> None:
        if len(self.labels) != len(self.input_ids) or not self.input_ids or self.labels[0] != IGNORE_INDEX:
            raise ValueError("TokenizedExample needs len(labels) == len(input_ids) > 0 and labels[0] == -100")

    def __len__(self) -> int:
        return len(self.input_ids)
