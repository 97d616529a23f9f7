"""Checkpoints written in parts by several processes, and read back by ranges cut another way."""

from __future__ import annotations

import pickle
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

from mt_ray.errors import CheckpointError
from mt_ray.tracking.checkpoint import CheckpointConfig, CheckpointManager
from mt_ray.tracking.ckpt_format import ShardSource, plan_pieces

N = 1000


def flat_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(N, generator=g) for name in ("master", "exp_avg", "exp_avg_sq")}


def test_pieces_never_straddle_a_cut_and_cover_the_tensor_once():
    record = plan_pieces("master", torch.float32, [N], shard_bytes=4 * 300, cuts=[250, 700])
    spans = [(p.start, p.start + p.numel) for p in record.pieces]
    assert spans == [(0, 250), (250, 550), (550, 700), (700, 1000)]
    assert [p.file for p in record.pieces][0] == "master.00000-of-00004.safetensors"
    assert plan_pieces("e", torch.float32, [0], 64).pieces[0].numel == 0  # an empty tensor is one empty piece


def write_part(writer, name: str, tensor: torch.Tensor, pieces: list) -> dict:
    """What a shard does in its own process: store its pieces through the pickled writer."""
    return {p.file: writer.write_file(ShardSource(p.file, name, p.start, tensor[p.start:p.start + p.numel]))
            for p in pieces}


def test_parts_written_by_other_processes_load_as_one_checkpoint(tmp_path):
    manager = CheckpointManager(CheckpointConfig(uri=str(tmp_path), shard_bytes=4 * 400))
    state, cuts = flat_state(), [300, 600]
    records = {k: plan_pieces(k, v.dtype, [N], 4 * 400, cuts) for k, v in state.items()}

    def write(writer) -> dict:
        pickle.dumps(writer)  # it travels to the processes holding the state
        with ProcessPoolExecutor(2) as pool:
            futures = [pool.submit(write_part, writer, k, state[k], records[k].pieces) for k in state]
            return {f: r for fut in futures for f, r in fut.result().items()}

    uri = manager.save_with(3, records, {"step": 3}, write)
    tensors, meta = manager.load()  # a single engine reads it like any checkpoint
    assert meta == {"step": 3} and uri.endswith("step-00000003")
    for k, v in state.items():
        assert torch.equal(tensors[k], v)


def test_a_range_cut_another_way_reads_exactly_its_elements(tmp_path):
    manager = CheckpointManager(CheckpointConfig(uri=str(tmp_path), shard_bytes=4 * 128))
    state = flat_state(1)
    manager.save(1, state, {"step": 1})
    got = {}

    def read(stored):
        for lo, hi in ((0, 200), (200, 777), (777, N), (5, 6)):
            dest = torch.empty(hi - lo)
            stored.read_range("exp_avg", lo, hi, dest)
            got[(lo, hi)] = dest
        return pickle.loads(pickle.dumps(stored)).where  # a reader can hand it to another process

    assert manager.load_with(read).endswith("step-00000001")
    for (lo, hi), dest in got.items():
        assert torch.equal(dest, state["exp_avg"][lo:hi])


def test_a_writer_that_leaves_a_piece_out_leaves_no_checkpoint(tmp_path):
    manager = CheckpointManager(CheckpointConfig(uri=str(tmp_path), shard_bytes=4 * 400))
    state = flat_state()
    records = {k: plan_pieces(k, v.dtype, [N], 4 * 400) for k, v in state.items()}
    with pytest.raises(CheckpointError, match="no writer stored"):
        manager.save_with(2, records, {"step": 2}, lambda writer: {})
    assert manager.latest() is None and not list(tmp_path.iterdir())
