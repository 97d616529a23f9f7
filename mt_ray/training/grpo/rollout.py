"""Rollouts: completions sampled with transformers' `generate` from a device copy of the policy, and the
engine's micro-batches built from them.

The copy (`PolicyCopy`) is the model's Hugging Face module in the engine's compute dtype, built once and
refreshed from the host master weights after each update; the refresh is timed (`rollout/refresh_s`).
`rollout.placement` says where its weights are: all on the engine's device (`resident`), or its decoder
layers in page-locked host memory, streamed through two device buffers as `generate` runs them
(`streamed`, streamed_copy.py: the embedding, head and key/value cache stay on the device; the refresh then
writes the host copy). `auto` takes resident where the device model says it fits beside the step. A single
engine's copy lives in its process (`LocalSampler`); on the Ray cluster the same class lives in a rollout
actor beside the workers (remote.py). A copy that does not fit the device's free memory is refused by name.

A completion is its prompt's tokens followed by the sampled ones, cut after the first end-of-sequence
token; one cut at `max_completion_length` (no end token) is truncated. In the engine's rows each is one
sequence (`ROLE_COMPLETION`) whose labels are its sampled tokens (none where `mask_truncated_completions`
drops a truncated one), with its advantage beside it.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.initialization import no_init_weights

from mt_ray.data.packing import collate
from mt_ray.data.schema import IGNORE_INDEX, ROLE_COMPLETION, TokenizedExample
from mt_ray.engine.config import EngineConfig
from mt_ray.engine.grpo import GrpoConfig
from mt_ray.engine.sizing import rollout_bytes
from mt_ray.errors import InsufficientMemoryError
from mt_ray.models.discovery import ModelSpec
from mt_ray.training.grpo.streamed_copy import LayerStreamer, move_all_but

GIB = 2**30


@dataclass
class Rollout:
    """One rollout batch: per completion (prompts repeated G times, in groups), its prompt and sampled tokens."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    truncated: list[bool]

    @property
    def lengths(self) -> list[int]:
        return [len(c) for c in self.completion_ids]


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
    """The policy as a transformers module on the engine's device, for `generate`, refreshed from the master."""

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

    @property
    def placement(self) -> str:
        return "resident" if self.streamer is None else "streamed"

    @torch.no_grad()
    def refresh(self, state: dict[str, torch.Tensor]) -> float:
        """Copy the master weights (Hugging Face names) in; returns the seconds it took, the copy landed."""
        start = time.perf_counter()
        if self.streamer is not None:
            self.streamer.invalidate()  # the layers' host copy is about to change under the device slots
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        tied = set(getattr(self.model, "_tied_weights_keys", None) or {})
        if unexpected or set(missing) - tied:
            raise ValueError(f"the rollout copy does not match the policy: missing {missing}, unexpected {unexpected}")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the refresh's time is the copy's, landed
        return time.perf_counter() - start

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], cfg: GrpoConfig, eos_ids: set[int], pad_id: int,
                 seed: int) -> Rollout:
        """G completions of each prompt (`prompt_ids` one per prompt), sampled as `cfg` says, in groups of G."""
        width = max(len(p) for p in prompt_ids)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompt_ids], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids], device=self.device)
        torch.manual_seed(seed)  # what the sampler draws follows the run's seed and step
        out = self.model.generate(
            input_ids=ids, attention_mask=mask, do_sample=True, temperature=cfg.temperature, top_p=cfg.top_p,
            top_k=0, max_new_tokens=cfg.max_completion_length, num_return_sequences=cfg.num_generations,
            eos_token_id=sorted(eos_ids), pad_token_id=pad_id,
        )
        sampled = out[:, width:].tolist()  # waits for the device: the rewards need the text
        completions, truncated = cut_completions(sampled, eos_ids, pad_id)
        prompts = [p for p in prompt_ids for _ in range(cfg.num_generations)]
        return Rollout(prompts, completions, truncated)

    def close(self) -> None:
        if self.streamer is not None:
            self.streamer.close()


class LocalSampler:
    """A single engine's sampler: a `PolicyCopy` on the engine's device, refreshed from its host weights.
    (On the Ray cluster, `training/grpo/remote.py`'s `RemoteSampler` has the same surface.)"""

    def __init__(self, engine, spec: ModelSpec, rows: int, tokens: int, placement: str = "resident"):
        """A copy sized for generating `rows` completions of up to `tokens` tokens (prompt and completion), its
        weights where `placement` (`resident` or `streamed`) says."""
        self.engine = engine
        self.copy = build_copy(spec, engine.cfg, engine.device, rows, tokens, placement)

    def refresh(self) -> float:
        """Load the weights after every update so far; the copy's seconds."""
        return self.copy.refresh(self.engine.streamed_state_dict())  # waits for every update so far

    def generate(self, prompt_ids: list[list[int]], cfg: GrpoConfig, eos_ids: set[int], pad_id: int,
                 seed: int) -> Rollout:
        return self.copy.generate(prompt_ids, cfg, eos_ids, pad_id, seed)

    def generation_eos(self) -> list[int]:
        return generation_eos(self.copy.model)

    def close(self) -> None:
        self.copy.close()
        self.copy = None


def build_copy(spec: ModelSpec, cfg: EngineConfig, device: torch.device, rows: int, tokens: int,
               placement: str) -> PolicyCopy:
    """The policy's copy for generating `rows` completions of up to `tokens` tokens, `resident` or `streamed`;
    `auto` (a rollout actor, which plans by the memory it finds) takes resident where the whole copy fits the
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
