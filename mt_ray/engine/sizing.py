"""Resource models: host and device memory of a run (its step time is step_time.py's).

Host memory is exact (it is the engine's own allocation plan). Device memory is a model of the
schedule's peak (streaming: the backward of one block: the parked hidden states (every
micro-batch's checkpoints on the device, or a few micro-batches' when they are parked in host
memory), K layers plus prefetched ones, one micro-batch's recompute activations, fp32 gradient
accumulators; resident: every weight and gradient sum and one micro-batch's activations through
all layers), with per-token activation bytes counted from the decoder layer's shapes. The search
over configurations is `calculator.py`. An image-text model adds its vision tower: given the image
tokens per sample, the block outputs a step keeps on the device (every block's, for every sample
with images) and the tower's compute. A preference stage (`Stage`) adds what the engine runs for
it: the policy's head once more forward (the sequence sums), and, with a reference to stream, the
reference's host buffer, its hidden state, its upload and its forward. GRPO
adds its rollout copy on the device (or, streamed, its layer buffers there and its layers in host memory), and
what generation needs beyond what an update frees.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mt_ray.engine.activations import host_placement_device_hiddens
from mt_ray.engine.config import EngineConfig, OptimizerConfig
from mt_ray.engine.grpo import GrpoConfig, RolloutConfig
from mt_ray.engine.host_store import plan_layout, state_host_bytes, state_placement
from mt_ray.engine.preference import Objective, PreferenceConfig
from mt_ray.engine.state_files import FilePlan, plan_files
from mt_ray.models.discovery import ModelSpec
from mt_ray.models.vision import VISION_PROJECTOR, is_vision_unit

GIB = 1024**3


@dataclass(frozen=True)
class Stage:
    """What a training stage adds to an SFT step, as the engine runs it (reference.py).

    A DPO or KTO head runs the policy's LM head forward once without a graph (each sequence's log-prob sum)
    before its chunked forward and backward (`head_again`; GRPO's token-wise loss does not). A streamed
    reference (`pref.reference: stream`, a loss that needs one) is held in host memory in the compute dtype,
    crosses the link once a step in it, runs forward through every layer and its own head, and parks one
    hidden state per micro-batch (an activation slot) from its embedding to its head; the resident schedule
    keeps its units on the device beside the policy's. GRPO keeps a rollout copy of the policy on the device
    for the whole run, and between updates generates the step's completions of up to `rollout_tokens` tokens
    (prompt and completion) with it (`rollout_bytes`). `rollout_placement` (`rollout.placement`): `resident`
    holds every weight of the copy on the device; `streamed` only the layers' two buffers and the rest, its
    decoder layers in host memory (`rollout_host_bytes`); `auto` is counted as resident here, and the calculator
    and the trainer take streamed where that does not fit. `rollout_rows`: the completions the copy on this GPU
    generates at once (0: the step's global batch; a cluster replica: its share). `rollout_apart`: the copy lives in
    another process on this GPU (the cluster's replica beside its worker), whose caching allocator keeps its
    generation's memory reserved through the worker's update: that is counted beside the step, not within what
    the update frees, with the second process's CUDA context (`REPLICA_CONTEXT_BYTES`). `device_state_bytes`: the
    optimizer state of the units kept on the GPU for the run (`device_plan.py`), and their gradients until the norm.
    """

    preference: bool = False
    reference: bool = False
    head_again: bool = False
    rollout_tokens: int = 0
    rollout_placement: str = "resident"
    rollout_rows: int = 0
    rollout_apart: bool = False
    device_state_bytes: int = 0

    @property
    def rollout_streamed(self) -> bool:
        return self.rollout_placement == "streamed"

    @classmethod
    def of(cls, stage: str, pref: PreferenceConfig | None = None, grpo: GrpoConfig | None = None,
           rollout: RolloutConfig | None = None) -> Stage:
        """The stage of `training.stage` with its `pref` (or `grpo` and `rollout`) section; GRPO streams a reference
        where β > 0."""
        if stage == "sft":
            return cls()
        if stage == "grpo":
            grpo = grpo or GrpoConfig()
            return cls(True, grpo.beta != 0.0, rollout_tokens=grpo.max_prompt_length + grpo.max_completion_length,
                       rollout_placement=(rollout or RolloutConfig()).placement)
        pref = pref or PreferenceConfig()
        return cls(True, pref.reference == "stream" and Objective(stage, pref).needs_reference, head_again=True)


SFT = Stage()

# A second process on a GPU (the cluster's rollout replica) holds its own CUDA context and its caching allocator's
# rounding beside the worker's: about 0.5 GiB of context on an H100/H200 with torch's kernels loaded, and the
# allocator's 2 MiB-block slack over its cache and sampling buffers. An estimate, checked in tests/gpu.
REPLICA_CONTEXT_BYTES = 1 << 30


def grad_buffer_bytes(numels: dict[str, int], dtype: torch.dtype, per_unit: bool, slabs: int) -> int:
    """Host bytes of gradient landing buffers (all units with clipping, else a few slabs)."""
    return dtype.itemsize * (sum(numels.values()) if per_unit else slabs * max(numels.values()))


def grad_buffers_per_unit(cfg: EngineConfig, opt: OptimizerConfig) -> bool:
    """Whether every unit needs its own host gradient buffer rather than a few recycled slabs.

    With clipping every gradient waits for the global norm. In the resident schedule all gradients
    leave within the last micro-batch's backward, much faster than the optimizer drains slabs, so
    the engine thread could block on a slab while the GPU waits. That is reasoning, not a measured
    gain: on the H100 the 3B resident step without clipping (micro 4) took 6.06 s with slabs and
    6.31 s with per-unit buffers, both slower than the 5.9 s with clipping, for a cause not found.
    """
    return opt.max_grad_norm > 0 or cfg.schedule == "resident"


# Host memory a GPU training process holds beyond what the engine allocates: the CUDA context, the libraries of torch
# and its kernels, Python. Measured on the H100 (bench/nvme_state.py, 3B, host placement): 15.15 B/param of peak RSS
# against 14.60 allocated, 1.7 GB more; a data-parallel worker process holding no state measured 1.2 GB.
PROCESS_RSS_BYTES = 1_700_000_000


def rss_bytes(spec: ModelSpec, cfg: EngineConfig, opt: OptimizerConfig, seq: int = 0, global_batch: int = 0,
              stage: Stage = SFT) -> int:
    """The peak resident memory of a training process on a GPU: what the engine allocates (`host_bytes`, every
    buffer touched: pinned pages are resident) and the process's own (PROCESS_RSS_BYTES)."""
    return host_bytes(spec, cfg, opt, seq, global_batch, stage) + PROCESS_RSS_BYTES


def host_bytes(spec: ModelSpec, cfg: EngineConfig, opt: OptimizerConfig, seq: int = 0, global_batch: int = 0,
               stage: Stage = SFT) -> int:
    """Exactly what the engine allocates in host memory for state, gradient buffers, a streamed reference and
    (with `checkpoint_placement: host`) the slab a step of `global_batch` x `seq` tokens parks hidden states in."""
    dtype, placement = cfg.dtype, state_placement(cfg)
    copy = None if (cfg.stream_master or dtype == torch.float32) and not placement.master_on_disk else dtype
    numels = {u.name: u.numel for u in spec.trainable_units}  # frozen units send no gradient
    per_unit = grad_buffers_per_unit(cfg, opt)
    state = state_host_bytes(plan_layout(spec, copy), placement, state_files_plan(spec, cfg))
    state += grad_buffer_bytes(numels, cfg.grad_torch_dtype, per_unit, cfg.grad_slabs)
    return (state + reference_host_bytes(spec, cfg, stage) + rollout_host_bytes(spec, cfg, stage)
            + activation_slab_bytes(spec, cfg, seq * global_batch, stage))


def state_files_plan(spec: ModelSpec, cfg: EngineConfig) -> FilePlan | None:
    """The state files of `cfg.state_placement` (None in host memory): their size on disk and slots in RAM."""
    placement = state_placement(cfg)
    return plan_files(spec.units, placement.master_on_disk, placement.chunk_numel) if placement.on_disk else None


def disk_bytes(spec: ModelSpec, cfg: EngineConfig) -> int:
    """Bytes of optimizer state on disk: each is read and written once a step."""
    plan = state_files_plan(spec, cfg)
    return plan.disk_bytes if plan else 0


def reference_host_bytes(spec: ModelSpec, cfg: EngineConfig, stage: Stage) -> int:
    """The streamed reference's frozen weights: every unit in the compute dtype (bf16: 2 B/param, fp32: 4)."""
    return plan_layout(spec, None).total * cfg.dtype.itemsize if stage.reference else 0


def rollout_host_bytes(spec: ModelSpec, cfg: EngineConfig, stage: Stage) -> int:
    """A streamed rollout copy's decoder layers, page-locked in the compute dtype (bf16: 2 B/param of them)."""
    return sum(u.numel for u in spec.layer_units) * cfg.dtype.itemsize if stage.rollout_streamed else 0


def activation_slab_bytes(spec: ModelSpec, cfg: EngineConfig, tokens: int, stage: Stage = SFT) -> int:
    """The pinned slab of host-placed hidden states: a checkpoint per block, the carry and the streamed
    reference's hidden state, per token."""
    if cfg.checkpoint_placement != "host":
        return 0
    slots = num_blocks(spec, cfg) + 1 + stage.reference
    return slots * tokens * spec.text_config.hidden_size * cfg.dtype.itemsize


def num_blocks(spec: ModelSpec, cfg: EngineConfig) -> int:
    """The streaming schedule's blocks of `checkpoint_every` layers."""
    return math.ceil(spec.num_layers / cfg.checkpoint_every)


def activation_bytes_per_token(spec: ModelSpec, dtype_bytes: int = 2, kernels: str = "torch",
                               chunked: bool = False) -> int:
    """Bytes autograd keeps per token for one decoder layer.

    transformers' norms hold fp32 temporaries and its MLP keeps act(gate) as well. Liger's norms
    keep only their input, which the layer holds anyway, and its SwiGLU recomputes act(gate)
    (H100, 3B resident, micro 11: 92.6 KB per token per layer measured, 92.5 modelled). With the
    norms and MLP in sequence chunks (`chunked`), each keeps only its input: the attention's
    input norm shares the layer's input, the second norm and the MLP keep one hidden vector each.
    """
    c = spec.text_config
    d = c.hidden_size
    q, kv = _attention_widths(c)
    inter = mlp_width(spec)
    attn = (d + 3 * q + 4 * kv + d) * dtype_bytes  # qkv, rotary temporaries, attention out, o_proj in
    if chunked:
        return attn + 2 * d * dtype_bytes
    if kernels == "liger":
        return attn + (d + 3 * inter) * dtype_bytes  # gate, up, act*up
    # two RMSNorms: fp32 input, fp32 normalised and its cast back (no copies when computing in fp32)
    norms = 2 * d * (4 + 4 + dtype_bytes) if dtype_bytes < 4 else 2 * d * 4
    mlp = (d + 4 * inter) * dtype_bytes  # gate, up, act(gate), act*up
    return norms + attn + mlp


def mlp_width(spec: ModelSpec) -> int:
    """The intermediate width a token's MLP activations span: the config's, or a mixture of experts' routed width
    where wider (each token's `top_k` experts, as many gated matrices as a dense MLP of that width: GPT-OSS's 4 x
    2880, Mixtral's 2 x 14336)."""
    c = spec.text_config
    width = _widest(c, "intermediate_size") or 4 * c.hidden_size
    for kind, shares in spec.routed_shares.items():
        unit = next((u for u in spec.layer_units if u.kind == kind), None)
        if shares and unit is not None:
            routed = sum(p.numel * shares.get(p.local_name, 0.0) for p in unit.params)
            width = max(width, round(routed / (3 * c.hidden_size)))
    return width


def _attention_widths(c) -> tuple[int, int]:
    """Query and key/value widths of a layer's attention; a family without grouped keys (GPT-2, OPT, BART...) has
    as many key/value heads as query heads, and one without attention heads (xLSTM) counts its heads as one."""
    heads = _widest(c, "num_attention_heads") or _widest(c, "num_heads") or 1
    head_dim = _widest(c, "head_dim") or c.hidden_size // heads
    return heads * head_dim, (_widest(c, "num_key_value_heads") or heads) * head_dim


def _widest(c, key: str) -> int | None:
    """`c.key`, or its largest value over the layers where it varies by layer (a list of one a layer, as Gemma 3n's
    MLP widths; Gemma 4's per-layer configs, whose global read raises), or None."""
    try:
        value = getattr(c, key, None)
    except Exception:  # transformers refuses a global read of a per-layer attribute
        return max(getattr(layer, key) for layer in c.per_layer_config)
    return max(value) if isinstance(value, (list, tuple)) else value


def layer_backward_bytes(spec: ModelSpec, cfg: EngineConfig, mb_tokens: int) -> int:
    """What one layer's backward allocates beyond the activations it frees as it goes.

    Whole: the MLP's, whose intermediate gradients outlive the activations they free by two
    intermediate vectors a token (transformers' SwiGLU; one with Liger's, which overwrites its
    saved gate and up in place). In chunks (`mlp_chunk_tokens`): one recomputed chunk's
    activations and gradients, or the attention's, whose activations then dominate what is freed:
    the query, key and value gradients, the flash kernel's fp32 query-gradient accumulator and the
    gradients of the attention's input and output, for every token.
    """
    c, size = spec.text_config, cfg.dtype.itemsize
    d = c.hidden_size
    inter = mlp_width(spec)
    if not runs_chunked(cfg, mb_tokens):
        return mb_tokens * inter * size * (1 if cfg.kernels == "liger" else 2)
    q, kv = _attention_widths(c)
    attention = mb_tokens * ((q + 2 * kv + 2 * d) * size + 4 * q)
    return max(attention, cfg.mlp_chunk_tokens * inter * size * (4 + 2))


def logit_bytes(dtype_bytes: int) -> int:
    """Device bytes per (token, vocab entry) of one loss chunk: logits, fp32 log-probabilities and
    their gradient; below fp32 also the logits' fp32 upcast and the gradient cast back."""
    return dtype_bytes + 4 + 4 + (4 + dtype_bytes if dtype_bytes < 4 else 0)


@dataclass(frozen=True)
class VisionSizes:
    """An image-text model's vision side, for `image_tokens` image tokens per sample."""

    patches: int  # per sample: image tokens times the tokens one merges (Qwen-VL: 2x2)
    tower_params: int
    tower_trains: bool
    merged_params: int  # of the tower's, those that run on image tokens, not patches (Qwen3-VL's deepstack mergers)
    projector_params: int
    projector_trains: bool
    hidden: int
    depth: int

    def kept_bytes(self, samples: int, dtype_bytes: int) -> int:
        """Every block's output for `samples` samples: kept on the device from the vision forward to its backward."""
        return samples * self.patches * self.hidden * self.depth * dtype_bytes

    def flops(self, samples: int, image_tokens: int) -> float:
        """Matmul FLOPs of a step: the tower once forward (recomputed and run backward when it trains: 8x
        instead of 2x), the projector forward, and again with its backward when anything trains."""
        per_patch = self.tower_params - self.merged_params
        tower = (8 if self.tower_trains else 2) * (per_patch * self.patches + self.merged_params * image_tokens)
        projector = (8 if self.tower_trains or self.projector_trains else 2) * self.projector_params * image_tokens
        return samples * float(tower + projector)


def vision_sizes(spec: ModelSpec, image_tokens: int) -> VisionSizes | None:
    """None for a text model."""
    if spec.vision is None:
        return None
    vc = spec.config.vision_config
    tower = [u for u in spec.units if is_vision_unit(u.name) and u.name != VISION_PROJECTOR]
    projector = spec.unit(VISION_PROJECTOR)
    merge = getattr(vc, "spatial_merge_size", 1) ** 2
    return VisionSizes(image_tokens * merge, sum(u.numel for u in tower), not tower[0].frozen, _merged_params(spec),
                       projector.numel, not projector.frozen, vc.hidden_size if spec.vision.blocks else 0,
                       len(spec.vision.blocks))


def _merged_params(spec: ModelSpec) -> int:
    """Parameters of the tower's modules of the projector's class (Qwen3-VL's deepstack mergers): like the
    projector, they run on merged image tokens."""
    vision = spec.vision
    if vision.tower_path is None:
        return 0
    projectors = [vision.outer.get_submodule(p) for p in vision.projector_paths]
    kinds = tuple({type(m) for m in projectors})
    tower = vision.outer.get_submodule(vision.tower_path)
    return sum(p.numel() for m in tower.modules() if isinstance(m, kinds) and all(m is not q for q in projectors)
               for p in m.parameters())


def device_bytes(spec: ModelSpec, cfg: EngineConfig, micro_batch: int, seq: int, global_batch: int,
                 image_tokens: int = 0, stage: Stage = SFT) -> dict[str, int]:
    """Peak device memory of a step, by part (bytes); `image_tokens` per sample for an image-text model,
    whose vision block outputs stay on the device through the language model (`vision_outputs`).

    The parts are those of the last block's backward; `head_or_embed_extra` is what the loss, the
    first block's backward or the embedding's backward needs beyond it, where one of them peaks higher.
    A streamed reference shares the streamer's buffers (no more weights on the device) and parks its hidden
    states until its head, which runs before the policy's: that head's peak holds them too. The resident
    schedule keeps the reference's units on the device (`reference_weights`).
    """
    parts = _text_device_bytes(spec, cfg, micro_batch, seq, global_batch, stage)
    vision = vision_sizes(spec, image_tokens)
    if vision is not None and image_tokens:
        samples = micro_batch if cfg.schedule == "resident" else global_batch
        parts["vision_outputs"] = vision.kept_bytes(samples, cfg.dtype.itemsize)
        parts["total"] += parts["vision_outputs"]
    if stage.device_state_bytes:
        parts["device_optimizer_state"] = stage.device_state_bytes
        parts["total"] += stage.device_state_bytes
    if stage.rollout_tokens:
        rows = stage.rollout_rows or global_batch
        copy, generation = rollout_bytes(spec, cfg, rows, stage.rollout_tokens, stage.rollout_streamed)
        parts["rollout_copy"] = copy
        if stage.rollout_apart:  # another process's: its generation stays reserved through the update
            parts["rollout_generation"] = generation + REPLICA_CONTEXT_BYTES
            parts["total"] += copy + parts["rollout_generation"]
            return parts
        # Generation runs between updates, in the memory an update frees: only what it needs beyond that counts.
        parts["rollout_generation_extra"] = max(0, generation - parts["total"])
        parts["total"] += copy + parts["rollout_generation_extra"]
    return parts


# The rollout copy's refresh casts the master on the device through two staging slots of this many bytes
# (training/grpo/upload.py), held for the copy's life.
ROLLOUT_SLOT_BYTES = 64 << 20

# The rollout's prefill runs its prompts in row chunks of at most this many tokens (decode.py): its workspace, one
# layer's intermediates of a chunk, is bounded whatever the prompts x G.
PREFILL_TOKENS = 8192


def rollout_bytes(spec: ModelSpec, cfg: EngineConfig, rows: int, tokens: int,
                  streamed: bool = False) -> tuple[int, int]:
    """GRPO's rollout copy on the device (every weight in the compute dtype; `streamed`: all but the decoder
    layers, and two layer-sized buffers they stream through; and its refresh's two staging slots), and what its generation of `rows` completions of
    up to `tokens` tokens adds: the static key/value cache (on the device either way) and the larger of the
    prefill's workspace (a chunk's dynamic cache and one layer's intermediates of its tokens) and a token step's
    (`decode_step_bytes`)."""
    size = cfg.dtype.itemsize
    cache = kv_cache_bytes(spec.text_config, rows, tokens, size)
    chunk_rows = max(1, min(rows, PREFILL_TOKENS // max(1, tokens)))
    prefill = (kv_cache_bytes(spec.text_config, chunk_rows, tokens, size)
               + min(rows * tokens, max(PREFILL_TOKENS, tokens)) * activation_bytes_per_token(spec, size))
    layers = [u.numel for u in spec.layer_units]
    weights = spec.num_params - sum(layers) + 2 * max(layers) if streamed else spec.num_params
    return weights * size + 2 * ROLLOUT_SLOT_BYTES, cache + max(prefill, decode_step_bytes(spec, rows, tokens))


def decode_step_bytes(spec: ModelSpec, rows: int, tokens: int) -> int:
    """A token step's workspace: per row and vocabulary entry the fp32 logits, the sampler's fp64 probabilities
    and cumulative sum and the nucleus sort's values and indices (32 B), and the attention's fp32 scores and
    probabilities over the cache's slots."""
    q, _ = _attention_widths(spec.text_config)
    heads = _widest(spec.text_config, "num_attention_heads") or 1
    return rows * spec.text_config.vocab_size * 32 + 2 * rows * heads * tokens * 4 + rows * q * 8


def kv_cache_bytes(config, rows: int, tokens: int, dtype_bytes: int) -> int:
    """Bytes of the key/value cache `generate` fills for `rows` sequences of `tokens` (`config`: the text model's;
    every layer counted as attention, so a hybrid's is overstated)."""
    _, kv = _attention_widths(config)
    return 2 * config.num_hidden_layers * rows * tokens * kv * dtype_bytes


def _text_device_bytes(spec: ModelSpec, cfg: EngineConfig, micro_batch: int, seq: int,
                       global_batch: int, stage: Stage = SFT) -> dict[str, int]:
    if cfg.schedule == "resident":
        return _resident_device_bytes(spec, cfg, micro_batch * seq, stage)
    d, k = spec.text_config.hidden_size, cfg.checkpoint_every
    size = cfg.dtype.itemsize
    layer = max(u.numel for u in spec.layer_units)
    embed, lm_head = spec.unit("embed").numel, lm_head_numel(spec)
    depth = cfg.prefetch_units or k
    hold = max(k, 2)  # units the schedule uses at once (a block, or the head with a tied embedding)
    tokens, mb_tokens = global_batch * seq, micro_batch * seq
    # Parked hidden states at the last block's backward: on the device, a checkpoint per block and
    # the carry for every token of the step; in host memory, a few micro-batches' in flight. From the
    # first block's backward on, only checkpoint 0 and the carry are left. Either way one more is made.
    host = cfg.checkpoint_placement == "host"
    parked_last = (host_placement_device_hiddens() * mb_tokens if host else (num_blocks(spec, cfg) + 1) * tokens)
    parked_first = parked_last if host else 2 * tokens
    parts = {
        "weights": (depth + hold) * layer * size + (layer * 4 if cfg.stream_master else 0),
        "parked_hiddens": (parked_last + mb_tokens) * d * size,
        "recompute": k * mb_tokens * activation_bytes_per_token(spec, size, cfg.kernels, runs_chunked(cfg, mb_tokens)),
        "layer_backward": layer_backward_bytes(spec, cfg, mb_tokens),
        "grad_accumulators": k * layer * 4 + _outbox_bytes(spec, cfg),  # a block's fp32 sums
        # A tied embedding's fp32 gradient sum waits from the head to the embedding's backward.
        "tied_embedding_grad": embed * 4 if spec.tied else 0,
    }
    last = sum(parts.values())
    common = _outbox_bytes(spec, cfg) + parts["tied_embedding_grad"]
    # The loss: the LM head alone in flight (its fp32 staging with stream_master; measured on the H100 at the 7B
    # shape under a 16 GiB cap, bench/consumer_caps.py --profile, no layer is), the parked hidden states, one
    # chunk of the loss and the untied head's fp32 sum.
    head = (lm_head * size + (layer * 4 if cfg.stream_master else 0) + parts["parked_hiddens"] + common
            + _loss_chunk_bytes(spec, cfg, mb_tokens) + (0 if spec.tied else lm_head * 4))
    # The reference's head, before the policy's: its hidden states wait for it on the device, every micro-batch's.
    head += tokens * d * size if stage.reference and not host else 0
    # The first block's backward has the embedding in flight instead of `depth` layers.
    first = last + (embed - depth * layer) * size - (parked_last - parked_first) * d * size
    # The embedding's backward: its weights, autograd's dense gradient and its fp32 sum (the tied head's, which
    # `common` holds, where tied), each gradient upcast into the sum in place.
    embed_bwd = ((hold - 1) * layer * size + 2 * embed * size + (0 if spec.tied else embed * 4)
                 + (parked_first + mb_tokens) * d * size + common)
    parts["head_or_embed_extra"] = max(0, head - last, first - last, embed_bwd - last)
    # Kept block graphs all live from the forward to the head; counted on top of every phase (they drain
    # first in the backward, so this overstates the backward's peak by what has drained).
    parts["kept_activations"] = kept_bytes(spec, cfg, micro_batch, seq, global_batch, kept_count(cfg))
    parts["total"] = sum(parts.values())
    return parts


def kept_count(cfg: EngineConfig) -> int:
    """The block graphs a configuration keeps (`auto` unresolved counts none; the resident schedule keeps all anyway)."""
    return cfg.keep_activations if isinstance(cfg.keep_activations, int) and cfg.schedule == "stream" else 0


def kept_block_bytes(spec: ModelSpec, cfg: EngineConfig, mb_tokens: int) -> int:
    """Device bytes of one kept block graph: K layers' saved activations for one micro-batch, as its recompute
    holds them, and the block's output (held with the graph; a copy is parked)."""
    per_layer = activation_bytes_per_token(spec, cfg.dtype.itemsize, cfg.kernels, runs_chunked(cfg, mb_tokens))
    return mb_tokens * (cfg.checkpoint_every * per_layer + spec.text_config.hidden_size * cfg.dtype.itemsize)


def kept_bytes(spec: ModelSpec, cfg: EngineConfig, micro_batch: int, seq: int, global_batch: int, kept: int) -> int:
    """`kept` block graphs, and the forward's weights of every block they touch (the graphs hold them)."""
    if kept <= 0:
        return 0
    n_micro = max(1, global_batch // micro_batch)
    layer = max(u.numel for u in spec.layer_units)
    blocks = math.ceil(kept / n_micro)
    return kept * kept_block_bytes(spec, cfg, micro_batch * seq) + blocks * cfg.checkpoint_every * layer * cfg.dtype.itemsize


def max_kept(spec: ModelSpec, cfg: EngineConfig, micro_batch: int, seq: int, global_batch: int, budget: float,
             image_tokens: int = 0, stage: Stage = SFT) -> int:
    """The most block graphs that fit `budget` device bytes beside the stream schedule's own peak (0 when
    resident, or when the schedule alone does not fit); at most every block for every micro-batch."""
    if cfg.schedule != "stream":
        return 0
    base = cfg.model_copy(update={"keep_activations": 0})
    parts = device_bytes(spec, base, micro_batch, seq, global_batch, image_tokens, stage)
    if parts["total"] > budget:
        return 0
    # Kept graphs live through the update, not the rollout's generation: they take from the update's room alone.
    room = budget - (parts["total"] - parts.get("rollout_generation_extra", 0))
    per = kept_block_bytes(spec, cfg, micro_batch * seq)
    n = min(int(max(0.0, room) // max(per, 1)), num_blocks(spec, cfg) * max(1, global_batch // micro_batch))
    while n > 0 and kept_bytes(spec, cfg, micro_batch, seq, global_batch, n) > room:
        n -= 1
    return n


def _outbox_bytes(spec: ModelSpec, cfg: EngineConfig) -> int:
    """The two gradients last sent (cast, or the fp32 sums themselves) wait until two more follow:
    through the last block, the untied LM head's; else two layers'."""
    layer = max(u.numel for u in spec.layer_units)
    return max(0 if spec.tied else lm_head_numel(spec), 2 * layer) * cfg.grad_torch_dtype.itemsize


def _resident_device_bytes(spec: ModelSpec, cfg: EngineConfig, mb_tokens: int, stage: Stage = SFT) -> dict[str, int]:
    """The resident schedule's peak: at a later micro-batch's loss, every weight (and the reference's), every
    fp32 gradient sum and that micro-batch's activations through all layers are held, plus one loss chunk."""
    size, grad_size = cfg.dtype.itemsize, cfg.grad_torch_dtype.itemsize
    layer = max(u.numel for u in spec.layer_units)
    parts = {
        "weights": spec.num_params * size + (layer * 4 if cfg.stream_master else 0),
        # every fp32 sum, and the previous step's last two gradients sent (the embedding's) still in the outbox
        "grad_sums": spec.num_params * 4 + max(spec.unit("embed").numel, 2 * layer) * grad_size,
        "activations": spec.num_layers * mb_tokens * activation_bytes_per_token(spec, size, cfg.kernels,
                                                                                runs_chunked(cfg, mb_tokens))
        + 2 * mb_tokens * spec.text_config.hidden_size * size + layer_backward_bytes(spec, cfg, mb_tokens),
        "loss_chunk": _loss_chunk_bytes(spec, cfg, mb_tokens),
    }
    if stage.reference:
        parts["reference_weights"] = spec.num_params * size
    parts["total"] = sum(parts.values())
    return parts


def runs_chunked(cfg: EngineConfig, mb_tokens: int) -> bool:
    """Whether a micro-batch of `mb_tokens` runs its layers' token-wise parts in `mlp_chunk_tokens` chunks."""
    return cfg.mlp_chunk_tokens is not None and mb_tokens > cfg.mlp_chunk_tokens


def lm_head_numel(spec: ModelSpec) -> int:
    """Parameters of the LM head's matrix (the embedding's, when tied)."""
    return spec.unit("embed" if spec.tied else "head").numel


def _loss_chunk_bytes(spec: ModelSpec, cfg: EngineConfig, mb_tokens: int) -> int:
    """One chunk of logits with its fp32 temporaries, and the LM head's autograd gradient."""
    size = cfg.dtype.itemsize
    chunk = min(cfg.loss_chunk_tokens, mb_tokens)
    return lm_head_numel(spec) * size + chunk * spec.text_config.vocab_size * logit_bytes(size)


def describe_model(spec: ModelSpec) -> str:
    """Layer kinds, parameter counts and host bytes needed, for `mt-ray info`."""
    kinds: dict[str, int] = {}
    for u in spec.layer_units:
        kinds[u.kind] = kinds.get(u.kind, 0) + 1
    bf16 = host_bytes(spec, EngineConfig(device="cpu", compute_dtype="bf16", grad_dtype="compute"),
                      OptimizerConfig(max_grad_norm=0))
    lines = [
        f"model_type: {spec.config.model_type}",
        f"parameters: {spec.num_params / 1e9:.3f} B (embedding {spec.unit('embed').numel / 1e6:.1f} M, "
        f"head {spec.unit('head').numel / 1e6:.1f} M, tied={spec.tied})",
        *([f"active parameters: {spec.active_text_params / 1e9:.3f} B a token (routed experts: top-k of each bank)"]
          if spec.routed_active_params else []),
        f"layers: {spec.num_layers}",
        *[f"  {kind}: {n} layers, {next(u.numel for u in spec.layer_units if u.kind == kind) / 1e6:.1f} M params each"
          for kind, n in kinds.items()],
        f"host memory (bf16 copy, no clipping): {bf16 / GIB:.1f} GiB ({bf16 / spec.num_params:.1f} B/param)",
    ]
    vision = vision_sizes(spec, 0)
    if vision is not None:
        bf16_copy = 2  # the streamed compute-dtype copy, as above
        tower_bytes = vision.tower_params * (4 + bf16_copy + (8 + bf16_copy if vision.tower_trains else 0))
        lines += [
            f"vision tower: {vision.depth} blocks, {vision.tower_params / 1e6:.1f} M params "
            f"({'trained' if vision.tower_trains else 'frozen: no moments, no gradient'}), "
            f"host memory {tower_bytes / GIB:.2f} GiB",
            f"projector: {vision.projector_params / 1e6:.1f} M params ({'trained' if vision.projector_trains else 'frozen'})",
            f"language model: {spec.text_params / 1e9:.3f} B params",
        ]
    return "\n".join(lines)
