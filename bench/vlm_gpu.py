"""Benchmark of an image-text model in the streaming engine: Qwen2.5-VL-7B's or Qwen3-VL-8B's shape, random init,
synthetic images.

Each sample is one image (`--image-px` square: (px/patch)^2 patches, a quarter of them image tokens) and
text up to `--seq` tokens. Reports the step time, the language model's TFLOPS (6 x its parameters x
tokens / step time, as bench/engine_gpu.py), the vision tower's and projector's matmul TFLOPS (what
`mt_ray.engine.sizing.VisionSizes.flops` counts: frozen tower forward, projector forward + recompute +
backward), peak GPU memory and host bytes per parameter (peak RSS), beside the calculator's figures.

The time split comes from one more step after the timed ones, with CUDA events on the compute stream around
the tower's forward and backward and the body's embedding with the feature scatter (`*_gpu_s`: the GPU
timeline between the events, idle time included); the language model's share (`decoder_gpu_s`) is the rest of
the step. Beside them: the optimizer thread's busy time and how long the engine's thread waited on it, the
host-side preparation of a step's micro-batches on the engine's thread (`prepare_s`: shifting labels, mrope
positions), and what the loader's thread spends in the image processor for a step's images (`processor_s`,
Qwen2-VL's processor at its defaults on `--image-px` pictures; it runs ahead of the engine, in the background).

    python bench/vlm_gpu.py --batch 128 --micro 16 --kernels liger --out $OUT/vlm_7b.json  # the lent H100
    python bench/vlm_gpu.py --shape qwen3-vl-8b --image-px 512 --out $OUT/vlm_qwen3_8b.json  # 16-pixel patches
    python bench/vlm_gpu.py --shape tiny --device cpu --steps 1  # a smoke run anywhere (and tiny-qwen3-vl)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import OPT, Timer, peak_rss_bytes, print_table, write_json  # noqa: E402
from mt_ray.engine import EngineConfig, StreamingEngine  # noqa: E402
from mt_ray.engine.batch import prepare_micro_batch  # noqa: E402
from mt_ray.engine.sizing import device_bytes, host_bytes, vision_sizes  # noqa: E402
from mt_ray.models.discovery import discover  # noqa: E402

# Qwen2.5-VL-7B-Instruct's and Qwen3-VL-8B-Instruct's config.json (text and vision), as published.
QWEN_IDS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653)
TINY_IDS = dict(image_token_id=500, video_token_id=501, vision_start_token_id=502, vision_end_token_id=503)
SHAPES = {
    "qwen2.5-vl-7b": dict(
        model_type="qwen2_5_vl",
        text_config=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                         num_key_value_heads=4, vocab_size=152064, rope_theta=1e6, max_position_embeddings=128000,
                         rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}),
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2),
        **QWEN_IDS),
    "qwen3-vl-8b": dict(  # deepstack: vision blocks 8, 16 and 24 feed language layers 0-2 through their own mergers
        model_type="qwen3_vl",
        text_config=dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=262144,
                         rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20],
                                          "mrope_interleaved": True}),
        vision_config=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                           deepstack_visual_indexes=[8, 16, 24]),
        **QWEN_IDS),
    "tiny": dict(
        model_type="qwen2_5_vl",
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[1]),
        **TINY_IDS),
    "tiny-qwen3-vl": dict(
        model_type="qwen3_vl",
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [4, 2, 2],
                                          "mrope_interleaved": True}),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                           deepstack_visual_indexes=[0, 1]),
        **TINY_IDS),
}


def micro_batches(cfg, batch: int, micro: int, seq: int, image_px: int, seed: int = 0) -> list[dict]:
    """Rows of [vision start, the image's tokens, vision end, text]; prompt and image tokens carry no loss."""
    g = torch.Generator().manual_seed(seed)
    vc = cfg.vision_config
    side = image_px // vc.patch_size
    patches, tokens = side * side, side * side // vc.spatial_merge_size**2
    if tokens + 8 > seq:
        raise SystemExit(f"--image-px {image_px} gives {tokens} image tokens, more than --seq {seq} allows")
    head = [cfg.vision_start_token_id, *[cfg.image_token_id] * tokens, cfg.vision_end_token_id]
    out = []
    for _ in range(batch // micro):
        text = torch.randint(0, 151000 if cfg.text_config.vocab_size > 151000 else 400, (micro, seq - len(head)), generator=g)
        ids = torch.cat([torch.tensor(head).expand(micro, -1), text], 1)
        labels = ids.clone()
        labels[:, :len(head) + 8] = -100  # the image and a short prompt
        pixels = torch.randn(patches, 3 * vc.temporal_patch_size * vc.patch_size**2, generator=g)
        image = {"pixel_values": pixels, "image_grid_thw": torch.tensor([[1, side, side]])}
        out.append({"input_ids": ids, "labels": labels, "images": [[image] for _ in range(micro)]})
    return out


class PhaseClock:
    """CUDA events on the compute stream around calls of the engine's parts, summed per phase (GPU seconds); on
    the CPU, where every kernel runs as it is called, the wall clock."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.spans: dict[str, list[tuple]] = {}

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def wrap(self, phase: str, fn):
        def timed(*args, **kwargs):
            start = self._mark()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spans.setdefault(phase, []).append((start, self._mark()))
        return timed

    def seconds(self) -> dict[str, float]:
        if not self.cuda:
            return {phase: sum(b - a for a, b in spans) for phase, spans in self.spans.items()}
        torch.cuda.synchronize()  # every event has been reached
        return {phase: sum(a.elapsed_time(b) for a, b in spans) / 1e3 for phase, spans in self.spans.items()}


class _TimedContext:
    """The engine's layer-context builder (embedding output -> body's pre-layer code, image features scattered),
    timed where the forward calls it."""

    def __init__(self, context, clock: PhaseClock):
        self._context = context
        self._call = clock.wrap("scatter_gpu_s", context)

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._context, name)


def time_split(engine: StreamingEngine, mbs: list[dict]) -> dict[str, float]:
    """One step with the tower's forward and backward and the feature scatter timed on the GPU; the decoder's
    share is the rest of the step's GPU time."""
    clock = PhaseClock(engine.device.type == "cuda")
    vision, context = engine.vision, engine.context
    forward, backward = vision.forward, vision.backward
    vision.forward, vision.backward = clock.wrap("tower_forward_gpu_s", forward), clock.wrap("tower_backward_gpu_s",
                                                                                              backward)
    engine.context = _TimedContext(context, clock)
    try:
        step = clock.wrap("step_gpu_s", engine.train_step)
        step(mbs)
        split = clock.seconds()
    finally:
        vision.forward, vision.backward, engine.context = forward, backward, context
    parts = ("tower_forward_gpu_s", "tower_backward_gpu_s", "scatter_gpu_s")
    split["decoder_gpu_s"] = split["step_gpu_s"] - sum(split.get(k, 0.0) for k in parts)
    return split


def prepare_seconds(engine: StreamingEngine, mbs: list[dict]) -> float:
    """The engine thread's host work before a step's first kernel: each micro-batch shifted, indexed and given
    its mrope positions (`StreamingEngine._prepare`), and copied up."""
    with Timer() as t:
        for b in mbs:
            prepare_micro_batch(b, engine.device, engine.context.document_images)
    return t.seconds


def processor_seconds(cfg, n_images: int, image_px: int) -> float:
    """What the loader's thread spends turning `n_images` pictures into pixel values and grids: Qwen2-VL's image
    processor (Qwen2.5-VL's and, with 16-pixel patches, Qwen3-VL's) at its defaults, on `image_px` squares."""
    import numpy as np
    from PIL import Image
    from transformers import Qwen2VLImageProcessor

    vc = cfg.vision_config
    proc = Qwen2VLImageProcessor(patch_size=vc.patch_size, temporal_patch_size=vc.temporal_patch_size,
                                 merge_size=vc.spatial_merge_size)
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (image_px, image_px, 3), dtype=np.uint8)) for _ in range(n_images)]
    t0 = time.perf_counter()
    for image in images:  # one call per sample, as the loader encodes each row's images
        proc(images=[image], return_tensors="pt")
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen2.5-vl-7b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--image-px", type=int, default=448, help="square image side in pixels (448: 256 image tokens)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--kernels", default="torch", choices=["torch", "liger"], help="as bench/engine_gpu.py's")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--keep-activations", default="0",
                   help="engine.keep_activations: 0 (full recompute, as bench/engine_gpu.py's default) or auto")
    p.add_argument("--out")
    args = p.parse_args()

    shape = dict(SHAPES[args.shape])
    cfg = AutoConfig.for_model(shape.pop("model_type"), **shape)
    cfg._attn_implementation = "sdpa"
    spec = discover(cfg)  # LLaMA-Factory's defaults: the tower frozen, the projector trained
    cuda = args.device == "cuda"
    ecfg = EngineConfig(device=args.device, compute_dtype="bf16" if cuda else "fp32", checkpoint_every=args.k,
                        stream_master=True, grad_dtype="compute", kernels=args.kernels,
                        keep_activations=args.keep_activations if args.keep_activations == "auto"
                        else int(args.keep_activations))  # the benchmarks' lean setting
    t0 = time.perf_counter()
    engine = StreamingEngine(spec, ecfg, OPT, total_steps=args.warmup + args.steps + 1)  # + the split's
    engine.load_random(seed=0)
    setup_s = time.perf_counter() - t0
    mbs = micro_batches(cfg, args.batch, args.micro, args.seq, args.image_px)
    try:
        for _ in range(args.warmup):
            engine.train_step(mbs)
        busy0, wait0 = engine.worker.busy_seconds, engine.streamer.optimizer_wait_s
        # As bench/engine_gpu.py: nothing waits for the device between steps; the clock stops at the last step's
        # GPU work (its optimizer tail would overlap the next step).
        with Timer() as t:
            for _ in range(args.steps):
                result = engine.train_step(mbs)
        loss = result.loss.item()
        engine.synchronize()
        step_s = t.seconds / args.steps
        optimizer_s = (engine.worker.busy_seconds - busy0) / args.steps
        optimizer_wait_s = (engine.streamer.optimizer_wait_s - wait0) / args.steps
        split = time_split(engine, mbs)
        prepare_s = prepare_seconds(engine, mbs)
    finally:
        engine.close()
    image_tokens = (args.image_px // cfg.vision_config.patch_size) ** 2 // 4
    vision = vision_sizes(spec, image_tokens)
    tokens = args.batch * args.seq
    row = {
        "shape": args.shape, "seq": args.seq, "batch": args.batch, "micro": args.micro, "image_tokens": image_tokens,
        "step_s": step_s, "loss": loss, **split, "optimizer_s": optimizer_s, "optimizer_wait_s": optimizer_wait_s,
        "prepare_s": prepare_s, "processor_s": processor_seconds(cfg, args.batch, args.image_px),
        "lm_params_b": spec.text_params / 1e9, "vision_params_b": vision.tower_params / 1e9,
        "lm_tflops": 6 * spec.text_params * tokens / step_s / 1e12,
        "vision_tflops": vision.flops(args.batch, image_tokens) / step_s / 1e12,
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
        "calc_gpu_gib": device_bytes(spec, ecfg, args.micro, args.seq, args.batch, image_tokens)["total"] / 2**30,
        "host_bytes_per_param": peak_rss_bytes() / spec.num_params,
        "calc_host_gib": host_bytes(spec, ecfg, OPT) / 2**30,
        "peak_host_gib": peak_rss_bytes() / 2**30, "setup_s": setup_s,
    }
    print_table([row], list(row))
    if args.out:
        write_json(args.out, {"rows": [row], "args": vars(args)})


if __name__ == "__main__":
    main()
