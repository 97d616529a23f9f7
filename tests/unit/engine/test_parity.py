"""The streamed engine must train exactly like ordinary in-memory PyTorch."""

import pytest
import torch

from mt_ray.engine import EngineConfig, OptimizerConfig, StreamingEngine
from mt_ray.models.discovery import discover
from tests.tiny_models import (
    FAMILIES,
    assert_freed_once_closed,
    reference_model,
    reference_train,
    tiny_batches,
    tiny_config,
)

STEPS = 3
OPT = OptimizerConfig(lr=2e-3, weight_decay=0.1, max_grad_norm=1.0, warmup_steps=1, schedule="cosine")


def run_both(cfg, opt_cfg=OPT, engine_kw=None, steps=STEPS, packed=False, n_micro=2):
    ref = reference_model(cfg)
    mbs = tiny_batches(n_micro=n_micro)
    if packed:  # restart positions mid-row: two documents share a row
        for mb in mbs:
            mb["position_ids"][:, 7:] -= 7
    batches = [mbs] * steps  # the same data every step, so the loss must fall
    losses, state = train_engine(cfg, ref.state_dict(), batches, opt_cfg, engine_kw)
    ref_losses = reference_train(ref, batches, opt_cfg)
    return losses, ref_losses, state, ref.state_dict()


def train_engine(cfg, weights, batches, opt_cfg=OPT, engine_kw=None):
    """The engine's losses and final master weights after one step per entry of `batches`."""
    engine_cfg = EngineConfig(**{"device": "cpu", "compute_dtype": "fp32", "checkpoint_every": 2, **(engine_kw or {})})
    engine = StreamingEngine(discover(cfg), engine_cfg, opt_cfg, total_steps=len(batches))
    try:
        engine.load_state_dict(weights)
        losses = [engine.train_step(mbs).loss.item() for mbs in batches]
        return losses, {k: v.clone() for k, v in engine.state_dict().items()}
    finally:
        engine.close()


def assert_same(losses, ref_losses, state, ref_state, atol=2e-5):
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert losses[-1] < losses[0]  # it actually trained
    for name, ref_w in ref_state.items():
        if name in state:
            torch.testing.assert_close(state[name], ref_w, atol=atol, rtol=1e-4, msg=name)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_engine_matches_pytorch(family):
    losses, ref_losses, state, ref_state = run_both(tiny_config(family))
    assert_same(losses, ref_losses, state, ref_state)


def test_tied_embeddings_are_one_parameter():
    cfg = tiny_config("qwen2-tied")
    losses, ref_losses, state, ref_state = run_both(cfg)
    assert "lm_head.weight" not in state
    assert_same(losses, ref_losses, state, ref_state)


def test_no_clipping_updates_each_layer_as_its_gradient_lands():
    opt = OPT.model_copy(update={"max_grad_norm": 0.0})
    assert_same(*run_both(tiny_config("llama"), opt_cfg=opt, engine_kw={"grad_slabs": 1}))


@pytest.mark.parametrize("engine_kw", [{"checkpoint_every": 1}, {"checkpoint_every": 5}, {"stream_master": True},
                                       {"prefetch_units": 1}, {"loss_chunk_tokens": 5}, {"schedule": "resident"}])
def test_schedule_options_do_not_change_results(engine_kw):
    assert_same(*run_both(tiny_config("llama"), engine_kw=engine_kw))


@pytest.mark.parametrize("family", ["qwen2-tied", "gemma3_text", "qwen3_moe"])
@pytest.mark.parametrize("clip", [1.0, 0.0])
def test_resident_schedule_matches_pytorch(family, clip):
    """No recompute, every micro-batch forward and backward in turn, gradients summed on the device."""
    opt = OPT.model_copy(update={"max_grad_norm": clip})
    assert_same(*run_both(tiny_config(family), opt_cfg=opt, engine_kw={"schedule": "resident", "grad_slabs": 1}))


def test_resident_schedule_is_bit_identical_to_streaming():
    """Same arithmetic in the same order (untied, fp32 on CPU): only where it is kept differs."""
    streamed = run_both(tiny_config("llama"))
    resident = run_both(tiny_config("llama"), engine_kw={"schedule": "resident"})
    assert resident[0] == streamed[0]
    for name, w in streamed[2].items():
        assert torch.equal(resident[2][name], w), name


@pytest.mark.parametrize(("family", "engine_kw", "n_micro"), [
    ("llama", {}, 2),
    ("llama", {"checkpoint_every": 1, "prefetch_units": 1, "loss_chunk_tokens": 5}, 3),
    ("llama", {"checkpoint_every": 5}, 2),  # one block: only the embedding's checkpoint
    ("qwen2-tied", {}, 1),  # one micro-batch: forward gets take the newest put without a round trip
    ("gemma3_text", {"checkpoint_every": 3}, 4),  # a ragged last block
])
def test_host_checkpoints_are_bit_identical_to_device(family, engine_kw, n_micro):
    """Parking hidden states in host memory moves them and nothing else: same losses, same weights."""
    cfg = tiny_config(family)
    weights = reference_model(cfg).state_dict()
    # Three steps of different lengths: the slab is allocated once and reused for a shorter step.
    batches = [tiny_batches(n_micro=n_micro, seq=12), tiny_batches(n_micro=n_micro, seq=9, seed=1),
               tiny_batches(n_micro=n_micro, seq=12, seed=2)]
    device = train_engine(cfg, weights, batches, engine_kw=engine_kw)
    host = train_engine(cfg, weights, batches, engine_kw={**engine_kw, "checkpoint_placement": "host"})
    assert host[0] == device[0]
    for name, w in device[1].items():
        assert torch.equal(host[1][name], w), name


def test_host_checkpoints_match_pytorch():
    assert_same(*run_both(tiny_config("qwen2"), engine_kw={"checkpoint_placement": "host"}, packed=True))


def test_packed_rows_match_pytorch():
    assert_same(*run_both(tiny_config("llama"), packed=True))


def test_bf16_compute_tracks_fp32_reference():
    cfg = tiny_config("llama")
    ref = reference_model(cfg)
    batches = [tiny_batches()] * STEPS
    engine = StreamingEngine(discover(cfg), EngineConfig(device="cpu", compute_dtype="bf16"), OPT, STEPS)
    try:
        engine.load_state_dict(ref.state_dict())
        assert engine.store.copy.dtype == torch.bfloat16
        losses = [engine.train_step(mbs).loss.item() for mbs in batches]
    finally:
        engine.close()
    assert losses == pytest.approx(reference_train(ref, batches, OPT), rel=2e-2)


def test_step_without_loss_tokens_is_refused():
    cfg = tiny_config("llama")
    engine = StreamingEngine(discover(cfg), EngineConfig(device="cpu", compute_dtype="fp32"), OPT, 1)
    try:
        engine.load_random()
        mb = tiny_batches(n_micro=1)[0]
        mb["labels"][:] = -100
        with pytest.raises(ValueError, match="no token that carries loss"):
            engine.train_step([mb])
    finally:
        engine.close()


@pytest.mark.parametrize("schedule", ["stream", "resident"])
def test_a_closed_engine_is_freed_with_its_last_reference(schedule):
    """A notebook or process that builds a second engine has the first one's memory back at once."""
    def trained_engine():
        engine = StreamingEngine(discover(tiny_config("llama")), EngineConfig(device="cpu", schedule=schedule), OPT, 1)
        engine.load_random()
        engine.train_step(tiny_batches())
        return engine

    assert_freed_once_closed(trained_engine)
