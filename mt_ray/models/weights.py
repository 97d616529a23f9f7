"""Weights in and out of the host store: random init, safetensors folders, Hugging Face export.

Loading reads one unit's tensors at a time from the safetensors files (memory-mapped), converted
from the checkpoint's layout by transformers' own mapping (`conversion.py`), straight into their
slices of the fp32 master, so a checkpoint is never held in memory twice. Random init
materialises one unit at a time and uses the family's own `_init_weights`.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from transformers import GenerationConfig

from mt_ray.models.conversion import SAFE_INDEX, SAFE_SINGLE, CheckpointReader, to_checkpoint_format
from mt_ray.models.discovery import ModelSpec, UnitSpec, embed_module
from mt_ray.models.nesting import head_extras
from mt_ray.models.vision import VISION_BLOCK_PREFIX, is_vision_unit

UnitSink = Callable[[UnitSpec, dict[str, torch.Tensor]], None]


def unit_module(spec: ModelSpec, unit: UnitSpec) -> nn.Module:
    """The skeleton module whose parameters make up `unit` (head: a norm + lm_head container; a vision
    unit: its block, or a copy of the modules owning its parameters at their paths in the composite body)."""
    if unit.name.startswith(VISION_BLOCK_PREFIX):
        return spec.vision.blocks[int(unit.name.rsplit(".", 1)[1])]
    if is_vision_unit(unit.name):
        return _owners(spec.vision.outer, [p.local_name for p in unit.params])
    if unit.name == "embed":
        return embed_module(spec)
    if unit.name == "head":
        parts = {"norm": spec.base.get_submodule(spec.norm_attr)} if spec.norm_attr is not None else {}
        parts.update({a: getattr(spec.base, a) for a in spec.tail_attrs})
        if not spec.tied or any(p.local_name.startswith("lm_head.") for p in unit.params):  # a tied head's bias
            parts["lm_head"] = spec.skeleton.get_output_embeddings()
        return nn.ModuleDict({**parts, **head_extras(spec.skeleton, spec.base, spec.between_attrs, spec.unread_attrs)})
    return spec.base.get_submodule(spec.layers_attr)[int(unit.name.split(".")[1])]


def _owners(root: nn.Module, names: list[str]) -> nn.Module:
    """A module holding a copy of each module that owns one of `names`, at its path under `root`."""
    tree = nn.Module()
    attached: list[str] = []
    for path in sorted({n.rpartition(".")[0] for n in names}, key=len):
        if any(path.startswith(f"{a}.") for a in attached):
            continue  # its ancestor's copy holds it
        parent = tree
        *parents, leaf = path.split(".")
        for part in parents:
            if part not in parent._modules:
                parent.add_module(part, nn.Module())
            parent = parent._modules[part]
        parent.add_module(leaf, root.get_submodule(path))
        attached.append(path)
    return tree


def init_random(spec: ModelSpec, sink: UnitSink, seed: int = 0, device: str | torch.device = "cpu") -> None:
    """Initialise every unit as `from_config` would, one unit at a time (on `device`, then to host)."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        for unit in spec.units:
            module = copy.deepcopy(unit_module(spec, unit)).to_empty(device=device)
            for sub in module.modules():
                spec.skeleton._init_weights(sub)
            by_local = dict(module.state_dict(keep_vars=True))  # parameters and saved buffers
            sink(unit, {p.hf_name: by_local[p.local_name] for p in unit.params})
    finally:
        torch.random.set_rng_state(gen_state)


def load_safetensors(spec: ModelSpec, folder: str | Path, sink: UnitSink) -> None:
    """Stream a (sharded) safetensors checkpoint folder into the store, unit by unit.

    Every tensor's presence and shape is checked before the first is read (`CheckpointError`).
    """
    with CheckpointReader(spec, folder) as reader:
        for unit in spec.units:
            sink(unit, reader.read_unit(p.hf_name for p in unit.params if p.tied_to is None))  # mirrors: stored once


def export_hf(spec: ModelSpec, state: dict[str, torch.Tensor], out_dir: str | Path, tokenizer=None,
              dtype: torch.dtype = torch.float32, max_shard_bytes: int = 5 * 1024**3,
              extra_files: Sequence[Path] = (), generation: GenerationConfig | None = None) -> Path:
    """Write a Hugging Face folder (config, safetensors shards, tokenizer) that from_pretrained loads.

    `extra_files` are copied in as they are (an image-text model's processor files). `generation` is
    written as `generation_config.json`, and fills the config's `eos_token_id` and `pad_token_id` where the
    model's own config leaves them unset, so `generate` stops where the chat template ends a turn. Files get
    ordinary permissions (0666 less the umask, as `open` gives; safetensors writes 0600). The folder is
    assembled under a temporary name and renamed when complete. Tensors are copied one shard at a
    time, so exporting never doubles the model in memory.
    """
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    config = copy.deepcopy(spec.config)
    config.dtype = dtype
    if hasattr(config, "quantization_config"):  # loaded dequantized (`dequantize.py`): the export is plain weights
        del config.quantization_config
    config.architectures = [type(spec.skeleton).__name__]
    text_config = config.get_text_config()
    for key in ("eos_token_id", "pad_token_id"):
        if generation is not None and getattr(text_config, key, None) is None:
            value = getattr(generation, key)
            setattr(text_config, key, value[0] if isinstance(value, list) else value)
    config.save_pretrained(tmp)
    if generation is not None:
        generation.save_pretrained(tmp)
    # A weight tied between layers is written once, under its owner's name, as save_pretrained writes it.
    mirrors = {p.hf_name for u in spec.units for p in u.params if p.tied_to is not None}
    state = to_checkpoint_format(spec, {k: v for k, v in state.items() if k not in mirrors})  # views, no copies
    shards = _plan_shards(state, dtype, max_shard_bytes)
    weight_map = {}
    for i, names in enumerate(shards):
        fname = SAFE_SINGLE if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        # A copy per shard, contiguous: reverted tensors are views into the fused master tensors.
        tensors = {n: state[n].detach().to(dtype).clone(memory_format=torch.contiguous_format) for n in names}
        save_file(tensors, tmp / fname, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, fname))
    if len(shards) > 1:
        total = sum(state[n].numel() for n in state) * torch.empty((), dtype=dtype).element_size()
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / SAFE_INDEX).write_text(json.dumps(index, indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    for file in extra_files:
        shutil.copy2(file, tmp / Path(file).name)
    _ordinary_permissions(tmp)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)  # the folder appears complete or not at all
    return out


def _ordinary_permissions(folder: Path) -> None:
    umask = os.umask(0)
    os.umask(umask)  # reading the umask means setting it: put it straight back
    for path in folder.rglob("*"):
        if path.is_file():
            path.chmod(0o666 & ~umask)


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
