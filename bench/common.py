"""Shared pieces of the GPU benchmarks: model shapes, random batches, timing, the report table."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from transformers import PretrainedConfig

from mt_ray.models.presets import preset_config


def shape_config(name: str, attn: str = "sdpa") -> PretrainedConfig:
    cfg = preset_config(name)
    cfg._attn_implementation = attn
    return cfg


def count_params(cfg: PretrainedConfig) -> int:
    from mt_ray.models.discovery import discover

    return discover(cfg).num_params


def random_micro_batches(vocab: int, batch: int, micro: int, seq: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, vocab, (micro, seq), generator=g)} for _ in range(batch // micro)]


def attention_flops(cfg: PretrainedConfig, tokens: int, seq: int) -> float:
    """Causal attention matmul FLOPs for fwd+bwd (QK^T and PV), counted as 6x like the weights."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_token = 2 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim * seq  # causal: half of 2*2
    return 3 * per_token * tokens


def peak_rss_bytes() -> int:
    for line in Path(f"/proc/{os.getpid()}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


class Timer:
    def __enter__(self):
        torch.cuda.synchronize()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        torch.cuda.synchronize()
        self.seconds = time.perf_counter() - self.t0


def print_table(rows: list[dict], cols: list[str]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in cols}
    print(" | ".join(c.ljust(widths[c]) for c in cols))
    print("-|-".join("-" * widths[c] for c in cols))
    for r in rows:
        print(" | ".join(_fmt(r.get(c)).ljust(widths[c]) for c in cols))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return "-" if v is None else str(v)


def write_json(path: str | Path, payload: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=2, default=str))
