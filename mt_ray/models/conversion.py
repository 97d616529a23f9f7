"""Checkpoint tensors <-> model parameters, through transformers' own conversion mapping.

transformers 5 holds some weights differently from how checkpoints store them: MoE experts are
fused into 3-D tensors (`mlp.experts.gate_up_proj`) while checkpoints keep one matrix per expert
(`mlp.experts.0.gate_proj.weight`), and some families rename or re-prefix keys. `from_pretrained`
converts with the family's list of `WeightConverter`s and `WeightRenaming`s
(`transformers.conversion_mapping`), and `save_pretrained` reverts it. We use the same lists and
the same rename and convert code, but one group of tensors at a time, so a checkpoint streams into
host memory unit by unit and an export is what `save_pretrained` writes.

Before anything is read, every group is converted once on the meta device (shapes only), so a
checkpoint with missing, extra or mis-shaped tensors fails at once with the first few named.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors import safe_open
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    WeightConverter,
    WeightRenaming,
    WeightTransform,
    dot_natural_key,
    rename_source_key,
    revert_weight_conversion,
)

from mt_ray.errors import CheckpointError
from mt_ray.models.dequantize import Dequantizer, quant_method
from mt_ray.models.discovery import ModelSpec

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"
_SHOWN = 5  # how many offending tensors an error names

Reader = Callable[[str], torch.Tensor]


@dataclass
class _Group:
    """Checkpoint tensors that one transform turns into one or more model tensors."""

    first_target: str
    converter: WeightConverter | None  # None: the tensor is only renamed
    sources: list[tuple[str, str]] = field(default_factory=list)  # (source pattern, checkpoint key)

    def convert(self, read: Reader, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The model tensors this group makes, by model name, from tensors `read` returns."""
        if self.converter is None:
            [(_, key)] = self.sources
            return {self.first_target: read(key)}
        transform = copy.deepcopy(self.converter)  # transforms collect tensors: one instance per group
        for pattern, key in self.sources:
            transform.add_tensor(self.first_target, key, pattern, functools.partial(read, key))
        out = transform.convert(self.first_target, model=model, config=model.config)
        return {name: t[0] if isinstance(t, list) else t for name, t in out.items()}


class CheckpointReader:
    """A safetensors checkpoint folder (one file or sharded) seen under the model's tensor names."""

    def __init__(self, spec: ModelSpec, folder: str | Path):
        self.spec = spec
        self.folder = Path(folder)
        self._files = _weight_map(self.folder)
        self._handles: dict[str, object] = {}
        # a released quantized checkpoint (MXFP4, FP8 blocks) is read as the full-precision tensors it stands for
        self.dequantizer = Dequantizer(quant_method(spec.config), self._files)
        self.weight_map = self.dequantizer.weight_map
        self.dequantizer.check(self.folder, {k: self._meta(k) for k in self.weight_map})
        self._groups, unused = _plan_groups(spec.skeleton, self.weight_map)
        self._check_no_extra(unused)
        self._group_of = self._check_shapes()
        self._ready: dict[str, torch.Tensor] = {}

    def read_unit(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The tensors `names` (model names), converting each group the first time one is asked for."""
        out = {}
        for name in names:
            if name not in self._ready:
                self._ready.update(self._group_of[name].convert(self._read, self.spec.skeleton))
            out[name] = self._ready.pop(name)
        return out

    def close(self) -> None:
        self._handles.clear()
        self._ready.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _read(self, key: str) -> torch.Tensor:
        """The tensor `key` (a full-precision name), dequantized where the checkpoint stores it coded."""
        return self.dequantizer.read(key, self._read_stored)

    def _meta(self, key: str) -> torch.Tensor:
        """A meta tensor of what `_read` returns for `key`, from the file headers alone."""
        return self.dequantizer.meta(key, self._meta_stored)

    def _handle(self, key: str):
        fname = self._files[key]
        if fname not in self._handles:
            self._handles[fname] = safe_open(str(self.folder / fname), framework="pt")
        return self._handles[fname]

    def _read_stored(self, key: str) -> torch.Tensor:
        return self._handle(key).get_tensor(key)

    def _meta_stored(self, key: str) -> torch.Tensor:
        piece = self._handle(key).get_slice(key)
        return torch.empty(piece.get_shape(), dtype=_DTYPES.get(piece.get_dtype(), torch.float32), device="meta")

    def _check_no_extra(self, unused: list[str]) -> None:
        """Tensors the model has no place for mean the checkpoint is not for this config (more layers or
        experts, another architecture): refuse it, bar those transformers itself drops when loading
        (`_keys_to_ignore_on_load_unexpected`, such as DeepSeek-V3's multi-token-prediction layer, and stale
        rotary tables)."""
        report = SimpleNamespace(missing_keys=set(), unexpected_keys=set(unused))
        self.spec.skeleton._adjust_missing_and_unexpected_keys(report)  # transformers' own exception rules
        extra = sorted(report.unexpected_keys, key=dot_natural_key)
        if extra:
            raise CheckpointError(
                f"{self.folder} holds {len(extra)} tensors this model does not have: {', '.join(extra[:_SHOWN])}"
                f"{' ...' if len(extra) > _SHOWN else ''}; does config.json describe this checkpoint (number of "
                "layers or experts, architecture)?"
            )

    def _check_shapes(self) -> dict[str, _Group]:
        """Convert every group on the meta device; map each model tensor to the group that makes it."""
        # A mirror of a weight tied between layers is stored once, under its owner's name (it may be there too).
        expected = {p.hf_name: p.shape for u in self.spec.units for p in u.params if p.tied_to is None}
        group_of: dict[str, _Group] = {}
        wrong = []
        for group in self._groups:
            try:
                made = group.convert(self._meta, self.spec.skeleton)
            except Exception as e:  # a converter that cannot stack or split what the file holds
                keys = [k for _, k in group.sources]
                raise CheckpointError(
                    f"{self.folder}: cannot convert {keys[:_SHOWN]} into '{group.first_target}' "
                    f"({type(e).__name__}: {e}); is this checkpoint for the architecture in its config.json?"
                ) from None
            for name, t in made.items():
                if name in expected:
                    group_of[name] = group
                    if tuple(t.shape) != expected[name]:
                        wrong.append(f"{name}: expected {expected[name]}, found {tuple(t.shape)}")
        missing = [f"{n} {s}" for n, s in expected.items() if n not in group_of]
        if missing:
            raise CheckpointError(
                f"{self.folder} lacks {len(missing)} tensors the model needs (name and expected shape): "
                f"{', '.join(missing[:_SHOWN])}{' ...' if len(missing) > _SHOWN else ''}; is this checkpoint "
                "complete, and for the architecture in its config.json?"
            )
        if wrong:
            raise CheckpointError(
                f"{self.folder} holds {len(wrong)} tensors of the wrong shape: {'; '.join(wrong[:_SHOWN])}"
                f"{' ...' if len(wrong) > _SHOWN else ''}; does config.json describe this checkpoint?"
            )
        return group_of


def to_checkpoint_format(spec: ModelSpec, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Model tensors renamed and split as `save_pretrained` writes them (per-expert matrices, ...)."""
    return revert_weight_conversion(spec.skeleton, state)


def _plan_groups(skeleton: torch.nn.Module, weight_map: dict[str, str]) -> tuple[list[_Group], list[str]]:
    """Group the checkpoint's keys by the model tensor they become, as `from_pretrained` does; and the keys
    that become none of the model's tensors."""
    mapping = get_model_conversion_mapping(skeleton)
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    by_pattern: dict[str, WeightTransform] = {p: c for c in converters for p in c.source_patterns}
    model_keys = skeleton.state_dict()
    prefix = skeleton.base_model_prefix
    groups: dict[str, _Group] = {}
    unused: list[str] = []
    # Natural key order, as transformers uses: experts 0, 1, ..., 10 stack in index order.
    for key in sorted(weight_map, key=dot_natural_key):
        target, pattern = rename_source_key(key, renamings, converters, prefix, model_keys)
        if target not in model_keys and key in model_keys:  # transformers' own fallback: keep the name
            target, pattern = rename_source_key(key, [], [], prefix, model_keys)
        if target not in model_keys:
            unused.append(key)
            continue
        group = groups.setdefault(target, _Group(target, by_pattern[pattern] if pattern else None))
        group.sources.append((pattern or key, key))
    return list(groups.values()), unused


def _weight_map(folder: Path) -> dict[str, str]:
    index = folder / SAFE_INDEX
    if index.exists():
        return json.loads(index.read_text())["weight_map"]
    single = folder / SAFE_SINGLE
    if not single.exists():
        raise CheckpointError(f"no {SAFE_SINGLE} or {SAFE_INDEX} in {folder}")
    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), SAFE_SINGLE)


# safetensors' dtype names, for the meta tensors of the shape check.
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu}
