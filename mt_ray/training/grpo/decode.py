"""The rollout's decode loop: a static key/value cache, and on CUDA each token step replayed from a CUDA graph.

`generate` with a dynamic cache spends ~40 ms of Python and kernel launches per token step of a 7B model, ten
times what reading its weights takes (PERFORMANCE.md). Here the prompt is prefilled exactly as `generate`
prefills it (a dynamic cache, the same mask and positions), its keys and values are copied into a static cache
of `width + new tokens` slots, and every later token step runs on fixed buffers: the last token, its position,
a boolean mask over the cache's slots (True: attend), the step index. On CUDA the step (forward, the
group-seeded sampler, end-of-sequence bookkeeping, every buffer's update) is captured once per rollout batch in
a `torch.cuda.CUDAGraph` and replayed; on the CPU it runs eagerly, the same operations.

The prefill runs in row chunks of at most `PREFILL_TOKENS` tokens, so its workspace does not grow with prompts x
G (the device model's `rollout_bytes`). Semantics are `generate`'s (rollout.py's call): the last position's
logits in fp32, the sampler of sampling.py at new token t (its uniform `u[:, t]`), a row that has ended takes the
pad token from then on, and the loop
stops once every row has ended (checked every `SYNC_EVERY` steps: what follows an end is padding, which
`cut_completions` drops). The only difference is arithmetic: a decode step attends over the cache's unused slots
masked out, where `generate` attends over the filled ones, which may round differently (tested equal token for
token on the CPU, and in tests/gpu on CUDA).

A token step's attention reads the cache once per key/value head (`grouped_decode_attention`): with a mask,
`sdpa` would first repeat every key and value for each query head of its group (7x the cache's bytes a step at
Qwen2.5-7B, more than its weights at 128 rows).

Key: B rows (completions), W the padded prompt width, T new tokens, L = W + T cache slots, V vocabulary.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import AttentionInterface, DynamicCache, StaticCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from mt_ray.engine.sizing import PREFILL_TOKENS
from mt_ray.training.grpo.sampling import GroupSeededSampling

DECODE_ATTENTION = "mt_ray_grouped_decode"
SYNC_EVERY = 16  # token steps between checks that every row has ended (each check waits for the device)
WARMUP_STEPS = 2  # eager steps before the capture: kernels chosen and workspaces allocated outside the graph


def static_decode_refusal(model) -> str | None:
    """Why `model` cannot decode on a static cache (None: it can): a layer other than full attention (a
    sliding window's or a linear attention's cache is not a fixed set of slots per position), or an
    encoder-decoder."""
    config = model.config.get_text_config(decoder=True)
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        return f"its layers include {sorted(kinds - {'full_attention'})}, which a static cache does not hold"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "it attends over a sliding window"
    if getattr(config, "is_encoder_decoder", False):
        return "it is an encoder-decoder"
    return None


def grouped_decode_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention of one new token per row over the static cache, each key/value head read once for its group of
    query heads (query [B, H, 1, D], key and value [B, K, L, D], the boolean mask [B, 1, 1, L]: True attends);
    fp32 softmax. Anything else (the prefill, a bias or sinks) is `sdpa`'s."""
    b, h, q_len, d = query.shape
    k = key.shape[1]
    if q_len != 1 or attention_mask is None or attention_mask.dtype != torch.bool or kwargs.get("position_bias") \
            is not None or getattr(module, "sinks", None) is not None or h % k:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    scale = scaling if scaling is not None else d**-0.5
    q_BKGD = query.reshape(b, k, h // k, d)  # head i reads key/value head i // G, as repeat_kv orders them
    scores_BKGL = torch.matmul(q_BKGD, key.transpose(-1, -2)).float().mul_(scale)
    scores_BKGL.masked_fill_(~attention_mask, float("-inf"))
    probs_BKGL = torch.softmax(scores_BKGL, dim=-1).to(value.dtype)
    out_BKGD = torch.matmul(probs_BKGL, value)
    return out_BKGD.reshape(b, 1, h, value.shape[-1]), None  # [B, 1, H, Dv], as sdpa_attention_forward returns it


AttentionInterface.register(DECODE_ATTENTION, grouped_decode_attention)


@contextlib.contextmanager
def decode_attention(model) -> Iterator[None]:
    """The model's layers attend with `grouped_decode_attention` inside (each reads the config's choice per call)."""
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = DECODE_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before


class StaticDecoder:
    """One rollout batch's decode on a static cache (`run`); `capture`: replay each token step from a CUDA graph."""

    def __init__(self, model, capture: bool, prefill_tokens: int = PREFILL_TOKENS, grouped: bool = True):
        """`prefill_tokens`: the most prompt tokens (rows x W) one prefill chunk holds. `grouped`: a token step
        attends with `grouped_decode_attention`, else with the model's own (`sdpa`, which repeats the cache for each
        query head of a group first: slower, but the kernel `generate` runs, so in bf16 too it rounds alike)."""
        self.model = model
        self.capture = capture
        self.grouped = grouped
        self.prefill_tokens = prefill_tokens
        self.captured_steps = 0  # token steps the latest `run` replayed from its graph (benchmarks and tests)

    @torch.no_grad()
    def run(self, ids_BW: torch.Tensor, mask_BW: torch.Tensor, sampling: GroupSeededSampling, new_tokens: int,
            eos_ids: list[int], pad_id: int) -> torch.Tensor:
        """The sampled tokens [B, <= T] (pad after a row's end), for left-padded prompts `ids_BW` and `mask_BW`."""
        b, w = ids_BW.shape
        dev = ids_BW.device
        pos_BW = (mask_BW.long().cumsum(-1) - 1).masked_fill_(mask_BW == 0, 0)  # as generate derives them
        s = _StepState(b, w, new_tokens, mask_BW, pos_BW, eos_ids, pad_id, dev)
        cache = StaticCache(config=self.model.config, max_cache_len=w + new_tokens)
        first_B1 = torch.cat([self._prefill(ids_BW, mask_BW, pos_BW, sampling, cache, lo, hi)
                              for lo, hi in _row_chunks(b, w, self.prefill_tokens)])
        s.advance(first_B1)
        self.captured_steps = 0
        with decode_attention(self.model) if self.grouped else contextlib.nullcontext():
            return s.out_BT[:, : self._decode(s, cache, sampling, new_tokens)]

    def _decode(self, s: _StepState, cache: StaticCache, sampling: GroupSeededSampling, new_tokens: int) -> int:
        """Token steps 1 to T-1, eager or replayed from a graph; returns the tokens sampled (fewer than T where
        every row had ended)."""
        if self.capture and new_tokens > 2 + WARMUP_STEPS:
            return self._replay(s, cache, sampling, new_tokens)
        step = 1
        while step < new_tokens:
            self._step(s, cache, sampling)
            step += 1
            if step % SYNC_EVERY == 0 and not s.unfinished_B.any():  # waits for the device: every row ended?
                break
        return step

    def _replay(self, s: _StepState, cache: StaticCache, sampling: GroupSeededSampling, new_tokens: int) -> int:
        """A few eager steps on the capture's stream (its cuBLAS handle and workspaces made outside the graph, as
        torch.cuda.graphs' recipe asks), the token step captured, then replayed until T tokens or every row ended."""
        side = torch.cuda.Stream(s.dev)
        side.wait_stream(torch.cuda.current_stream(s.dev))  # the prefill's buffers written before the side reads them
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                self._step(s, cache, sampling)
            # capture_begin, not torch.cuda.graph: that empties the caching allocators (the device's and the pinned
            # host memory's) first, which the engine sharing this process would allocate again. thread_local:
            # another thread's CUDA calls (the engine's copies, the optimizer's) do not void the capture.
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                self._step(s, cache, sampling)  # recorded, not run: the buffers advance on each replay
            finally:
                graph.capture_end()
        torch.cuda.current_stream(s.dev).wait_stream(side)  # the warm-up's writes land before the first replay
        step = 1 + WARMUP_STEPS
        while step < new_tokens:
            graph.replay()
            step += 1
            self.captured_steps += 1
            if step % SYNC_EVERY == 0 and not s.unfinished_B.any():  # waits for the device: every row ended?
                break
        return step

    def _step(self, s: _StepState, cache: StaticCache, sampling: GroupSeededSampling) -> None:
        """Token `s.t_1` from token `s.t_1 - 1`, every buffer updated in place (capturable: no host sync)."""
        s.mask_B11L.index_fill_(3, s.slot_1, True)  # the previous token's slot, written by this forward
        logits = self.model(input_ids=s.tok_B1, attention_mask=s.mask_B11L,
                            position_ids=s.pos_B1, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        token_B1 = sampling.sample(logits[:, -1, :].float(), sampling.u_BT.index_select(1, s.t_1))
        s.advance(token_B1)

    def _prefill(self, ids_BW: torch.Tensor, mask_BW: torch.Tensor, pos_BW: torch.Tensor,
                 sampling: GroupSeededSampling, cache: StaticCache, lo: int, hi: int) -> torch.Tensor:
        """Rows [lo, hi) prefilled as generate prefills them (a dynamic cache), their keys and values copied into
        the static cache's first W slots, layer by layer as each is freed; their first tokens [hi - lo, 1]."""
        chunk = DynamicCache(config=self.model.config)
        logits = self.model(input_ids=ids_BW[lo:hi], attention_mask=mask_BW[lo:hi], position_ids=pos_BW[lo:hi],
                            past_key_values=chunk, use_cache=True, logits_to_keep=1).logits
        b, w = ids_BW.shape
        for src, dst in zip(chunk.layers, cache.layers, strict=True):
            if not dst.is_initialized:
                k, v = src.keys.shape, src.values.shape  # shapes alone: [B, heads, 0, D] allocates nothing
                dst.lazy_initialization(src.keys.new_empty(b, k[1], 0, k[3]), src.values.new_empty(b, v[1], 0, v[3]))
                dst.cumulative_length.fill_(w)
            dst.keys[lo:hi, :, :w].copy_(src.keys)
            dst.values[lo:hi, :, :w].copy_(src.values)
            src.keys = src.values = None  # this chunk's layer is in the static cache: its memory can go
        return sampling.sample(logits[:, -1, :].float(), sampling.u_BT[lo:hi, :1])


def _row_chunks(rows: int, width: int, tokens: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges of rows whose prompts hold at most `tokens` tokens together (one row at least)."""
    per = max(1, tokens // max(1, width))
    return [(lo, min(rows, lo + per)) for lo in range(0, rows, per)]


class _StepState:
    """The decode loop's fixed buffers (a graph replays over them): the last token, its position, the cache's
    mask, the step and slot indices, which rows are still going, and the tokens sampled so far."""

    def __init__(self, b: int, w: int, new_tokens: int, mask_BW: torch.Tensor, pos_BW: torch.Tensor,
                 eos_ids: list[int], pad_id: int, dev: torch.device):
        self.dev = dev
        self.pad_id = pad_id
        self.eos_E = torch.tensor(sorted(eos_ids), device=dev)
        self.mask_B11L = torch.zeros(b, 1, 1, w + new_tokens, dtype=torch.bool, device=dev)
        self.mask_B11L[:, 0, 0, :w] = mask_BW.bool()
        self.pos_B1 = pos_BW[:, -1:].clone()
        self.tok_B1 = torch.empty(b, 1, dtype=torch.long, device=dev)
        self.unfinished_B = torch.ones(b, dtype=torch.bool, device=dev)
        self.out_BT = torch.full((b, new_tokens), pad_id, dtype=torch.long, device=dev)
        self.t_1 = torch.zeros(1, dtype=torch.long, device=dev)  # the token being sampled
        self.slot_1 = torch.full((1,), w - 1, dtype=torch.long, device=dev)  # the slot of the token fed in

    def advance(self, token_B1: torch.Tensor) -> None:
        """Record token t (the pad where a row had ended, as generate does), then move every index on by one."""
        token_B = torch.where(self.unfinished_B, token_B1[:, 0], self.pad_id)
        self.out_BT.index_copy_(1, self.t_1, token_B[:, None])
        # a comparison with each end token (torch.isin sorts and takes `unique` past ~10 rows: a host sync)
        self.unfinished_B &= ~(token_B[:, None] == self.eos_E).any(dim=1)
        self.tok_B1.copy_(token_B[:, None])
        self.pos_B1.add_(1)
        self.t_1.add_(1)
        self.slot_1.add_(1)
