"""The GPUs people train on, as the calculator's step-time model sees them: memory, the bf16 rate a decoder layer
reaches and the host link (`mt-ray calc --gpu NAME`).

The H100 and H200 rates are measured (the 7B step at 128 x 1024: 445 and 452 model TFLOPS, 600 TFLOPS counted as
8·N·T as the step-time model counts a streamed step). The other cards' are that measured share of the H100's dense
bf16 tensor peak (0.61 of 989 TFLOPS) applied to their own dense bf16 peak with fp32 accumulation (GeForce cards
accumulate in fp32 at half their fp16-accumulate rate): estimates until measured. Links are one direction's pinned
copy rate: 25 GB/s for PCIe 4.0 x16, 50 for PCIe 5.0 x16 (48-55 measured on the H100 hosts), 400 for GH200's
NVLink-C2C (450 nominal). Memory is nvidia-smi's total, in GiB.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mt_ray.errors import ConfigError

LAYER_SHARE_OF_PEAK = 600 / 989  # the H100's measured layer rate against its dense bf16 peak


@dataclass(frozen=True)
class Gpu:
    """One card: its memory, the bf16 TFLOPS a decoder layer reaches, its host link, and where they come from."""

    name: str
    memory_gib: float
    layer_tflops: float
    h2d_gbps: float
    source: str


def _estimated(name: str, memory_gib: float, peak_tflops: float, h2d_gbps: float, link: str) -> Gpu:
    return Gpu(name, memory_gib, round(peak_tflops * LAYER_SHARE_OF_PEAK), h2d_gbps,
               f"estimated: {LAYER_SHARE_OF_PEAK:.2f} of its {peak_tflops:g} dense bf16 TFLOPS; {link}")


GPUS: dict[str, Gpu] = {g.name: g for g in (
    _estimated("rtx3080", 10, 59.5, 25, "PCIe 4.0 x16"),
    _estimated("rtx3090", 24, 71, 25, "PCIe 4.0 x16"),
    _estimated("rtx4080", 16, 97.5, 25, "PCIe 4.0 x16"),
    _estimated("rtx4090", 24, 165.2, 25, "PCIe 4.0 x16"),
    _estimated("rtx5090", 31.8, 209.5, 50, "PCIe 5.0 x16"),
    _estimated("a100-40gb", 40, 312, 25, "PCIe 4.0 x16"),
    _estimated("a100-80gb", 80, 312, 25, "PCIe 4.0 x16"),
    _estimated("l40s", 45.0, 362, 25, "PCIe 4.0 x16"),
    Gpu("h100", 79.6, 600, 50, "measured: 7B at 445 model TFLOPS, PCIe 5.0 host link at 48-55 GB/s"),
    Gpu("h200", 140.4, 600, 50, "measured: 7B at 452 model TFLOPS, PCIe 5.0 host link"),
    Gpu("gh200", 95.6, 600, 400, "the H100's measured rate; NVLink-C2C host link, 450 GB/s each way nominal"),
)}


def _key(name: str) -> str:
    """'NVIDIA GeForce RTX 3080', 'RTX-3080', 'A100 80GB' -> 'rtx3080', 'a10080'."""
    key = re.sub(r"[^a-z0-9]", "", name.lower()).removeprefix("nvidia").removeprefix("geforce")
    return key.removesuffix("gb")


_BY_KEY = {_key(n): g for n, g in GPUS.items()}


def gpu(name: str) -> Gpu:
    """The card named `name` (case, spaces and dashes aside: `RTX 3080`, `a100-80gb`, `H100`)."""
    found = _BY_KEY.get(_key(name))
    if found is None:
        raise ConfigError(f"--gpu {name}: not a card the calculator knows; choose one of {', '.join(GPUS)}, or give "
                          "--gpu-mem-gb, --gpu-tflops and --h2d-gbps for it")
    return found


def local_gpu(device_name: str, memory_gib: float) -> Gpu | None:
    """The table's card for a CUDA device name (`torch.cuda.get_device_name`: 'NVIDIA H100 80GB HBM3'), told apart by
    memory where the name alone does not (A100 40 and 80 GB); None for a card not in the table."""
    key = _key(device_name)
    names = ["gh200"] if "gh200" in key else [n for n in GPUS if re.sub(r"-\d+gb$", "", n) in key]
    return min((GPUS[n] for n in names), key=lambda g: abs(g.memory_gib - memory_gib), default=None)
