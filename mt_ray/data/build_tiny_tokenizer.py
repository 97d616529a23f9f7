"""Builds the tiny byte-level BPE tokenizer under ``mt_ray/assets/tiny_tokenizer/``.

Tests and demos need a real tokenizer (special tokens, a chat template, a pad token)
without downloading one. Byte-level BPE covers any input text, so fixtures in any
language still tokenize; the merges are learnt from the demo data, which keeps the
vocabulary small (~1k) and the file well under 1 MB. Reproduce with:

    python -m mt_ray.data.build_demo_data && python -m mt_ray.data.build_tiny_tokenizer
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from mt_ray.data.build_demo_data import DEMO_DIR
from mt_ray.data.templates import CHATML

TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "assets" / "tiny_tokenizer"
VOCAB_SIZE = 1024
EOS, PAD, IM_START, IM_END = "<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"

def demo_corpus(demo_dir: Path = DEMO_DIR) -> Iterator[str]:
    """Every string in the demo files, plus the template's role names."""
    yield "system user assistant tool <tool_call></tool_call> # Tools <tools></tools>"
    yield from _strings(json.loads((demo_dir / "demo_alpaca.json").read_text(encoding="utf-8")))
    with (demo_dir / "demo_sharegpt.jsonl").open(encoding="utf-8") as f:
        for line in f:
            yield from _strings(json.loads(line))


def _strings(obj: object) -> Iterator[str]:
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _strings(value)
    elif isinstance(obj, list):
        for value in obj:
            yield from _strings(value)


def build(out_dir: Path = TOKENIZER_DIR, demo_dir: Path = DEMO_DIR) -> None:
    """Train the BPE on the demo corpus and save it in Hugging Face format."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOS, PAD, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(demo_corpus(demo_dir), trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=4096,
    )
    hf_tok.chat_template = CHATML
    hf_tok.save_pretrained(str(out_dir))


if __name__ == "__main__":
    build()
