"""Released quantized checkpoints, seen as the full-precision tensors transformers' dequantizing load makes of them.

Two layouts are read, each with transformers' own dequantize code, into fp32 (the master's dtype):
- MXFP4 (`quant_method: mxfp4`, GPT-OSS): experts stored as `<name>_blocks` (two e2m1 codes a byte, 32 a block) and
  `<name>_scales` (an e8m0 exponent a block) become `<name>` (`convert_moe_packed_tensors`, as
  `Mxfp4Config(dequantize=True)` loads them).
- FP8 with block scales (`quant_method: fp8`, DeepSeek-V3, the Qwen3 FP8 releases): a float8 `<name>.weight` with
  its `<name>.weight_scale_inv` becomes that weight times its block's scale (`Fp8Dequantize`, as
  `FineGrainedFP8Config(dequantize=True)` loads them).
Anything else quantized is refused in one line naming the format, a tensor and what to do. The engine then holds
plain weights: its export writes plain safetensors and a config without `quantization_config`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.integrations.finegrained_fp8 import Fp8Dequantize
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from mt_ray.errors import CheckpointError

Reader = Callable[[str], torch.Tensor]
MXFP4_PARTS = ("_blocks", "_scales")
FP8_SCALE = "_scale_inv"
FULL_PRECISION = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
SUPPORTED = ("mxfp4", "fp8")
FIX = ("load it with transformers' dequantizing load and save it in bf16 (from_pretrained(path, "
       "quantization_config=...(dequantize=True)).save_pretrained(out)), and train from that folder")


def quant_method(config) -> str | None:
    """The checkpoint's `quantization_config.quant_method` (None: not quantized)."""
    quant = getattr(config, "quantization_config", None)
    if quant is None:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    return str(getattr(method, "value", method) or "unknown")


class Dequantizer:
    """The checkpoint's keys as full-precision tensor names (`weight_map`), read (`read`) and sized (`meta`) through
    the dequantization their format asks for."""

    def __init__(self, method: str | None, weight_map: dict[str, str]):
        self.method = method
        self.parts: dict[str, tuple[str, str]] = {}  # full-precision name: (codes key, scales key)
        if method == "mxfp4":
            for key in weight_map:
                if key.endswith("_blocks") and f"{key[:-7]}_scales" in weight_map:
                    self.parts[key[:-7]] = (key, f"{key[:-7]}_scales")
        elif method == "fp8":
            for key in weight_map:
                if f"{key}{FP8_SCALE}" in weight_map:
                    self.parts[key] = (key, f"{key}{FP8_SCALE}")
        used = {k for pair in self.parts.values() for k in pair}
        # FP8 checkpoints also carry activation scales (static schemes): transformers drops them with dequantize
        self.weight_map = {k: f for k, f in weight_map.items() if k not in used and not k.endswith("activation_scale")}
        self.weight_map.update({name: weight_map[codes] for name, (codes, _) in self.parts.items()})

    def read(self, key: str, raw: Reader) -> torch.Tensor:
        if key not in self.parts:
            return raw(key)
        codes, scales = (raw(k) for k in self.parts[key])
        if self.method == "mxfp4":
            return convert_moe_packed_tensors(codes, scales, dtype=torch.float32)
        # transformers' own per-tensor dequantize (the op its FP8 dequantizing load runs), into fp32
        return Fp8Dequantize(None)._dequantize_one(codes, scales, output_dtype=torch.float32)

    def meta(self, key: str, raw_meta: Reader) -> torch.Tensor:
        """A meta tensor of what `read` makes of `key`."""
        if key not in self.parts:
            return raw_meta(key)
        codes = raw_meta(self.parts[key][0])
        if self.method == "mxfp4":  # [*, rows, blocks, 16 bytes] -> [E, blocks x 32, rows] (transposed, as GPT-OSS)
            *prefix, rows, blocks, width = codes.shape
            return torch.empty(*prefix[:1], blocks * width * 2, rows, *prefix[1:], device="meta")
        return torch.empty(codes.shape, device="meta")

    def check(self, folder, metas: dict[str, torch.Tensor]) -> None:
        """Refuse what is still coded after dequantization (an unsupported format, or codes without their scales)."""
        coded = [f"{k} ({t.dtype})" for k, t in metas.items() if t.dtype not in FULL_PRECISION]
        if self.method not in (None, *SUPPORTED):
            where = coded[0] if coded else "its weights"
            raise CheckpointError(f"{folder} is quantized as '{self.method}' ({where}), which mt-ray cannot "
                                  f"dequantize (it reads {' and '.join(SUPPORTED)}): {FIX}")
        if coded:
            raise CheckpointError(f"{folder} holds quantized tensors without their scales "
                                  f"({', '.join(coded[:5])}; format {self.method or 'none declared'}): {FIX}")
