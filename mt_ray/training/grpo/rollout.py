"""Rollouts: completions sampled from a device copy of the policy, and the engine's micro-batches built from them.

The copy decodes on a static key/value cache, each token step replayed from a CUDA graph on a GPU (decode.py),
with `generate`'s semantics; a family whose cache is not a fixed set of slots (sliding windows, linear attention)
falls back to transformers' `generate` with a dynamic cache, said once in the log (`PolicyCopy.decode`).

The copy (`PolicyCopy`) is the model's Hugging Face module in the engine's compute dtype, built once and
refreshed from the host master weights after each update, by page-locked DMA with the cast on the device
(upload.py); the refresh is timed (`rollout/refresh_s`).
`rollout.placement` says where its weights are: all on the engine's device (`resident`), or its decoder
layers in page-locked host memory, streamed through two device buffers as the decode loop runs them
(`streamed`, streamed_copy.py: the embedding, head and key/value cache stay on the device; the refresh then
writes the host copy). `auto` takes resident where the device model says it fits beside the step. A single
engine's copy lives in its process (`LocalSampler`); on the Ray cluster the same class lives in a rollout
replica beside each worker (remote.py). A copy that does not fit the device's free memory is refused by name.

Each prompt group samples from a stream of its own (sampling.py), so a rollout split among several copies (the
cluster's replicas) draws what one copy draws. A completion is its prompt's tokens followed by the sampled ones,
cut after the first end-of-sequence token; one cut at `max_completion_length` (no end token) is truncated. In the
engine's rows each is one sequence (`ROLE_COMPLETION`) whose labels are its sampled tokens (none where
`mask_truncated_completions` drops a truncated one), with its advantage beside it.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, LogitsProcessorList, PretrainedConfig
from transformers.initialization import no_init_weights

from mt_ray.data.packing import collate
from mt_ray.data.schema import IGNORE_INDEX, ROLE_COMPLETION, TokenizedExample
from mt_ray.engine.config import EngineConfig
from mt_ray.engine.grpo import GrpoConfig
from mt_ray.engine.sizing import rollout_bytes
from mt_ray.errors import InsufficientMemoryError
from mt_ray.models.discovery import ModelSpec
from mt_ray.training.grpo.decode import StaticDecoder, static_decode_refusal
from mt_ray.training.grpo.sampling import GroupSeededSampling, group_uniforms
from mt_ray.training.grpo.streamed_copy import LayerStreamer, move_all_but
from mt_ray.training.grpo.upload import PinnedUpload

GIB = 2**30
# fastest first: `graph_sdpa` is `graph` with the model's own attention (generate's kernel, a slower step, for a
# comparison in bf16); `generate` is transformers' own loop, kept as the fallback
DECODES = ("graph", "static", "graph_sdpa", "generate")
log = logging.getLogger(__name__)


@dataclass
class Rollout:
    """One rollout batch: per completion (prompts repeated G times, in groups), its prompt and sampled tokens."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    truncated: list[bool]

    @property
    def lengths(self) -> list[int]:
        return [len(c) for c in self.completion_ids]

    @classmethod
    def join(cls, parts: Sequence[Rollout]) -> Rollout:
        """The rollouts of consecutive shares of the prompt groups as one, in prompt order."""
        return cls([p for r in parts for p in r.prompt_ids], [c for r in parts for c in r.completion_ids],
                   [t for r in parts for t in r.truncated])


def group_shares(groups: int, shares: int) -> list[tuple[int, int]]:
    """`groups` prompt groups split into at most `shares` consecutive [lo, hi) ranges, sizes differing by at most
    one (the first ones larger); none empty."""
    per, extra = divmod(groups, shares)
    bounds = [0]
    for i in range(shares):
        bounds.append(bounds[-1] + per + (i < extra))
    return [(lo, hi) for lo, hi in zip(bounds, bounds[1:], strict=False) if hi > lo]


def cut_completions(sampled: Sequence[Sequence[int]], eos_ids: set[int], pad_id: int) -> tuple[list[list[int]], list[bool]]:
    """Each sampled row up to and including its first end token (what follows is padding), and whether it
    has none (truncated)."""
    out, truncated = [], []
    for row in sampled:
        row = list(row)
        end = next((i for i, t in enumerate(row) if t in eos_ids), None)
        out.append(row[: end + 1] if end is not None else row)
        truncated.append(end is None)
    return out, truncated


def completion_batches(rollout: Rollout, advantages: torch.Tensor, mask_truncated: bool, micro_batch_size: int,
                       pad_id: int) -> list[dict]:
    """The engine's micro-batches: a row per completion, `micro_batch_size` rows each, in rollout order, with
    `advantages` [B, W] beside each row's sequence."""
    examples = []
    for prompt, completion, cut in zip(rollout.prompt_ids, rollout.completion_ids, rollout.truncated, strict=True):
        labels = [IGNORE_INDEX] * len(completion) if cut and mask_truncated else completion
        examples.append(TokenizedExample(input_ids=tuple(prompt + completion),
                                         labels=(IGNORE_INDEX,) * len(prompt) + tuple(labels),
                                         role=ROLE_COMPLETION, prompt_len=len(prompt)))
    batches = []
    for start in range(0, len(examples), micro_batch_size):
        part = examples[start : start + micro_batch_size]
        batch = collate([[e] for e in part], None, pad_id)
        adv = torch.zeros(batch["seq_role"].shape)
        adv[:, 0] = advantages[start : start + len(part)]
        batches.append({**batch, "advantages": adv})
    return batches


class PolicyCopy:
    """The policy as a transformers module on the engine's device, for generation, refreshed from the master."""

    def __init__(self, config: PretrainedConfig, device: torch.device, dtype: torch.dtype, weight_bytes: int,
                 generation_bytes: int, streamed_layers: str | None = None):
        """`weight_bytes` and `generation_bytes` (its key/value cache and sampling): the device model's
        (`mt_ray.engine.sizing.rollout_bytes`), refused before anything is allocated where they cannot fit.
        `streamed_layers`: the decoder layers' module path (`decoder_layers_path`) to stream them from host
        memory; None: every weight on the device."""
        _refuse_what_cannot_fit(device, weight_bytes, generation_bytes, streamed_layers is not None)
        config = copy.deepcopy(config)
        config._attn_implementation = "sdpa"  # the engine's own backend may be one only its layer loop knows
        self.streamer: LayerStreamer | None = None
        if streamed_layers is None:
            with torch.device(device):
                self.model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        else:
            with no_init_weights():  # the first refresh writes every weight: no random init of a model on the CPU
                self.model = AutoModelForCausalLM.from_config(config, dtype=dtype)
            self.model.tie_weights()  # skipped with the init; the master holds a tied head once, as its embedding
            layers = self.model.get_submodule(streamed_layers)
            self.streamer = LayerStreamer(layers, device, dtype)
            move_all_but(self.model, layers, device)
        self.model.eval()
        self.device = device
        self.params = dict(self.model.named_parameters())  # a tied head once, under its embedding's name
        self.upload = PinnedUpload(device)
        self.decode = self._best_decode()
        self.captured_steps = 0  # token steps the latest rollout batch replayed from a CUDA graph (benchmarks, tests)

    def _best_decode(self) -> str:
        """`graph` (a CUDA device, every weight resident), else `static`, else `generate` where the family's
        cache cannot be static (said once: its rollouts run at `generate`'s speed)."""
        refusal = static_decode_refusal(self.model)
        if refusal is not None:
            log.warning("grpo rollouts: transformers' generate with a dynamic cache (slower): %s", refusal)
            return "generate"
        # A streamed copy's layers arrive through hooks that wait on their copies: eager steps, not a graph.
        return "graph" if self.device.type == "cuda" and self.streamer is None else "static"

    @property
    def placement(self) -> str:
        return "resident" if self.streamer is None else "streamed"

    @torch.no_grad()
    def refresh(self, parts: Mapping[str, torch.Tensor] | Iterable[Mapping[str, torch.Tensor]]) -> float:
        """Copy the master weights (Hugging Face names; one mapping, or several as they become readable) in by
        page-locked DMA, cast on the device (`PinnedUpload`); returns the seconds it took, the copy landed."""
        start = time.perf_counter()
        if self.streamer is not None:
            self.streamer.invalidate()  # the layers' host copy is about to change under the device slots
        seen: set[str] = set()
        for part in [parts] if isinstance(parts, Mapping) else parts:
            unexpected = sorted(set(part) - self.params.keys())
            if unexpected:
                raise ValueError(f"the rollout copy does not match the policy: unexpected {unexpected}")
            self.upload.load((self.params[k].data, v) for k, v in part.items())  # .data: a streamed layer's host view
            seen.update(part)
        missing = sorted(self.params.keys() - seen)
        if missing:
            raise ValueError(f"the rollout copy does not match the policy: missing {missing}")
        return time.perf_counter() - start

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], cfg: GrpoConfig, eos_ids: set[int], pad_id: int, seed: int,
                 first_group: int = 0, width: int | None = None, decode: str | None = None) -> Rollout:
        """G completions of each prompt (`prompt_ids` one per prompt: the rollout's groups `first_group` on), in
        groups of G, each group sampled from its own stream of the step's `seed` (sampling.py), every prompt
        left-padded to `width` (the rollout's widest: the same positions however the groups are split).
        `decode`: one of DECODES for this call (the bench compares them), else the copy's (`self.decode`)."""
        g = cfg.num_generations
        width = width or max(len(p) for p in prompt_ids)
        rows = [p for p in prompt_ids for _ in range(g)]
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in rows], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows], device=self.device)
        uniforms = group_uniforms(seed, first_group, len(prompt_ids), g, cfg.max_completion_length)
        sampling = GroupSeededSampling(uniforms.to(self.device), width, cfg.temperature, cfg.top_p)
        sampled = self._decode(ids, mask, sampling, cfg.max_completion_length, sorted(eos_ids), pad_id,
                               decode or self.decode).tolist()  # waits for the device: the rewards need the text
        completions, truncated = cut_completions(sampled, eos_ids, pad_id)
        return Rollout(rows, completions, truncated)

    def _decode(self, ids: torch.Tensor, mask: torch.Tensor, sampling: GroupSeededSampling, new_tokens: int,
                eos: list[int], pad_id: int, decode: str) -> torch.Tensor:
        """The sampled tokens [B, <= T] by `decode` (DECODES); a graph whose capture fails is dropped for this
        copy's life (said once) and the batch decoded again eagerly: the same tokens."""
        if decode not in DECODES:
            raise ValueError(f"decode {decode!r}: one of {', '.join(DECODES)}")
        self.captured_steps = 0
        if decode == "generate" or self.decode == "generate":  # asked for, or the family's cache cannot be static
            out = self.model.generate(
                input_ids=ids, attention_mask=mask, do_sample=False, num_beams=1, top_k=None, top_p=None,
                temperature=None, max_new_tokens=new_tokens, logits_processor=LogitsProcessorList([sampling]),
                eos_token_id=eos, pad_token_id=pad_id)
            return out[:, ids.shape[1]:]
        # a graph only on a GPU, over resident weights (a streamed copy's hooks wait on their copies each step)
        decoder = StaticDecoder(self.model, capture=decode.startswith("graph") and ids.is_cuda and self.streamer is None,
                                grouped=decode != "graph_sdpa")
        try:
            return decoder.run(ids, mask, sampling, new_tokens, eos, pad_id)
        except torch.OutOfMemoryError:
            raise  # the device model's miss, not the capture's
        except RuntimeError as e:
            if not decoder.capture:
                raise
            log.warning("grpo rollouts: the decode step's CUDA graph capture failed (%s); decoding eagerly on the "
                        "static cache from now on", e)
            self.decode = "static"
            return StaticDecoder(self.model, capture=False, grouped=decoder.grouped).run(ids, mask, sampling,
                                                                                           new_tokens, eos, pad_id)
        finally:
            self.captured_steps = decoder.captured_steps

    def close(self) -> None:
        if self.streamer is not None:
            self.streamer.close()


class LocalSampler:
    """A single engine's sampler: a `PolicyCopy` on the engine's device, refreshed from its host weights.
    (On the Ray cluster, `training/grpo/remote.py`'s `RemoteSampler` has the same surface.)"""

    def __init__(self, engine, spec: ModelSpec, rows: int, tokens: int, placement: str = "resident",
                 shares: int = 1):
        """A copy sized for generating `rows` completions of up to `tokens` tokens (prompt and completion), its
        weights where `placement` (`resident` or `streamed`) says. `shares`: generate the prompt groups in that
        many consecutive batches, as that many rollout replicas of the cluster split them (the same batches, so
        the same rounding on a GPU: a check of the cluster's completions, at the cost of the engine's speed)."""
        self.engine = engine
        self.shares = shares
        self.copy = build_copy(spec, engine.cfg, engine.device, rows, tokens, placement)

    def refresh(self) -> float:
        """Load the weights after every update so far; the copy's seconds."""
        return self.copy.refresh(self.engine.streamed_state_dict())  # waits for every update so far

    def generate(self, prompt_ids: list[list[int]], cfg: GrpoConfig, eos_ids: set[int], pad_id: int,
                 seed: int) -> Rollout:
        width = max(len(p) for p in prompt_ids)
        return Rollout.join([self.copy.generate(prompt_ids[lo:hi], cfg, eos_ids, pad_id, seed, lo, width)
                             for lo, hi in group_shares(len(prompt_ids), self.shares)])

    def generation_eos(self) -> list[int]:
        return generation_eos(self.copy.model)

    def close(self) -> None:
        self.copy.close()
        self.copy = None


def build_copy(spec: ModelSpec, cfg: EngineConfig, device: torch.device, rows: int, tokens: int,
               placement: str) -> PolicyCopy:
    """The policy's copy for generating `rows` completions of up to `tokens` tokens, `resident` or `streamed`;
    `auto` (a rollout replica, which plans by the memory it finds) takes resident where the whole copy fits the
    device's free memory, else streamed."""
    if placement == "auto":
        placement = "resident" if _fits(device, *rollout_bytes(spec, cfg, rows, tokens)) else "streamed"
    streamed = placement == "streamed"
    copy, generation = rollout_bytes(spec, cfg, rows, tokens, streamed)
    layers = decoder_layers_path(spec) if streamed else None
    return PolicyCopy(spec.config, device, cfg.dtype, copy, generation, layers)


def decoder_layers_path(spec: ModelSpec) -> str:
    """The decoder layers' module path in a model built from `spec.config` (as in the engine's skeleton)."""
    base = next(name for name, m in spec.skeleton.named_modules() if m is spec.base)
    return f"{base}.{spec.layers_attr}" if base else spec.layers_attr


def generation_eos(model) -> list[int]:
    """The end tokens `model`'s generation config names (besides the tokenizer's)."""
    eos = model.generation_config.eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def _fits(device: torch.device, weight_bytes: int, generation_bytes: int) -> bool:
    return device.type != "cuda" or weight_bytes + generation_bytes <= torch.cuda.mem_get_info(device)[0]


def _refuse_what_cannot_fit(device: torch.device, weight_bytes: int, generation_bytes: int, streamed: bool) -> None:
    if _fits(device, weight_bytes, generation_bytes):
        return
    free, _ = torch.cuda.mem_get_info(device)
    what = "the streamed copy's embedding, head and layer buffers" if streamed else "the policy's copy for generation"
    advice = ("use fewer prompts per step, a shorter grpo.max_completion_length, or a larger GPU" if streamed else
              "use rollout.placement: streamed (or auto), which keeps the decoder layers in host memory")
    raise InsufficientMemoryError(
        f"grpo rollouts: {what} ({weight_bytes / GIB:.1f} GiB) and its key/value cache and sampling "
        f"({generation_bytes / GIB:.1f} GiB) do not fit the GPU's free {free / GIB:.1f} GiB; {advice}")
