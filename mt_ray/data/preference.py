"""Preference data in rows: the sequences of one example travel together, and KTO gets its KL twins.

A group is the sequences one example gives (``Processor.preference``): a pair's chosen and rejected
sequences, or a KTO sequence and its twin. A group is never split: it fills part of one row (packed,
each sequence its own document with its own position ids) or a row of its own (unpacked), so a pair
is always in one micro-batch and on one worker.

KTO estimates its KL term from mismatched sequences, as TRL's ``KTOTrainer`` does: each example's
prompt followed by the response of the example before it (the first takes the last one's), here
within the loader's window (TRL: within a batch). The twin carries loss labels on that response only
for its log-probs; it is never trained (``ROLE_KL``).
"""

from __future__ import annotations

from dataclasses import replace

from mt_ray.data.schema import IGNORE_INDEX, ROLE_DESIRABLE, ROLE_KL, ROLE_UNDESIRABLE, TokenizedExample

Group = list[TokenizedExample]


def add_kl_twins(groups: list[Group], max_len: int) -> list[Group]:
    """Each KTO group with its twin appended (its prompt, the previous KTO group's response, at most
    ``max_len`` tokens); other groups unchanged."""
    kto = [i for i, g in enumerate(groups) if g[0].role in (ROLE_DESIRABLE, ROLE_UNDESIRABLE)]
    out = list(groups)
    for k, i in enumerate(kto):
        own, other = groups[i][0], groups[kto[k - 1]][0]
        ids = (own.input_ids[:own.prompt_len] + other.input_ids[other.prompt_len:])[:max_len]
        labels = ((IGNORE_INDEX,) * own.prompt_len + other.labels[other.prompt_len:])[:max_len]
        twin = replace(own, input_ids=ids, labels=(IGNORE_INDEX, *labels[1:]), role=ROLE_KL)
        out[i] = [own, twin]
    return out


def group_lengths(groups: list[Group]) -> list[int]:
    return [sum(len(e) for e in g) for g in groups]
