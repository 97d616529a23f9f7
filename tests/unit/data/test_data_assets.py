"""The shipped assets: a tiny tokenizer and demo data that load offline, rebuild
byte-for-byte from their scripts, and teach a tiny model something quickly."""

from __future__ import annotations

import filecmp
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from mt_ray.data import (
    DataConfig,
    build_dataloader,
    build_demo_data,
    build_tiny_tokenizer,
    count_valid_tokens,
    demo_registry_path,
)
from mt_ray.data.assets import tiny_tokenizer_path
from mt_ray.data.registry import load_registry


def test_tiny_tokenizer_loads_with_auto_tokenizer_and_is_small() -> None:
    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer_path()))
    assert 300 <= len(tok) <= 2048
    assert (tiny_tokenizer_path() / "tokenizer.json").stat().st_size < 1_000_000
    assert tok.pad_token == "<|pad|>" and tok.eos_token == "<|endoftext|>" and tok.pad_token_id != tok.eos_token_id
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode("<|im_start|>héllo wörld 你好<|im_end|>", add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and ids[-1] == tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.decode(ids) == "<|im_start|>héllo wörld 你好<|im_end|>"  # byte-level: any text round-trips


def test_assets_rebuild_byte_for_byte(tmp_path: Path) -> None:
    build_demo_data.build(tmp_path / "demo")
    build_tiny_tokenizer.build(tmp_path / "tok", tmp_path / "demo")
    for built, shipped in ((tmp_path / "demo", build_demo_data.DEMO_DIR),
                           (tmp_path / "tok", build_tiny_tokenizer.TOKENIZER_DIR)):
        names = sorted(str(p.relative_to(shipped)) for p in shipped.rglob("*") if p.is_file())
        assert names == sorted(str(p.relative_to(built)) for p in built.rglob("*") if p.is_file())
        assert all(filecmp.cmp(built / n, shipped / n, shallow=False) for n in names)


def test_demo_registry_has_both_formats_with_hundreds_of_rows() -> None:
    registry = load_registry(demo_registry_path())
    assert registry.resolve("demo_alpaca").formatting == "alpaca"
    assert registry.resolve("demo_sharegpt").formatting == "sharegpt"
    assert sum(1 for _ in registry.resolve("demo_sharegpt").path.open()) >= 200


def test_tiny_model_learns_the_demo_data_in_seconds(tokenizer) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=tokenizer.pad_token_id,
                         use_cache=False)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = build_dataloader(DataConfig(max_seq_len=128, mix_strategy="interleave_over"), tokenizer, 8)
    losses = []
    for _ in range(60):
        batch = next(loader)
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), reduction="sum"
        ) / count_valid_tokens(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.5 * first, (first, last)
