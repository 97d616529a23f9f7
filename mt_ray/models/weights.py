"""Weights in and out of the host store: random init, safetensors folders, Hugging Face export.

Loading reads one tensor at a time from the safetensors files (memory-mapped) straight into
its slice of the fp32 master, so a checkpoint is never held in memory twice. Random init
materialises one unit at a time and uses the family's own `_init_weights`.
"""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from mt_ray.errors import CheckpointError
from mt_ray.models.discovery import ModelSpec, UnitSpec

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"

UnitSink = Callable[[UnitSpec, dict[str, torch.Tensor]], None]


def unit_module(spec: ModelSpec, unit: UnitSpec) -> nn.Module:
    """The skeleton module whose parameters make up `unit` (head: a norm + lm_head container)."""
    if unit.name == "embed":
        return spec.skeleton.get_input_embeddings()
    if unit.name == "head":
        parts = {"norm": getattr(spec.base, spec.norm_attr)}
        if not spec.tied:
            parts["lm_head"] = spec.skeleton.get_output_embeddings()
        return nn.ModuleDict(parts)
    return getattr(spec.base, spec.layers_attr)[int(unit.name.split(".")[1])]


def init_random(spec: ModelSpec, sink: UnitSink, seed: int = 0, device: str | torch.device = "cpu") -> None:
    """Initialise every unit as `from_config` would, one unit at a time (on `device`, then to host)."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        for unit in spec.units:
            module = copy.deepcopy(unit_module(spec, unit)).to_empty(device=device)
            for sub in module.modules():
                spec.skeleton._init_weights(sub)
            by_local = dict(module.named_parameters())
            sink(unit, {p.hf_name: by_local[p.local_name] for p in unit.params})
    finally:
        torch.random.set_rng_state(gen_state)


def load_safetensors(spec: ModelSpec, folder: str | Path, sink: UnitSink) -> None:
    """Stream a (sharded) safetensors checkpoint folder into the store, unit by unit."""
    folder = Path(folder)
    weight_map = _weight_map(folder)
    missing = [p.hf_name for u in spec.units for p in u.params if p.hf_name not in weight_map]
    if missing:
        raise CheckpointError(
            f"{folder} lacks {len(missing)} weights the model needs, e.g. {missing[:3]}; "
            "is this checkpoint for the same architecture as its config.json?"
        )
    handles: dict[str, object] = {}
    try:
        for unit in spec.units:
            tensors = {}
            for p in unit.params:
                fname = weight_map[p.hf_name]
                if fname not in handles:
                    handles[fname] = safe_open(str(folder / fname), framework="pt")
                t = handles[fname].get_tensor(p.hf_name)
                if tuple(t.shape) != p.shape:
                    raise CheckpointError(f"{p.hf_name} in {fname} has shape {tuple(t.shape)}, expected {p.shape}")
                tensors[p.hf_name] = t
            sink(unit, tensors)
    finally:
        handles.clear()


def _weight_map(folder: Path) -> dict[str, str]:
    index = folder / SAFE_INDEX
    if index.exists():
        return json.loads(index.read_text())["weight_map"]
    single = folder / SAFE_SINGLE
    if not single.exists():
        raise CheckpointError(f"no {SAFE_SINGLE} or {SAFE_INDEX} in {folder}")
    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), SAFE_SINGLE)


def export_hf(spec: ModelSpec, state: dict[str, torch.Tensor], out_dir: str | Path, tokenizer=None,
              dtype: torch.dtype = torch.float32, max_shard_bytes: int = 5 * 1024**3) -> Path:
    """Write a Hugging Face folder (config, safetensors shards, tokenizer) that from_pretrained loads.

    The folder is assembled under a temporary name and renamed when complete. Tensors are copied
    one shard at a time, so exporting never doubles the model in memory.
    """
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    config = copy.deepcopy(spec.config)
    config.dtype = dtype
    config.architectures = [type(spec.skeleton).__name__]
    config.save_pretrained(tmp)
    shards = _plan_shards(state, dtype, max_shard_bytes)
    weight_map = {}
    for i, names in enumerate(shards):
        fname = SAFE_SINGLE if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: state[n].detach().to(dtype).clone() for n in names}, tmp / fname, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, fname))
    if len(shards) > 1:
        total = sum(state[n].numel() for n in state) * torch.empty((), dtype=dtype).element_size()
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / SAFE_INDEX).write_text(json.dumps(index, indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)  # the folder appears complete or not at all
    return out


def _plan_shards(state: dict[str, torch.Tensor], dtype: torch.dtype, max_bytes: int) -> list[list[str]]:
    size = torch.empty((), dtype=dtype).element_size()
    shards: list[list[str]] = [[]]
    used = 0
    for name, t in state.items():
        nbytes = t.numel() * size
        if shards[-1] and used + nbytes > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return shards
