"""Kept activations (`engine.keep_activations`): the backward takes block graphs from the forward instead of
recomputing them. The same operations run on the same inputs and weights, so on CPU losses and weights are
bit-identical to full recompute."""

import pytest
import torch

from mt_ray.engine import EngineConfig
from mt_ray.engine.calculator import recommend
from mt_ray.engine.kept_blocks import KeptBlocks, kept_within, resolve_kept
from mt_ray.engine.sizing import device_bytes
from mt_ray.engine.step_time import predicted_step_seconds
from mt_ray.engine.transfer import StreamSet
from mt_ray.errors import InsufficientMemoryError
from mt_ray.models.discovery import discover
from tests.tiny_models import reference_model, tiny_batches, tiny_config
from tests.unit.engine.test_parity import OPT, train_engine

NO_CLIP = OPT.model_copy(update={"max_grad_norm": 0.0})


def _packed(batches):
    for mb in batches:  # two documents share a row
        mb["position_ids"][:, 7:] -= 7
    return batches


@pytest.mark.parametrize(("family", "engine_kw", "n_micro", "keep", "packed", "opt"), [
    ("llama", {}, 2, 1, False, OPT),  # part of the last block
    ("llama", {}, 3, 4, True, NO_CLIP),  # the last block whole, part of the one before
    ("llama", {"checkpoint_every": 1, "prefetch_units": 1}, 3, 100, False, OPT),  # every graph kept
    ("llama", {"checkpoint_every": 2, "checkpoint_placement": "host"}, 2, 3, True, OPT),
    ("qwen3_moe", {"checkpoint_every": 2}, 3, 4, False, OPT),  # router loss gradients through kept graphs
    ("qwen3_moe", {"checkpoint_every": 3}, 2, 2, True, NO_CLIP),
    ("gemma3_text", {"checkpoint_every": 3}, 2, 3, True, OPT),  # a ragged last block
])
def test_kept_graphs_are_bit_identical_to_recompute(family, engine_kw, n_micro, keep, packed, opt):
    cfg = tiny_config(family, **({"output_router_logits": True} if family == "qwen3_moe" else {}))
    weights = reference_model(cfg).state_dict()
    batches = [tiny_batches(n_micro=n_micro, seed=s) for s in range(3)]
    batches = [_packed(b) for b in batches] if packed else batches
    recompute = train_engine(cfg, weights, batches, opt, {**engine_kw, "keep_activations": 0})
    kept = train_engine(cfg, weights, batches, opt, {**engine_kw, "keep_activations": keep})
    assert kept[0] == recompute[0]
    for name, w in recompute[1].items():
        assert torch.equal(kept[1][name], w), name


def test_keep_order_is_last_block_first_then_micro_batch_zero():
    kept = KeptBlocks(discover(tiny_config("llama")), StreamSet(torch.device("cpu")))
    kept.keep(n_blocks=3, n_micro=2, kept=3)
    assert [(b, j) for b in range(3) for j in range(2) if kept.keeps(b, j)] == [(1, 0), (2, 0), (2, 1)]
    assert kept.whole(2) and not kept.whole(1)


def test_auto_keeps_none_on_cpu_and_a_number_as_given():
    spec = discover(tiny_config("llama"))
    cpu = torch.device("cpu")
    assert resolve_kept(spec, EngineConfig(device="cpu"), cpu, 2, 12, 2) == 0
    assert resolve_kept(spec, EngineConfig(device="cpu", keep_activations=5), cpu, 2, 12, 2) == 5
    assert resolve_kept(spec, EngineConfig(device="cpu", schedule="resident", keep_activations=5), cpu, 2, 12, 2) == 0


def test_more_memory_keeps_more_blocks_and_predicts_fewer_seconds():
    spec = _qwen7b_shape()
    cfg = EngineConfig(device="cpu", compute_dtype="bf16")
    recs = [recommend(spec, 1024, 128, gb, 120.0, cfg=cfg) for gb in (40, 60, 80)]
    kept = [r["keep_activations"] for r in recs]
    assert all(r["fits"] for r in recs)
    assert kept[0] < kept[1] < kept[2], kept
    assert recs[0]["predicted_step_s"] > recs[1]["predicted_step_s"] > recs[2]["predicted_step_s"]
    chosen = recs[2]
    # The device model counts the kept graphs within the budget, and its time model their saved recompute.
    c = cfg.model_copy(update={k: chosen[k] for k in ("schedule", "checkpoint_every", "checkpoint_placement",
                                                       "loss_chunk_tokens", "mlp_chunk_tokens", "stream_master",
                                                       "grad_dtype", "keep_activations")})
    parts = device_bytes(spec, c, chosen["micro_batch_size"], 1024, 128)
    assert parts["kept_activations"] > 0 and parts["total"] <= 80 * 2**30 * 0.9
    none = c.model_copy(update={"keep_activations": 0})
    assert (predicted_step_seconds(spec, c, 1024, 128, micro_batch=chosen["micro_batch_size"])
            < predicted_step_seconds(spec, none, 1024, 128))


def test_a_negative_keep_is_refused():
    with pytest.raises(ValueError, match="keep_activations"):
        EngineConfig(keep_activations=-1)




@pytest.mark.parametrize(("keep", "runs", "uploads"), [(0, 20, 13), (2, 18, 12), (100, 10, 8)])
def test_kept_graphs_are_not_recomputed_nor_uploaded_again(keep, runs, uploads):
    """5 layers, K=2, 2 micro-batches: 10 layer runs forward, and the backward recomputes what is not kept;
    a block kept for every micro-batch is not uploaded for the backward."""
    from mt_ray.engine import StreamingEngine

    engine = StreamingEngine(discover(tiny_config("llama")), EngineConfig(
        device="cpu", compute_dtype="fp32", checkpoint_every=2, keep_activations=keep), OPT, total_steps=1)
    try:
        engine.load_random()
        calls, layer, plan = [], engine._layer, engine._upload_plan
        engine._layer = lambda *a: calls.append(1) or layer(*a)
        engine._upload_plan = lambda mbs: calls.append(len(p := plan(mbs))) or p
        engine.train_step(tiny_batches(n_micro=2))
        assert (len(calls) - 1, calls[0]) == (runs, uploads)
    finally:
        engine.close()


def _qwen7b_shape():
    return discover(tiny_config("llama", hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                                num_key_value_heads=4, num_hidden_layers=28, vocab_size=152064))


def test_more_than_the_gpu_holds_is_refused_naming_the_largest():
    spec = _qwen7b_shape()
    cfg = EngineConfig(device="cpu", compute_dtype="bf16")
    largest = kept_within(spec, cfg, 80, 16, 1024, 8)  # auto
    assert largest > 0
    exact = cfg.model_copy(update={"keep_activations": largest})
    assert kept_within(spec, exact, 80, 16, 1024, 8) == largest
    too_many = cfg.model_copy(update={"keep_activations": largest + 1})
    with pytest.raises(InsufficientMemoryError, match=f"the largest that fits is {largest}"):
        kept_within(spec, too_many, 80, 16, 1024, 8)


def test_running_out_of_memory_under_auto_is_the_calculators_miss():
    kept = KeptBlocks(discover(tiny_config("llama")), StreamSet(torch.device("cpu")))
    kept.keep(n_blocks=3, n_micro=2, kept=4)
    auto, given = EngineConfig(device="cpu"), EngineConfig(device="cpu", keep_activations=4)
    with pytest.raises(InsufficientMemoryError, match="calculator's miss"), kept.misses_reported(auto, 2, 2, 12):
        raise torch.OutOfMemoryError("CUDA out of memory")
    # A number given, not the calculator's choice: the error as it came.
    with pytest.raises(torch.OutOfMemoryError), kept.misses_reported(given, 2, 2, 12):
        raise torch.OutOfMemoryError("CUDA out of memory")
