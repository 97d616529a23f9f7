"""Shared pieces of the GPU benchmarks: model shapes, random batches, timing, the report table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import PretrainedConfig

from mt_ray.data.packing import collate
from mt_ray.data.schema import IGNORE_INDEX, TokenizedExample
from mt_ray.engine import OptimizerConfig
from mt_ray.engine.step_time import attention_flops
from mt_ray.models.presets import preset_config

# Every benchmark's optimizer: AdamW as in fine-tuning, global-norm clipping on.
OPT = OptimizerConfig(lr=1e-5, weight_decay=0.01, max_grad_norm=1.0, schedule="constant")


def shape_config(name: str, attn: str = "sdpa", layers: int | None = None) -> PretrainedConfig:
    """The preset `name` (cut to its first `layers` layers when given), with the attention backend set."""
    cfg = preset_config(name, layers=layers)
    cfg._attn_implementation = attn
    return cfg


def cuda_engine(shape: str, k: int, total_steps: int):
    """A randomly initialised engine on the GPU in the benchmarks' memory-lean setting
    (stream the fp32 master, bf16 gradients); returns (config, spec, engine)."""
    from mt_ray.engine import EngineConfig, StreamingEngine
    from mt_ray.models.discovery import discover

    cfg = shape_config(shape)
    spec = discover(cfg)
    ecfg = EngineConfig(device="cuda", compute_dtype="bf16", checkpoint_every=k, stream_master=True, grad_dtype="compute")
    engine = StreamingEngine(spec, ecfg, OPT, total_steps=total_steps)
    engine.load_random(seed=0)
    return cfg, spec, engine


def count_params(cfg: PretrainedConfig) -> int:
    from mt_ray.models.discovery import discover

    return discover(cfg).num_params


def random_micro_batches(vocab: int, batch: int, micro: int, seq: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, vocab, (micro, seq), generator=g)} for _ in range(batch // micro)]


def packed_micro_batches(vocab: int, batch: int, micro: int, seq: int, doc_tokens: int, seed: int = 0) -> list[dict]:
    """Rows packed as the data loader packs them (`mt_ray.data.packing.collate`): `seq // doc_tokens`
    documents of `doc_tokens` random tokens a row, position ids restarting at each, each document's first
    label masked, the rest of the row padding."""
    g = torch.Generator().manual_seed(seed)

    def document() -> TokenizedExample:
        ids = torch.randint(3, vocab, (doc_tokens,), generator=g).tolist()
        return TokenizedExample(tuple(ids), (IGNORE_INDEX, *ids[1:]))

    per_row = seq // doc_tokens
    batches = [collate([[document() for _ in range(per_row)] for _ in range(micro)], seq, pad_id=0)
               for _ in range(batch // micro)]
    return [{k: b[k] for k in ("input_ids", "labels", "position_ids")} for b in batches]


def pair_micro_batches(vocab: int, batch: int, micro: int, seq: int, seed: int = 0) -> list[dict]:
    """Preference rows as the data loader packs a pair (`mt_ray.data.packing.collate`): each row one pair, its
    chosen and rejected sequences half a row each, a prompt of a quarter row then a response of a quarter."""
    from mt_ray.data.schema import ROLE_CHOSEN, ROLE_REJECTED

    g = torch.Generator().manual_seed(seed)
    quarter = seq // 4

    def ids() -> list[int]:
        return torch.randint(3, vocab, (quarter,), generator=g).tolist()

    def pair() -> list[TokenizedExample]:
        prompt = ids()
        return [TokenizedExample(tuple(prompt + response), (IGNORE_INDEX,) * quarter + tuple(response), role=role,
                                 prompt_len=quarter) for response, role in ((ids(), ROLE_CHOSEN), (ids(), ROLE_REJECTED))]

    return [collate([pair() for _ in range(micro)], seq, pad_id=0) for _ in range(batch // micro)]


def metrics(args, cfg, n_params: int, step_s: float, system: str) -> dict:
    """Throughput of one system: model TFLOPS = 6 x params x tokens / step time (MegaTrain's formula).
    Attention spans a document: the whole row, or `args.packed_docs` tokens where rows are packed."""
    tokens = args.batch * args.seq
    model_flops = 6 * n_params * tokens
    span = getattr(args, "packed_docs", 0) or args.seq
    return {
        "system": system, "shape": args.shape, "params_b": n_params / 1e9, "batch": args.batch, "micro": args.micro,
        "seq": args.seq, "step_s": step_s, "tokens_per_s": tokens / step_s, "model_tflops": model_flops / step_s / 1e12,
        "tflops_with_attn": (model_flops + attention_flops(cfg, tokens, span)) / step_s / 1e12,
    }


def peak_rss_bytes() -> int:
    for line in Path(f"/proc/{os.getpid()}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


class HostMemorySampler:
    """Peak growth of the host's used memory (MemTotal - MemAvailable) while the block runs.

    Counts what a process pins with cudaHostAlloc as well as its ordinary pages, which is
    what decides whether a run fits the host; sampled every `interval` seconds.
    """

    def __init__(self, interval: float = 0.2):
        self.interval = interval
        self.peak_bytes = 0

    @staticmethod
    def used_bytes() -> int:
        info = {}
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0]) * 1024
        return info["MemTotal"] - info["MemAvailable"]

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak_bytes = max(self.peak_bytes, self.used_bytes() - self.base)

    def __enter__(self):
        import threading

        self.base = self.used_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak_bytes = max(self.peak_bytes, self.used_bytes() - self.base)


class Timer:
    def __enter__(self):
        _sync()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        _sync()
        self.seconds = time.perf_counter() - self.t0


def _sync() -> None:
    """Wait for the GPU's queued work (nothing to wait for in a CPU smoke run)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


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


def row_in_child(script: str, argv: list[str], failed: dict, timeout_s: float | None = None,
                 env: dict[str, str] | None = None) -> dict:
    """The row `script` writes to `--row-out` when run with `argv` in a fresh Python process (its own CUDA
    context, allocator and host memory, all returned when it exits); where it writes none, `failed` with the
    reason as `error`."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        try:
            done = subprocess.run([sys.executable, script, *argv, "--row-out", str(out)], env=env, check=False,
                                  timeout=timeout_s)
            failure = f"the run's process exited with {done.returncode}"
        except subprocess.TimeoutExpired:
            failure = f"the run's process took over {timeout_s:g} s and was stopped"
        return json.loads(out.read_text()) if out.exists() else {**failed, "error": failure}


def timed_grpo_steps(steps, backend, warmup: int, count: int):
    """GRPO steps after `warmup`: (index, rollout seconds, update seconds, step result), each timed whole."""
    for i in range(warmup + count):
        start = time.perf_counter()
        mbs = next(steps)  # refresh, generate, score, build (waits for the copy and the samples)
        rollout_s = time.perf_counter() - start
        start = time.perf_counter()
        result = backend.train_step(mbs)
        # The update's time includes the optimizer's last layers (not bringing the state kept on the GPU home).
        getattr(backend, "wait_for_updates", backend.synchronize)()
        if i >= warmup:
            yield i, rollout_s, time.perf_counter() - start, result
