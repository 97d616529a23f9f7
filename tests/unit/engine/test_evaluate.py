"""The engine's forward-only evaluation scores rows exactly as transformers does, and leaves training untouched."""

import pytest
import torch

from mt_ray.engine import EngineConfig, OptimizerConfig, StreamingEngine
from mt_ray.models.discovery import discover
from tests.tiny_models import reference_model, reference_train, tiny_batches, tiny_config

OPT = OptimizerConfig(lr=2e-3, max_grad_norm=1.0, warmup_steps=1, schedule="cosine")


def engine_for(cfg, steps: int = 3, **engine_kw) -> StreamingEngine:
    engine_cfg = EngineConfig(**{"device": "cpu", "compute_dtype": "fp32", "checkpoint_every": 2, **engine_kw})
    return StreamingEngine(discover(cfg), engine_cfg, OPT, total_steps=steps)


def reference_eval_loss(model: torch.nn.Module, mbs: list[dict]) -> float:
    """transformers' mean token loss over all of `mbs` (each micro-batch's mean, weighted by its tokens)."""
    model.eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for mb in mbs:
            n = int((mb["labels"][:, 1:] != -100).sum())
            total += model(**mb, use_cache=False).loss.item() * n
            tokens += n
    return total / tokens


def eval_loss(engine: StreamingEngine, mbs: list[dict]) -> float:
    result = engine.evaluate(mbs)
    assert result.num_loss_tokens == sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in mbs)
    return result.loss_sum.item() / result.num_loss_tokens


def packed(mbs: list[dict]) -> list[dict]:
    for mb in mbs:  # two documents share each row: positions restart mid-row
        mb["position_ids"][:, 7:] -= 7
    return mbs


@pytest.mark.parametrize("family", ["llama", "qwen2-tied", "gemma2", "qwen3_moe"])
@pytest.mark.parametrize("engine_kw", [{}, {"schedule": "resident"}, {"loss_chunk_tokens": 5, "checkpoint_every": 1}])
def test_eval_loss_equals_transformers_loss_on_the_same_rows(family, engine_kw):
    cfg = tiny_config(family, attention_dropout=0.3)  # eval mode: dropout must be off, as after model.eval()
    ref = reference_model(cfg)
    mbs = packed(tiny_batches(n_micro=3, seed=5))
    engine = engine_for(cfg, **engine_kw)
    try:
        engine.load_state_dict(ref.state_dict())
        assert eval_loss(engine, mbs) == pytest.approx(reference_eval_loss(ref, mbs), rel=1e-5)
    finally:
        engine.close()


def test_eval_between_steps_changes_nothing_and_scores_the_updated_weights():
    cfg = tiny_config("llama")
    steps = [tiny_batches(seed=s) for s in range(3)]
    held_out = tiny_batches(n_micro=2, seed=9)

    def train(evaluate: bool) -> tuple[list[float], list[float], dict]:
        engine = engine_for(cfg)
        engine.load_state_dict(reference_model(cfg).state_dict())
        losses, evals = [], []
        try:
            for mbs in steps:
                losses.append(engine.train_step(mbs).loss.item())
                if evaluate:
                    evals.append(eval_loss(engine, held_out))
            return losses, evals, {k: v.clone() for k, v in engine.state_dict().items()}
        finally:
            engine.close()

    plain, evaluated = train(evaluate=False), train(evaluate=True)
    assert evaluated[0] == plain[0]  # bit-identical training losses ...
    assert all(torch.equal(evaluated[2][k], w) for k, w in plain[2].items())  # ... and weights
    ref = reference_model(cfg)
    reference_train(ref, steps, OPT)
    assert evaluated[1][-1] == pytest.approx(reference_eval_loss(ref, held_out), rel=1e-5)
    assert len(set(evaluated[1])) == 3  # each eval scored that step's weights


class RecordingSink:
    """A GradSink that records every call: an evaluation must make none."""

    def __init__(self, unit_order: list[str]):
        self.unit_order = unit_order
        self.calls: list[str] = []

    def submit(self, unit, grad, landed, lr, skip=()) -> None:
        self.calls.append(f"submit {unit}")

    def end_step(self, norm_sq, ready, lr) -> None:
        self.calls.append("end_step")

    def wait_updated(self, unit: str, version: int) -> None:
        pass

    def close(self) -> None:
        pass


class StoreWeights:
    """A WeightSource reading another engine's host store (as a cluster worker reads the coordinator's)."""

    def __init__(self, store):
        self.store = store

    def wait_updated(self, unit: str, version: int) -> None:
        pass

    def is_updated(self, unit: str, version: int) -> bool:
        return True

    def streamed_of(self, unit: str) -> torch.Tensor:
        return self.store.streamed_of(unit)

    def release(self, unit: str, copied) -> None:
        """Nothing to let go: the store outlives the step."""


def test_eval_sends_no_gradient_and_works_with_weights_kept_elsewhere():
    cfg = tiny_config("qwen2-tied")
    ref = reference_model(cfg)
    owner = engine_for(cfg)
    spec = discover(cfg)
    sink = RecordingSink([u.name for u in spec.units])
    worker = StreamingEngine(spec, owner.cfg, OPT, 3, grad_sink=sink, weight_source=StoreWeights(owner.store))
    try:
        owner.load_state_dict(ref.state_dict())
        mbs = tiny_batches(seed=3)
        assert eval_loss(worker, mbs) == pytest.approx(reference_eval_loss(ref, mbs), rel=1e-5)
        assert sink.calls == [] and worker.step_idx == 0
    finally:
        worker.close()
        owner.close()
