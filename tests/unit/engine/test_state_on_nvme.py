"""Optimizer state on NVMe (`engine.state_placement`): the same losses and weights as host placement, bit for bit,
checkpoints written from the state files by range that resume exactly, and bad folders refused before any state."""

import errno
import os

import pytest
import torch

from mt_ray.engine import EngineConfig, OptimizerConfig, StreamingEngine
from mt_ray.engine.direct_io import FileIO, Pending, StateIOError, build_file_io
from mt_ray.engine.host_store import HostStore, StatePlacement, state_placement
from mt_ray.engine.state_files import check_state_path
from mt_ray.errors import ConfigError, InsufficientMemoryError
from mt_ray.models.discovery import discover
from mt_ray.tracking.checkpoint import CheckpointConfig, CheckpointManager
from tests.tiny_models import tiny_batches, tiny_config

OPT = OptimizerConfig(lr=1e-3, weight_decay=0.1, warmup_steps=2, max_grad_norm=1.0)
STEPS = 4


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Cut the tiny units into several chunks, and a window of 2 slots: every update reads and writes the disk."""
    monkeypatch.setattr(StatePlacement, "file_chunk_numel", 1000)


def engine(placement: str, folder, opt: OptimizerConfig = OPT, **kw) -> StreamingEngine:
    cfg = EngineConfig(device="cpu", compute_dtype="fp32", state_placement=placement,
                       nvme_path=None if placement == "host" else str(folder), nvme_window=2, **kw)
    return StreamingEngine(discover(tiny_config("llama")), cfg, opt, total_steps=6)


def train(e: StreamingEngine, steps: range) -> list[float]:
    return [e.train_step(tiny_batches(seed=s)).loss.item() for s in steps]


def final(e: StreamingEngine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in e.state_dict().items()}


def checkpoints(tmp_path) -> CheckpointManager:
    """Checkpoints in small shards, so a restore into the state files takes several pieces."""
    return CheckpointManager(CheckpointConfig(uri=str(tmp_path / "ckpt"), shard_bytes=4096))


def state_folder(tmp_path):
    """The NVMe state's folder, beside the checkpoints rather than holding them."""
    state = tmp_path / "state"
    state.mkdir()
    return state


@pytest.mark.parametrize("clip", [1.0, 0.0])
@pytest.mark.parametrize("placement", ["nvme", "nvme_moments"])
def test_state_on_disk_trains_bit_identically_to_host(tmp_path, placement, clip):
    opt = OPT.model_copy(update={"max_grad_norm": clip})
    runs = []
    for where in ("host", placement):
        e = engine(where, tmp_path, opt)
        e.load_random(seed=1)
        runs.append((train(e, range(STEPS)), final(e)))
        if where != "host":
            assert e.store.exp_avg.numel() == 0 and (e.store.master is None) == (placement == "nvme")
            assert e.store.state.io.name == "odirect-pool"
        e.close()
    (losses_a, weights_a), (losses_b, weights_b) = runs
    assert losses_a == losses_b
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    assert not os.listdir(tmp_path)  # the state files were unlinked at start: nothing is left behind


def test_buffered_fallback_trains_identically(tmp_path, monkeypatch):
    """Where the filesystem refuses O_DIRECT, `nvme_io: auto` runs buffered (direct I/O is refused by default)."""
    monkeypatch.setattr(HostStore, "probe_direct", staticmethod(lambda folder: "Invalid argument (errno 22)"))
    with pytest.raises(ConfigError, match=f"nvme_path {tmp_path} refuses direct I/O.*nvme_io: auto"):
        engine("nvme", tmp_path)
    runs = []
    for where, kw in (("host", {}), ("nvme", {"nvme_io": "auto"})):
        e = engine(where, tmp_path, **kw)
        e.load_random(seed=1)
        runs.append((train(e, range(3)), final(e)))
        if where == "nvme":
            assert e.store.state.io.name == "buffered-pool"
        e.close()
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in runs[0][1])


def test_checkpoint_from_the_state_files_resumes_exactly(tmp_path):
    """Saved by range from the files (the host format: a host-placement engine resumes it too), loaded back into
    the files of a fresh engine, training continues bit for bit."""
    ckpt = checkpoints(tmp_path)
    state = state_folder(tmp_path)
    a = engine("nvme", state)
    a.load_random(seed=1)
    losses = train(a, range(2))
    a.save_checkpoint(ckpt, 2, {})
    losses += train(a, range(2, 5))
    weights = final(a)
    a.close()
    for where in ("nvme", "nvme_moments", "host"):
        b = engine(where, state)
        assert b.restore_checkpoint(ckpt)["step"] == 2
        assert train(b, range(2, 5)) == losses[2:], where
        assert all(torch.equal(v, weights[k]) for k, v in final(b).items()), where
        b.close()


def test_host_checkpoint_resumes_on_nvme(tmp_path):
    ckpt = checkpoints(tmp_path)
    a = engine("host", tmp_path)
    a.load_random(seed=1)
    train(a, range(2))
    a.save_checkpoint(ckpt, 2, {})
    rest = train(a, range(2, 4))
    a.close()
    b = engine("nvme", tmp_path)
    b.restore_checkpoint(ckpt)
    assert train(b, range(2, 4)) == rest
    b.close()


class FailingIO(FileIO):
    """Writes fail with ENOSPC once `failing` is set, as on a disk that filled."""

    failing = False

    def write(self, path, buf, offset):
        if not self.failing:
            return super().write(path, buf, offset)
        return Pending([self._pool.submit(_no_space)], f"writing {self._labels[path]}")


def _no_space():
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_disk_that_fails_mid_run_stops_it_and_the_last_checkpoint_stays_valid(tmp_path, monkeypatch):
    ckpt = checkpoints(tmp_path)
    state = state_folder(tmp_path)
    good = engine("host", tmp_path)
    good.load_random(seed=1)
    expected = train(good, range(3))
    good.close()
    io = FailingIO(direct=True)
    monkeypatch.setattr(HostStore, "build_io", staticmethod(lambda direct: io))
    a = engine("nvme", state)
    a.load_random(seed=1)
    train(a, range(1))
    a.save_checkpoint(ckpt, 1, {})
    io.failing = True
    with pytest.raises(RuntimeError, match="optimizer thread failed") as failure:
        for s in range(1, 3):
            a.train_step(tiny_batches(seed=s))
        a.synchronize()
    cause = failure.value.__cause__
    assert isinstance(cause, StateIOError) and cause.errno == errno.ENOSPC
    assert "the optimizer state of" in str(cause) and "resume from the last checkpoint" in str(cause)
    a.close()
    monkeypatch.setattr(HostStore, "build_io", staticmethod(build_file_io))
    b = engine("nvme", state)
    b.restore_checkpoint(ckpt)
    assert train(b, range(1, 3)) == expected[1:]
    b.close()


def refusal(error: type[Exception], folder, **kw) -> str:
    """The one-line message an engine with its state under `folder` is refused with; nothing is left there."""
    before = os.listdir(folder) if os.path.isdir(folder) else None
    with pytest.raises(error) as refused:
        engine("nvme", folder, **kw)
    message = str(refused.value)
    assert "\n" not in message and f"engine.nvme_path {folder}" in message.replace("'", "")
    assert (os.listdir(folder) if os.path.isdir(folder) else None) == before
    return message


def test_bad_state_folders_are_refused_by_name_before_any_state(tmp_path, monkeypatch):
    """Each in one line naming the path, what the state needs there and the fix, before a buffer or file exists."""
    assert "is not an existing folder; the optimizer state needs 0.0 GiB there: create it (mkdir -p)" in refusal(
        ConfigError, tmp_path / "nope")
    monkeypatch.setattr(HostStore, "disk_free", staticmethod(lambda folder: 0))
    assert "has 0.0 GiB free, but the optimizer state needs 0.0 GiB: free space there" in refusal(
        InsufficientMemoryError, tmp_path)
    monkeypatch.undo()
    monkeypatch.setattr(StatePlacement, "file_chunk_numel", 1000)
    monkeypatch.setattr(HostStore, "probe_direct", staticmethod(lambda folder: "Invalid argument (errno 22)"))
    assert "refuses direct I/O (O_DIRECT: Invalid argument (errno 22)), which the optimizer state needs" in refusal(
        ConfigError, tmp_path)


def test_a_folder_this_user_cannot_write_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if os.access(locked, os.W_OK):  # root writes past permissions; a read-only mount stops it too
        locked = next((p for p in ("/proc/sys",) if os.path.isdir(p) and not os.access(p, os.W_OK)), None)
    if locked is None:
        pytest.skip("running as root with no read-only folder to try")
    assert "is not writable by this user; the optimizer state needs" in refusal(ConfigError, locked)


def test_a_folder_without_room_for_the_state_is_refused(tmp_path):
    with pytest.raises(InsufficientMemoryError, match=rf"nvme_path {tmp_path} has .* GiB free, but the optimizer "
                       r"state needs 1048576.0 GiB: free space"):
        check_state_path(str(tmp_path), 1 << 50, require_direct=True)
    assert not os.listdir(tmp_path)


class RecordingStore(HostStore):
    """Records the size of every piece of the master written by range."""

    pieces: list[int] = []

    def access_flat(self, name, lo, buf, write):
        if write and name == "master":
            self.pieces.append(buf.numel())
        super().access_flat(name, lo, buf, write)


def test_weights_load_into_the_files_a_chunk_at_a_time(tmp_path):
    """Loading never makes an fp32 copy of a whole parameter in RAM (the 3B embedding's is 1.2 GB, and its
    concatenation with the rest of the unit was as much again: the first H100 run's peak), and loads exactly."""
    spec = discover(tiny_config("llama"))
    cfg = EngineConfig(device="cpu", compute_dtype="fp32", state_placement="nvme", nvme_path=str(tmp_path))
    store = RecordingStore(spec, torch.float32, pin=False, placement=state_placement(cfg))
    embed = spec.unit("embed")
    weights = {p.hf_name: torch.randn(p.shape) for p in embed.params}
    store.load_named(embed, weights)
    assert max(store.pieces) <= 1000 < embed.numel and sum(store.pieces) == embed.numel
    loaded = store.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in weights.items())
    store.close()


def test_config_refuses_what_nvme_cannot_run():
    with pytest.raises(ValueError, match="state_placement: nvme needs engine.nvme_path"):
        EngineConfig(state_placement="nvme")
    with pytest.raises(ValueError, match="stream_master streams the fp32 master from RAM"):
        EngineConfig(state_placement="nvme", nvme_path="/tmp", stream_master=True)


def test_the_cluster_refuses_state_on_nvme_by_name(tmp_path):
    from mt_ray.cluster import DataParallelTrainer

    cfg = EngineConfig(device="cpu", state_placement="nvme", nvme_path=str(tmp_path))
    with pytest.raises(ConfigError, match="state_placement: nvme runs on a single engine for now"):
        DataParallelTrainer(tiny_config("llama"), cfg, OPT, num_workers=2, total_steps=1)
