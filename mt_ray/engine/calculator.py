"""`mt-ray calc`: the fastest configuration that fits a GPU and a host, or why none does.

The search covers every memory knob of the engine: schedule, K, micro-batch, checkpoint
placement, prefetch depth, loss chunk, stream_master and gradient dtype, judged with the memory
and time models of sizing.py and step_time.py. Under `keep_activations: auto` each streamed
configuration keeps as many block graphs as fit its GPU budget beside its own peak (`max_kept`), which lowers its predicted time. Of the configurations that fit both the GPU (90% of it: the
allocator and the CUDA context need the rest) and the host, it takes the fastest predicted; among
those within 2% of it, the first in preference order (larger micro-batches, K=4, checkpoints on
the device, deeper prefetch, larger loss chunks, the given stream_master and gradient dtype),
because the time model cannot tell such configurations apart and these are the measured defaults.
When nothing fits it names the binding constraint and the largest seq, global batch and (for the
host) model size that would fit. The host keeps HOST_RESERVE_GIB for the process itself.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
import yaml

from mt_ray.engine.config import EngineConfig, OptimizerConfig
from mt_ray.engine.sizing import (
    GIB,
    PROCESS_RSS_BYTES,
    SFT,
    Stage,
    activation_slab_bytes,
    device_bytes,
    disk_bytes,
    host_bytes,
    kept_count,
    max_kept,
    reference_host_bytes,
    rollout_bytes,
    rollout_host_bytes,
    vision_sizes,
)
from mt_ray.engine.step_time import Machine, StepTime, predicted_step_seconds, step_time
from mt_ray.errors import ConfigError
from mt_ray.models.discovery import ModelSpec

# Larger micro-batches gain nothing measurable on an H100 (7B: 16 x 1k and 1 x 16k run alike), while
# the backward's temporaries, which the device model does not count, grow with them.
MAX_MICRO_TOKENS = 16384
# The resident schedule saves the recompute but exposes the optimizer pass, and its micro-batch
# shares the GPU with every weight and gradient sum. Measured on the H100 (seq 1024), it wins with
# 8k-token micro-batches (1.5B: 2.34 vs 2.67 s; 3B: 5.3 vs 6.06 s) and loses with 2k (7B: 18.5 vs 15.8 s).
RESIDENT_MIN_MICRO_TOKENS = 8192
GPU_HEADROOM = 0.9  # of the GPU's memory the step may use; the rest is the allocator's and CUDA context's
# Host memory kept for the process beyond what the engine allocates (Python, torch, the CUDA context): 1.7 GB
# measured at 3B (sizing.PROCESS_RSS_BYTES), 2.3 GB at 7B (14.3 B/param of peak RSS against 14.0 allocated).
HOST_RESERVE_GIB = 3.0
NEAR_FASTEST = 1.02  # predicted times this close are a tie, broken by preference order
K_ORDER = (4, 2, 8, 1)  # 4 is the measured default
SEQ_STEP = 128  # the largest seq that fits is named in multiples of this
LOSS_CHUNKS = (4096, 2048, 1024, 512, 256)
# Sequence chunks for the norms and MLP (`mlp_chunk_tokens`), tried where a sequence holds at least two:
# at long context, where the MLP's activations outgrow the rest; each costs one more MLP forward.
MLP_CHUNKS = (16384, 4096)
LONGEST_SEQ = 1 << 22  # the longest context `longest_context` looks for (4M tokens)
# Knobs the search sets, as EngineConfig fields, in the order the snippet lists them.
SEARCHED = ("schedule", "checkpoint_every", "checkpoint_placement", "prefetch_units", "loss_chunk_tokens",
            "mlp_chunk_tokens", "stream_master", "grad_dtype", "keep_activations", "state_placement")
# How far beyond the asked global batch the calculator looks for one that hides the optimizer.
HIDING_BATCH_LIMIT = 64
# Where the optimizer state may go, in the order tried: a tier is taken only when none before it fits the host.
PLACEMENTS = ("host", "nvme_moments", "nvme")


@dataclass(frozen=True)
class Option:
    """One configuration and what it costs."""

    cfg: EngineConfig
    micro_batch: int
    device: int
    host: int
    seconds: float


def recommend(spec: ModelSpec, seq: int, global_batch: int, gpu_mem_gb: float, host_mem_gb: float,
              cfg: EngineConfig | None = None, opt: OptimizerConfig | None = None, machine: Machine | None = None,
              max_micro_tokens: int = MAX_MICRO_TOKENS, image_tokens: int = 0, stage: Stage = SFT) -> dict:
    """The fastest configuration that fits `gpu_mem_gb` and `host_mem_gb` (GiB), or why none does.

    With it come what bounds its step (`bound`: compute, link, disk, or optimizer where the GPU waits for the host's
    Adam) and the step's parts; where the optimizer bounds it, the smallest global batch that hides the optimizer
    under the GPU's work (`hiding_batch`), and whether the configuration still fits there (`optimizer_advice`).

    `cfg` gives everything not searched (dtype, kernels, grad slabs) and the stream_master and
    gradient dtype to prefer on a tie; `opt` decides whether clipping holds every gradient.
    `image_tokens`: an image-text model's image tokens per sample (part of `seq`), for its vision tower.
    `stage`: what a preference stage adds (the policy's head again, a streamed reference, GRPO's rollout copy).
    GRPO's `rollout.placement: auto` takes the resident copy where any configuration fits beside it, else the
    streamed one (`rollout_placement` says which).
    """
    if stage.rollout_placement == "auto":
        args = (spec, seq, global_batch, gpu_mem_gb, host_mem_gb, cfg, opt, machine, max_micro_tokens, image_tokens)
        rec = recommend(*args, stage=replace(stage, rollout_placement="resident"))
        return rec if rec["fits"] else recommend(*args, stage=replace(stage, rollout_placement="streamed"))
    search = _Search.build(spec, gpu_mem_gb, host_mem_gb, cfg, opt, machine, max_micro_tokens, image_tokens, stage)
    machine = search.machine
    out = {"params": spec.num_params, **({"active_params": spec.active_text_params} if spec.routed_active_params else {}),
           "seq": seq, "global_batch": global_batch, "gpu_mem_gb": gpu_mem_gb, "host_mem_gb": host_mem_gb,
           "h2d_gbps": machine.h2d_gbps}
    vision = vision_sizes(spec, image_tokens)
    if vision is not None:
        out.update(vision_tower_params=vision.tower_params, vision_projector_params=vision.projector_params,
                   image_tokens=image_tokens, vision_patches_per_sample=vision.patches)
    if stage.preference:
        out.update(reference="stream" if stage.reference else "none",
                   reference_host_gib=reference_host_bytes(spec, search.cfg, stage) / GIB)
    if stage.rollout_tokens:  # GRPO's generation copy: held on the GPU beside every update
        copy, generation = rollout_bytes(spec, search.cfg, global_batch, stage.rollout_tokens, stage.rollout_streamed)
        out.update(rollout_placement=stage.rollout_placement, rollout_copy_gib=copy / GIB,
                   rollout_generation_gib=generation / GIB,
                   rollout_host_gib=rollout_host_bytes(spec, search.cfg, stage) / GIB)
        if stage.rollout_streamed:  # each token step of the whole batch brings every decoder layer over the link
            out["rollout_link_s_per_token_step"] = rollout_host_bytes(spec, search.cfg, stage) / (machine.h2d_gbps * 1e9)
    if machine.has_nvme:
        out.update(nvme_read_gbps=machine.nvme_read_gbps, nvme_write_gbps=machine.nvme_write_gbps,
                   nvme_mixed_gbps=machine.nvme_mixed_gbps)
    options = list(search.options(seq, global_batch))
    fitting = [o for o in options if search.fits(o)]
    # State moves to disk only where the host cannot hold it: each tier is taken only when none before it fits.
    best = next((b for p in PLACEMENTS if (b := _fastest([o for o in fitting if o.cfg.state_placement == p]))), None)
    if best is None:
        return {**out, "fits": False, **search.why_not(options, seq, global_batch)}
    c = best.cfg
    if c.state_placement != "host":
        out.update(nvme_path=c.nvme_path, disk_gib=disk_bytes(spec, c) / GIB, placement_reason=(
            f"the host cannot hold the optimizer state ({_gib(search.host_budget)} for it): "
            + ("the moments go" if c.state_placement == "nvme_moments" else "master and moments go")
            + f" to NVMe at {machine.describe_disk()}"))
    parts = search.step_time(best, seq, global_batch)
    rec = {
        **out, "fits": True, **{k: getattr(c, k) for k in SEARCHED}, "prefetch_units": c.prefetch_units or
        c.checkpoint_every, "micro_batch_size": best.micro_batch, "grad_accum_steps": global_batch // best.micro_batch,
        "device_gib": best.device / GIB, "host_gib": best.host / GIB, "host_bytes_per_param": best.host / spec.num_params,
        "host_rss_gib": (best.host + PROCESS_RSS_BYTES) / GIB,
        "predicted_step_s": best.seconds, **_throughput(spec, seq * global_batch, best.seconds),
        **_time_split(parts),
    }
    if parts.bound == "optimizer":
        rec.update(search.hiding_batch(best, seq, global_batch))
    return rec


def _throughput(spec: ModelSpec, tokens: int, seconds: float) -> dict:
    """The step's TFLOPS as 6 x params x tokens (`model_tflops`); for a mixture of experts, of the params a token
    computes with (`active_tflops`) only: its total would count every expert for every token, a figure above
    the card's peak."""
    if spec.routed_active_params:
        return {"active_tflops": 6 * spec.active_text_params * tokens / seconds / 1e12}
    return {"model_tflops": 6 * spec.text_params * tokens / seconds / 1e12}


def _time_split(parts: StepTime) -> dict:
    """What bounds the step, and its parts."""
    return {"bound": parts.bound, "compute_s": parts.compute, "link_s": parts.link,
            "optimizer_s": parts.optimizer, "optimizer_exposed_s": parts.optimizer_exposed}


def longest_context(spec: ModelSpec, gpu_mem_gb: float, host_mem_gb: float, global_batch: int = 1,
                    cfg: EngineConfig | None = None, opt: OptimizerConfig | None = None,
                    machine: Machine | None = None, stage: Stage = SFT) -> dict:
    """The longest sequence (a multiple of SEQ_STEP) that trains at `global_batch` sequences a step on this
    GPU and host, with the fastest configuration at that length, and what runs out one step longer."""
    search = _Search.build(spec, gpu_mem_gb, host_mem_gb, cfg, opt, machine, stage=stage)
    seq = search._largest(lambda s: search._any_fit(s, global_batch), LONGEST_SEQ, SEQ_STEP)
    if seq is None:
        return recommend(spec, SEQ_STEP, global_batch, gpu_mem_gb, host_mem_gb, cfg, opt, machine, stage=stage)
    rec = recommend(spec, seq, global_batch, gpu_mem_gb, host_mem_gb, cfg, opt, machine, stage=stage)
    if seq + SEQ_STEP <= LONGEST_SEQ:
        binding, reasons, _ = search.binding(list(search.options(seq + SEQ_STEP, global_batch, [1])), seq + SEQ_STEP,
                                             global_batch)
        rec.update(longer_binding=binding, longer_reason="; ".join(reasons))
    return rec


class _Search:
    """The candidate configurations of one model on one machine, and the limits when none fits."""

    def __init__(self, spec: ModelSpec, cfg: EngineConfig, opt: OptimizerConfig, machine: Machine,
                 gpu_budget: float, host_budget: float, max_micro_tokens: int, image_tokens: int = 0,
                 stage: Stage = SFT):
        self.spec, self.cfg, self.opt, self.machine = spec, cfg, opt, machine
        self.gpu_budget, self.host_budget = gpu_budget, host_budget
        self.max_micro_tokens = max_micro_tokens
        self.image_tokens = image_tokens
        self.stage = stage

    @classmethod
    def build(cls, spec: ModelSpec, gpu_mem_gb: float, host_mem_gb: float, cfg: EngineConfig | None,
              opt: OptimizerConfig | None, machine: Machine | None, max_micro_tokens: int = MAX_MICRO_TOKENS,
              image_tokens: int = 0, stage: Stage = SFT) -> _Search:
        """The search with the defaults filled in and the budgets the GPU's headroom and the host's reserve leave."""
        return cls(spec, cfg or EngineConfig(device="cpu", compute_dtype="bf16"), opt or OptimizerConfig(),
                   machine or Machine(), gpu_mem_gb * GIB * GPU_HEADROOM, (host_mem_gb - HOST_RESERVE_GIB) * GIB,
                   max_micro_tokens, image_tokens, stage)

    def fits(self, o: Option) -> bool:
        return o.device <= self.gpu_budget and o.host <= self.host_budget

    def options(self, seq: int, global_batch: int, micro_batches: list[int] | None = None) -> Iterator[Option]:
        """Every configuration, in preference order."""
        if micro_batches is None:
            micro_batches = [m for m in _divisors_desc(global_batch) if m * seq <= self.max_micro_tokens] or [1]
        host: dict[tuple, int] = {}  # neither depends on the micro-batch or the loss chunk: each once
        seconds: dict[tuple, float] = {}
        for micro in micro_batches:
            for knobs in self._knobs(micro * seq, seq):
                c = self._with_kept(self.cfg.model_copy(update=knobs), micro, seq, global_batch)
                key = tuple(v for k, v in knobs.items() if k != "loss_chunk_tokens")
                if key not in host:
                    host[key] = host_bytes(self.spec, c, self.opt, seq, global_batch, self.stage)
                    seconds[key] = predicted_step_seconds(self.spec, c, seq, global_batch, self.machine,
                                                          self.image_tokens, self.stage, opt=self.opt)
                secs = seconds[key] if not kept_count(c) else predicted_step_seconds(
                    self.spec, c, seq, global_batch, self.machine, self.image_tokens, self.stage, micro, self.opt)
                device = device_bytes(self.spec, c, micro, seq, global_batch, self.image_tokens, self.stage)["total"]
                yield Option(c, micro, device, host[key], secs)

    def step_time(self, o: Option, seq: int, global_batch: int) -> StepTime:
        """The parts of `o`'s predicted step (as `options` times it: per micro-batch only where it keeps graphs)."""
        micro = o.micro_batch if kept_count(o.cfg) else None
        return step_time(self.spec, o.cfg, seq, global_batch, self.machine, self.image_tokens, self.stage, micro,
                         self.opt)

    def hiding_batch(self, o: Option, seq: int, global_batch: int) -> dict:
        """The smallest global batch (in `o`'s micro-batches, up to HIDING_BATCH_LIMIT times this one) at which `o`'s
        configuration is no longer optimizer-bound, whether it fits there, and the advice in words. The resident
        schedule exposes the whole pass at any batch: its streamed twin is the one that can hide it."""
        parts = self.step_time(o, seq, global_batch)
        switch = o.cfg.schedule == "resident"
        if switch:
            o = replace(o, cfg=o.cfg.model_copy(update={"schedule": "stream", "keep_activations": 0}))
        micro = o.micro_batch

        def bound(batch: int) -> str:
            return self.step_time(o, seq, batch).bound

        high = global_batch * HIDING_BATCH_LIMIT // micro * micro
        if bound(high) == "optimizer":
            return {"optimizer_advice": f"optimizer-bound even at {high} sequences a step: the host's Adam needs more "
                    "memory bandwidth or cores (or a smaller model)"}
        low = global_batch  # optimizer-bound here; `high` is not
        while high - low > micro:
            mid = (low + high) // 2 // micro * micro
            low, high = (mid, high) if bound(mid) == "optimizer" else (low, mid)
        there = Option(o.cfg, micro, device_bytes(self.spec, o.cfg, micro, seq, high, self.image_tokens, self.stage)["total"],
                       host_bytes(self.spec, o.cfg, self.opt, seq, high, self.stage), 0.0)
        hidden = self.step_time(o, seq, high)
        if switch and high / hidden.total <= global_batch / parts.total * NEAR_FASTEST:
            return {"optimizer_advice": f"the resident schedule waits for the host's whole Adam pass "
                    f"({parts.optimizer:.3g} s a step); streaming would hide it at a global batch of {high} sequences "
                    "but trains no more tokens a second here"}
        active = (f", {6 * self.spec.active_text_params * seq * high / hidden.total / 1e12:.0f} active TFLOPS"
                  if self.spec.routed_active_params else "")
        fits = (f"{hidden.total:.3g} s a step{active}" if self.fits(there) else
                f"this configuration does not fit it ({_gib(there.device)} GPU, {_gib(there.host)} host): see "
                f"mt-ray calc --global-batch {high}")
        advice = (f"optimizer-bound: the host's Adam takes {parts.optimizer:.3g} s a step and the GPU waits "
                  f"{parts.optimizer_exposed:.3g} s of it; a global batch of {high} sequences"
                  + (" with engine.schedule: stream" if switch else "") + f" hides it under the GPU's work ({fits})")
        return {"hiding_batch": high, "optimizer_advice": advice}

    def _with_kept(self, c: EngineConfig, micro: int, seq: int, global_batch: int) -> EngineConfig:
        """`keep_activations: auto` resolved to the block graphs that fit the GPU budget beside the rest (0 when
        resident, which keeps everything anyway); a given number is kept as given."""
        if c.keep_activations != "auto":
            return c
        n = max_kept(self.spec, c, micro, seq, global_batch, self.gpu_budget, self.image_tokens, self.stage)
        return c.model_copy(update={"keep_activations": n})

    def _knobs(self, micro_tokens: int, seq: int) -> Iterator[dict]:
        chunks = _loss_chunks(self.cfg.loss_chunk_tokens, micro_tokens)
        precisions = list(dict.fromkeys([(self.cfg.stream_master, self.cfg.grad_dtype),
                                         *((s, g) for s in (False, True) for g in ("fp32", "compute"))]))
        placements = PLACEMENTS if self.machine.has_nvme else ("host",)
        layouts = [("resident", self.cfg.checkpoint_every, "device", None)] if micro_tokens >= RESIDENT_MIN_MICRO_TOKENS else []
        layouts += [("stream", k, place, depth) for k in K_ORDER for place in ("device", "host")
                    for depth in dict.fromkeys((k, k // 2 or 1, 1))]
        mlp_chunks = [None, *(c for c in MLP_CHUNKS if seq >= 2 * c)]
        for schedule, k, place, depth in layouts:
            for mlp_chunk in mlp_chunks:
                # The precision before the loss chunk: fp32 gradients where they fit, at any chunk size.
                for (stream_master, grad_dtype), placement, chunk in itertools.product(precisions, placements, chunks):
                    if stream_master and placement == "nvme":  # the master on disk cannot be streamed
                        continue
                    yield {"schedule": schedule, "checkpoint_every": k, "checkpoint_placement": place,
                           "prefetch_units": None if depth == k else depth, "loss_chunk_tokens": chunk,
                           "mlp_chunk_tokens": mlp_chunk, "stream_master": stream_master, "grad_dtype": grad_dtype,
                           "state_placement": placement}

    def why_not(self, options: list[Option], seq: int, global_batch: int) -> dict:
        """The binding constraint, the reason in words, and the largest seq, global batch and model that fit."""
        binding, reasons, lean_host = self.binding(options, seq, global_batch)
        host_ok = lean_host.host <= self.host_budget
        limits = {"max_seq": self._largest(lambda s: self._any_fit(s, global_batch), seq - 1, SEQ_STEP if seq > SEQ_STEP else 1),
                  "max_global_batch": self._largest(lambda b: self._any_fit(seq, b), global_batch - 1),
                  "max_params": self._max_params(lean_host, seq, global_batch)}
        hints = [f"seq {limits['max_seq']} fits at global batch {global_batch}" if limits["max_seq"] else "",
                 f"global batch {limits['max_global_batch']} fits at seq {seq}" if limits["max_global_batch"] else "",
                 f"this host holds models up to {limits['max_params'] / 1e9:.2f} B parameters"
                 if not host_ok and limits["max_params"] else ""]
        reason = "; ".join(reasons) + "".join(f"; {h}" for h in hints if h)
        return {"binding": binding, "reason": reason, **limits}

    def binding(self, options: list[Option], seq: int, global_batch: int) -> tuple[str, list[str], Option]:
        """Which memory runs out ('gpu', 'host' or 'gpu and host'), why in words, and the leanest host option."""
        lean_gpu = min(options, key=lambda o: o.device)
        lean_host = min(options, key=lambda o: o.host)
        gpu_ok, host_ok = lean_gpu.device <= self.gpu_budget, lean_host.host <= self.host_budget
        reasons = []
        if not gpu_ok:
            reasons.append(f"GPU: the leanest configuration ({_describe(lean_gpu)}) needs {_gib(lean_gpu.device)} "
                           f"for {global_batch} x {seq} tokens, over the {_gib(self.gpu_budget)} budget "
                           f"({GPU_HEADROOM:.0%} of the GPU)")
        if not host_ok:
            reasons.append(self._host_reason(options, lean_host, seq, global_batch))
        if gpu_ok and host_ok:
            fit_gpu = min((o for o in options if o.device <= self.gpu_budget), key=lambda o: o.host)
            reasons.append(f"GPU and host together: what fits the GPU ({_describe(fit_gpu)}) needs "
                           f"{_gib(fit_gpu.host)} of host memory, over {_gib(self.host_budget)}")
        binding = "gpu" if not gpu_ok and host_ok else "host" if gpu_ok and not host_ok else "gpu and host"
        return binding, reasons, lean_host

    def _host_reason(self, options: list[Option], lean: Option, seq: int, global_batch: int) -> str:
        c = lean.cfg
        slab = activation_slab_bytes(self.spec, c, seq * global_batch, self.stage)
        text = (f"host: the leanest state (state_placement={c.state_placement}, stream_master={c.stream_master}, "
                f"grad_dtype={c.grad_dtype}, checkpoints on "
                f"the {c.checkpoint_placement}: {(lean.host - slab) / self.spec.num_params:.1f} B/param) needs "
                f"{_gib(lean.host)}, over {_gib(self.host_budget)} (with {HOST_RESERVE_GIB:g} GiB kept "
                "for the process)")
        if self.opt.max_grad_norm > 0:
            unclipped = self.opt.model_copy(update={"max_grad_norm": 0.0})
            least = min(host_bytes(self.spec, o.cfg, unclipped, seq, global_batch, self.stage) for o in options)
            text += f"; without clipping (optimizer.max_grad_norm: 0) no step holds its gradients: {_gib(least)}"
        if not self.machine.has_nvme:
            text += ("; optimizer state on an NVMe disk would need less (mt-ray calc --probe-disk PATH, or "
                     "--nvme-gbps; engine.nvme_path for auto_fit)")
        return text

    def _any_fit(self, seq: int, global_batch: int) -> bool:
        # One sequence per micro-batch is the leanest on the GPU, and the host does not depend on it.
        return any(self.fits(o) for o in self.options(seq, global_batch, micro_batches=[1]))

    @staticmethod
    def _largest(fits, high: int, step: int = 1) -> int | None:
        """The largest multiple of `step` in [step, high] with fits(n) (fits is monotone), or None."""
        low, high = 1, high // step
        if high < 1 or not fits(step):
            return None
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if fits(mid * step) else (low, mid - 1)
        return low * step

    def _max_params(self, lean: Option, seq: int, global_batch: int) -> int | None:
        """Parameters this host holds at the leanest host state's bytes per parameter (slab aside)."""
        slab = activation_slab_bytes(self.spec, lean.cfg, seq * global_batch, self.stage)
        per_param = (lean.host - slab) / self.spec.num_params
        room = self.host_budget - slab
        return int(room / per_param) if room > 0 else None


def _fastest(options: list[Option]) -> Option | None:
    """The first option (preference order) within NEAR_FASTEST of the fastest prediction."""
    if not options:
        return None
    bound = min(o.seconds for o in options) * NEAR_FASTEST
    return next(o for o in options if o.seconds <= bound)


def _loss_chunks(first: int, micro_tokens: int) -> list[int]:
    """Loss chunks to try, largest first, each changing the chunk a micro-batch actually runs."""
    out, seen = [], set()
    for chunk in (first, *(c for c in LOSS_CHUNKS if c < first)):
        if min(chunk, micro_tokens) not in seen:
            seen.add(min(chunk, micro_tokens))
            out.append(chunk)
    return out


def _describe(o: Option) -> str:
    c = o.cfg
    if c.schedule == "resident":
        return f"resident, micro-batch {o.micro_batch}"
    state = f"state on {c.state_placement}, " if c.state_placement != "host" else ""
    return (f"{state}K={c.checkpoint_every}, checkpoints on the {c.checkpoint_placement}, prefetch "
            f"{c.prefetch_units or c.checkpoint_every}, loss chunk {c.loss_chunk_tokens}, "
            f"MLP chunk {c.mlp_chunk_tokens or 'none'}, micro-batch {o.micro_batch}, "
            f"stream_master={c.stream_master}, grad_dtype={c.grad_dtype}")


def _gib(n: float) -> str:
    return f"{n / GIB:.3g} GiB"


def _divisors_desc(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


def config_snippet(rec: dict, model: dict | None = None) -> str:
    """The recommendation as run-config YAML (`mt-ray train --config`), with the model section when given."""
    sections = {"model": model} if model else {}
    sections["data"] = {"max_seq_len": rec["seq"]}
    sections["training"] = {"micro_batch_size": rec["micro_batch_size"], "grad_accum_steps": rec["grad_accum_steps"]}
    sections["engine"] = {k: rec[k] for k in SEARCHED}
    if rec["state_placement"] != "host":
        sections["engine"]["nvme_path"] = rec.get("nvme_path") or "/path/on/nvme"
    if "rollout_placement" in rec:
        sections["rollout"] = {"placement": rec["rollout_placement"]}
    return yaml.safe_dump(sections, sort_keys=False)


def render_recommendation(rec: dict, model: dict | None = None) -> str:
    """A table of the figures, then the config snippet to run (or the reason nothing fits)."""
    width = max(map(len, rec))
    lines = [f"{k:>{width}}: {v:.3g}" if isinstance(v, float) else f"{k:>{width}}: {v}"
             for k, v in rec.items() if k != "reason"]
    if not rec["fits"]:
        return "\n".join([*lines, "", f"nothing fits. {rec['reason']}"])
    return "\n".join([*lines, "", "config:", config_snippet(rec, model).rstrip()])


def local_gpu_memory_gb(device: torch.device | None = None) -> float:
    """Memory of the local CUDA GPU (GiB), for a calculation that was given none."""
    if not torch.cuda.is_available():
        raise ConfigError("no CUDA GPU here to read the memory of: name the card (mt-ray calc --gpu rtx4090) or give "
                          "its memory in GiB (mt-ray calc --gpu-mem-gb 24, or engine.gpu_memory_limit_gb: 24)")
    return torch.cuda.get_device_properties(device or torch.device("cuda")).total_memory / GIB

