"""Local checkpoints: exact roundtrip, sharding, pruning, crash safety and corruption fallback."""

from __future__ import annotations

import base64
import json
import logging
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from safetensors import safe_open

from mt_ray.errors import CheckpointError
from mt_ray.tracking.checkpoint import CheckpointConfig, CheckpointManager
from mt_ray.tracking.ckpt_format import ShardSource
from mt_ray.tracking.ckpt_storage import LocalStorage, LocalWriter


def make_state(n: int = 1000, seed: int = 0) -> tuple[dict[str, torch.Tensor], dict]:
    g = torch.Generator().manual_seed(seed)
    tensors = {
        "master": torch.randn(n, generator=g),
        "exp_avg": torch.randn(n, generator=g),
        "exp_avg_sq": torch.rand(n, generator=g),
        "rng.cpu": torch.get_rng_state(),  # uint8, what the trainer adds
        "extra_bf16": torch.randn(3, 4, generator=g).bfloat16(),
        "scalar_i64": torch.tensor(-7),
        "empty": torch.empty(0, 5),
        "mask": torch.tensor([True, False, True]),
    }
    tensors["master"][0] = float("nan")  # bit-exact means NaN payloads and signed zeros survive too
    tensors["master"][1] = -0.0
    meta = {"step": seed + 1, "layout": {"embed": [0, 10], "layers.0": [10, 990]},
            "data": {"epoch": 1, "position": [3, 4]}, "rng": base64.b64encode(b"\x00\xffstate").decode()}
    return tensors, meta


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)), k


def manager(tmp_path: Path, **kw) -> CheckpointManager:
    return CheckpointManager(CheckpointConfig(uri=str(tmp_path / "ckpt"), **kw))


def test_roundtrip_is_bit_exact(tmp_path):
    tensors, meta = make_state()
    ckpt = manager(tmp_path)
    uri = ckpt.save(5, tensors, meta)
    assert uri == str(tmp_path / "ckpt" / "step-00000005") and ckpt.latest() == uri
    loaded, loaded_meta = ckpt.load()
    assert_same(loaded, tensors)
    assert loaded_meta == meta
    loaded, _ = ckpt.load(uri)
    assert_same(loaded, tensors)


def test_load_into_out_buffers_fills_them_in_place(tmp_path):
    tensors, meta = make_state()
    ckpt = manager(tmp_path, shard_bytes=1024)
    ckpt.save(1, tensors, meta)
    out = {k: torch.zeros_like(tensors[k]) for k in ("master", "exp_avg", "exp_avg_sq")}
    ptrs = {k: v.data_ptr() for k, v in out.items()}
    loaded, _ = ckpt.load(out=out)
    for k in out:
        assert loaded[k] is out[k] and out[k].data_ptr() == ptrs[k]
    assert_same(loaded, tensors)


def test_out_buffer_must_match(tmp_path):
    tensors, meta = make_state()
    ckpt = manager(tmp_path)
    ckpt.save(1, tensors, meta)
    with pytest.raises(CheckpointError, match="out buffer for 'master'"):
        ckpt.load(out={"master": torch.zeros(999)})
    with pytest.raises(CheckpointError, match="out buffer for 'master'"):
        ckpt.load(out={"master": torch.zeros(1000, dtype=torch.float64)})
    with pytest.raises(CheckpointError, match="no tensors"):
        ckpt.load(out={"momentum": torch.zeros(3)})


def test_large_tensor_is_sharded_and_reassembles(tmp_path):
    big = torch.arange(10_001, dtype=torch.float32)
    ckpt = manager(tmp_path, shard_bytes=4096)  # 1024 floats per shard -> 10 files
    uri = ckpt.save(3, {"master": big}, {"step": 3})
    shards = sorted(Path(uri).glob("master.*.safetensors"))
    assert [p.name for p in shards[:2]] == ["master.00000-of-00010.safetensors", "master.00001-of-00010.safetensors"]
    assert len(shards) == 10
    manifest = json.loads((Path(uri) / "manifest.json").read_text())
    for piece in manifest["tensors"]["master"]["pieces"]:
        with safe_open(Path(uri) / piece["file"], "pt") as f:  # each shard is a plain safetensors file
            part = f.get_tensor("master")
        assert part.numel() * 4 <= 4096
        assert torch.equal(part, big[piece["start"]:piece["start"] + piece["numel"]])
        entry = manifest["files"][piece["file"]]
        assert entry["size"] == (Path(uri) / piece["file"]).stat().st_size and len(entry["sha256"]) == 64
    loaded, _ = ckpt.load()
    assert torch.equal(loaded["master"], big)


def test_keep_last_prunes_only_older_checkpoints(tmp_path):
    ckpt = manager(tmp_path, keep_last=2)
    for step in (10, 20, 30, 40):
        ckpt.save(step, *make_state(seed=step))
    assert [c.step for c in ckpt.list()] == [30, 40]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-00000030", "step-00000040"]
    _, meta = ckpt.load()
    assert meta["step"] == 41


def test_resaving_a_step_replaces_it(tmp_path):
    ckpt = manager(tmp_path)
    ckpt.save(7, *make_state(seed=1))
    tensors, meta = make_state(seed=2)
    ckpt.save(7, tensors, meta)
    loaded, loaded_meta = ckpt.load()
    assert_same(loaded, tensors)
    assert loaded_meta == meta
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["step-00000007"]


class Crash(Exception):
    pass


class CrashingWriter(LocalWriter):
    """Dies after the first shard, as a killed process would: no commit, no clean-up."""

    def __init__(self, final: Path, tmp: Path):
        super().__init__(final, tmp)
        self.shards = 0

    def write_file(self, source: ShardSource):
        if self.shards == 1:
            raise Crash
        self.shards += 1
        return super().write_file(source)

    def abort(self) -> None:
        pass


class CrashingStorage(LocalStorage):
    def begin(self, dir_name: str) -> CrashingWriter:
        writer = super().begin(dir_name)
        return CrashingWriter(writer.final, writer.tmp)


def test_crash_mid_write_leaves_previous_checkpoint(tmp_path):
    root = tmp_path / "ckpt"
    config = CheckpointConfig(uri=str(root), io_workers=1, keep_last=1)
    good = CheckpointManager(config)
    tensors, meta = make_state(seed=1)
    first = good.save(1, tensors, meta)

    crashing = CheckpointManager(config, storage=CrashingStorage(root))
    with pytest.raises(Crash):
        crashing.save(2, *make_state(seed=2))
    leftovers = [p for p in root.iterdir() if ".tmp-" in p.name]
    assert len(leftovers) == 1 and any(leftovers[0].iterdir())  # a shard was written...
    assert not (leftovers[0] / "manifest.json").exists()  # ...but never published
    assert good.latest() == first and [c.step for c in good.list()] == [1]
    loaded, loaded_meta = good.load()
    assert_same(loaded, tensors)
    assert loaded_meta == meta

    good.save(3, *make_state(seed=3))  # the next save clears the debris
    assert sorted(p.name for p in root.iterdir()) == ["step-00000003"]


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_corrupted_shard_is_named_and_load_falls_back(tmp_path, caplog, damage):
    ckpt = manager(tmp_path, shard_bytes=1024)
    tensors, meta = make_state(seed=1)
    ckpt.save(1, tensors, meta)
    bad_uri = ckpt.save(2, *make_state(seed=2))
    shard = Path(bad_uri) / "exp_avg.00002-of-00004.safetensors"
    raw = bytearray(shard.read_bytes())
    if damage == "flip":
        raw[-5] ^= 0x01
        shard.write_bytes(raw)
    elif damage == "truncate":
        shard.write_bytes(raw[:-4])
    else:
        shard.unlink()

    with pytest.raises(CheckpointError, match=r"exp_avg\.00002-of-00004\.safetensors"):
        ckpt.load(bad_uri)
    with caplog.at_level(logging.WARNING, logger="mt_ray.tracking.checkpoint"):
        loaded, loaded_meta = ckpt.load()
    assert_same(loaded, tensors)
    assert loaded_meta == meta
    assert "exp_avg.00002-of-00004.safetensors" in caplog.text and "falling back" in caplog.text


def test_every_checkpoint_corrupted_is_an_error(tmp_path):
    ckpt = manager(tmp_path)
    uri = ckpt.save(1, *make_state())
    (Path(uri) / "master.00000-of-00001.safetensors").write_bytes(b"junk")
    with pytest.raises(CheckpointError, match="no valid checkpoint"):
        ckpt.load()


def test_empty_root(tmp_path):
    ckpt = manager(tmp_path)
    assert ckpt.latest() is None and ckpt.list() == []
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        ckpt.load()
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        ckpt.load(str(tmp_path / "ckpt" / "step-00000001"))


@pytest.mark.parametrize("meta", [{"step": (1, 2)}, {"layout": {1: 2}}, {"x": object()}, {"x": float("nan")}])
def test_meta_that_json_would_change_is_refused(tmp_path, meta):
    ckpt = manager(tmp_path)
    with pytest.raises(CheckpointError, match="meta"):
        ckpt.save(1, {"master": torch.zeros(2)}, meta)
    assert not (tmp_path / "ckpt").exists()


def test_bad_tensor_name_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="tensor name"):
        manager(tmp_path).save(1, {"../master": torch.zeros(2)}, {})


def test_config_checks():
    with pytest.raises(ValidationError, match="bucket"):
        CheckpointConfig(uri="s3:///prefix")
    with pytest.raises(ValidationError, match="local directory or s3"):
        CheckpointConfig(uri="gs://bucket/x")
    with pytest.raises(ValidationError, match="Extra inputs"):
        CheckpointConfig(keep_lats=2)
    config = CheckpointConfig(every_steps=5)
    assert [s for s in range(12) if config.should_save(s)] == [5, 10]
    assert not CheckpointConfig(every_steps=None).should_save(5)
