"""Preference stages on Ray: two workers train DPO, a reference-free loss and KTO exactly as one engine trains on
the whole global batch (loss, TRL's metrics, evaluation, updated weights), and no split cuts a pair."""

import pytest
import torch

pytest.importorskip("ray")

from mt_ray.cluster import DataParallelTrainer, shard_batch  # noqa: E402
from mt_ray.cluster.arena import ArenaLayout  # noqa: E402
from mt_ray.cluster.errors import ClusterError  # noqa: E402
from mt_ray.cluster.partition import ShardPlan  # noqa: E402
from mt_ray.data.packing import collate  # noqa: E402
from mt_ray.data.schema import (  # noqa: E402
    ROLE_CHOSEN,
    ROLE_DESIRABLE,
    ROLE_KL,
    ROLE_REJECTED,
    ROLE_UNDESIRABLE,
)
from mt_ray.data.schema import TokenizedExample as Seq  # noqa: E402
from mt_ray.engine import EngineConfig, OptimizerConfig, StreamingEngine  # noqa: E402
from mt_ray.engine.batch import preference_counts  # noqa: E402
from mt_ray.engine.preference import Objective, PreferenceConfig  # noqa: E402
from mt_ray.models.discovery import discover  # noqa: E402
from tests.tiny_models import VOCAB, preference_sequence, tiny_config  # noqa: E402

STEPS = 2  # step 0: the policy is the reference (rewards 0); step 1: it has moved away from it
OPT = OptimizerConfig(lr=1e-2, eps=1e-3, max_grad_norm=1.0, schedule="constant")
ENGINE = EngineConfig(device="cpu", compute_dtype="fp32", checkpoint_every=2, loss_chunk_tokens=7)
CASES = {  # stage, pref: the DPO loss with its SFT term, reference-free losses (ORPO's NLL over the prompts too), KTO
    "dpo-sigmoid": ("dpo", PreferenceConfig(beta=0.5, ftx=0.3)),
    "simpo": ("dpo", PreferenceConfig(loss="simpo", beta=2.0, simpo_gamma=0.3)),
    "orpo": ("dpo", PreferenceConfig(loss="orpo", beta=0.5, ftx=0.2)),
    "kto": ("kto", PreferenceConfig(beta=0.5, kto_rejected_weight=1.5)),
}


def seq(g: torch.Generator, prompt: list[int], k: int, role: int) -> Seq:
    return preference_sequence(prompt, torch.randint(3, VOCAB, (k,), generator=g).tolist(), role)


def group(g: torch.Generator, stage: str, i: int) -> list[Seq]:
    """One pair (chosen, rejected), or one KTO example and its KL twin (its prompt, another response)."""
    prompt = torch.randint(3, VOCAB, (3 + i % 3,), generator=g).tolist()
    if stage == "kto":
        return [seq(g, prompt, 2 + i % 4, ROLE_UNDESIRABLE if i % 3 == 1 else ROLE_DESIRABLE),
                seq(g, prompt, 3 + i % 2, ROLE_KL)]
    return [seq(g, prompt, 2 + i % 4, ROLE_CHOSEN), seq(g, prompt, 5 - i % 3, ROLE_REJECTED)]


def global_batch(stage: str, seed: int) -> list[dict]:
    """3 micro-batches of 2 rows, the first row packing two groups: 2 workers take rows of each (dpo; 3 is not a
    multiple of 2) or whole micro-batches, 2 and 1 (kto)."""
    g = torch.Generator().manual_seed(seed)
    batch = []
    for m in range(3):
        groups = [group(g, stage, 3 * m + j) for j in range(3)]
        batch.append(collate([groups[0] + groups[1], groups[2]], None, 0))
    return batch


def metrics_of(stage, pref, result) -> dict[str, float]:
    return {k: float(v) for k, v in Objective(stage, pref).metrics(result.pref_sums, result.pref_counts).items()}


def one_engine(stage, pref):
    engine = StreamingEngine(discover(tiny_config("llama")), ENGINE, OPT, STEPS, stage=stage, pref=pref)
    try:
        engine.load_random(seed=0)
        steps = [engine.train_step(global_batch(stage, s)) for s in range(STEPS)]
        evaluated = metrics_of(stage, pref, engine.evaluate(global_batch(stage, 9)))
        return steps, evaluated, {k: v.clone() for k, v in engine.state_dict().items()}
    finally:
        engine.close()


def two_workers(stage, pref):
    trainer = DataParallelTrainer(tiny_config("llama"), ENGINE, OPT, num_workers=2, total_steps=STEPS, weights=0,
                                  stage=stage, pref=pref)
    try:
        steps = [trainer.train_step(global_batch(stage, s)) for s in range(STEPS)]
        evaluated = metrics_of(stage, pref, trainer.evaluate(global_batch(stage, 9)))
        return steps, evaluated, trainer.state_dict()
    finally:
        trainer.close()


@pytest.mark.parametrize("case", list(CASES))
def test_two_workers_train_a_preference_stage_as_one_engine(local_ray, case):
    """Each worker normalises by the global batch's pairs (KTO: examples; the SFT term: chosen tokens) and streams
    the reference from its node's arena; the driver adds the workers' metric sums. Loss, every metric, the
    evaluation's metrics and the updated weights equal one engine's on the whole batch."""
    stage, pref = CASES[case]
    ref_steps, ref_eval, ref_state = one_engine(stage, pref)
    steps, evaluated, state = two_workers(stage, pref)
    for ours, theirs in zip(steps, ref_steps, strict=True):
        assert float(ours.loss) == pytest.approx(float(theirs.loss), rel=1e-5)
        assert float(ours.grad_norm) == pytest.approx(float(theirs.grad_norm), rel=1e-5)
        assert ours.metrics.keys() == theirs.metrics.keys()
        for name, value in theirs.metrics.items():
            assert float(ours.metrics[name]) == pytest.approx(float(value), rel=1e-5, abs=1e-6), name
    assert float(steps[-1].metrics["rewards/chosen"]) != 0  # the policy moved away from the reference
    assert evaluated == pytest.approx(ref_eval, rel=1e-5, abs=1e-6)
    for name, w in ref_state.items():
        torch.testing.assert_close(state[name], w, atol=1e-6, rtol=1e-5, msg=name)


def with_reference(backend, batch: list[dict]) -> list[dict]:
    """`pref.reference: precompute`: each micro-batch with its sequences' log-prob sums under the current weights."""
    sums = backend.sequence_logps(batch)
    return [{**mb, "ref_logps": s.reshape(mb["seq_role"].shape)} for mb, s in zip(batch, sums, strict=True)]


def test_a_precomputed_reference_trains_on_two_workers_as_on_one_engine(local_ray):
    """The workers compute the starting weights' sequence sums (whole micro-batches each) as one engine does, hold
    no reference, and train on the sums the batches carry as one engine does."""
    pref = PreferenceConfig(beta=0.5, reference="precompute")
    engine = StreamingEngine(discover(tiny_config("llama")), ENGINE, OPT, STEPS, stage="dpo", pref=pref)
    try:
        engine.load_random(seed=0)
        batches = [with_reference(engine, global_batch("dpo", s)) for s in range(STEPS)]
        ref = [float(engine.train_step(b).metrics["rewards/margins"]) for b in batches]
    finally:
        engine.close()
    trainer = DataParallelTrainer(tiny_config("llama"), ENGINE, OPT, num_workers=2, total_steps=STEPS, weights=0,
                                  stage="dpo", pref=pref)
    try:
        assert trainer.sizing.reference_bytes == 0
        ours = [with_reference(trainer, global_batch("dpo", s)) for s in range(STEPS)]
        for a, b in zip(ours, batches, strict=True):
            torch.testing.assert_close([mb["ref_logps"] for mb in a], [mb["ref_logps"] for mb in b])
        got = [float(trainer.train_step(b).metrics["rewards/margins"]) for b in batches]
    finally:
        trainer.close()
    assert got == pytest.approx(ref, rel=1e-4, abs=1e-6) and ref[-1] != 0


def roles_of(batch: list[dict]) -> list[list[int]]:
    return [row.tolist() for mb in batch for row in mb["seq_role"]]


@pytest.mark.parametrize("workers", [2, 3], ids=["rows", "whole"])
def test_a_pair_never_splits_across_workers(workers):
    """A row holds whole pairs (chosen beside its rejected) and a split cuts between rows or micro-batches only:
    every piece's rows are the batch's rows, each with as many chosen as rejected, and the counts add up."""
    batch = global_batch("dpo", 0)
    pieces = shard_batch(batch, workers)
    assert sorted(r for p in pieces for r in roles_of(p)) == sorted(roles_of(batch))
    for piece in pieces:
        for roles in roles_of(piece):
            assert roles.count(ROLE_CHOSEN) == roles.count(ROLE_REJECTED) > 0
    assert sum(preference_counts(p)["pairs"] for p in pieces) == preference_counts(batch)["pairs"] == 9


def test_kto_micro_batches_go_whole_to_the_workers():
    """KTO's KL estimate is over a whole micro-batch's twins: whole micro-batches, as evenly as they go."""
    batch = global_batch("kto", 0)
    pieces = shard_batch(batch, 2, whole=True)
    assert [len(p) for p in pieces] == [2, 1]
    assert [torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(pieces[0] + pieces[1], batch, strict=True)]
    with pytest.raises(ClusterError, match="3 micro-batches cannot feed 4 workers whole .* training.grad_accum_steps"):
        shard_batch(batch, 4, whole=True)


def test_the_reference_is_held_once_per_node():
    """The arena holds the reference in the compute dtype once, whatever the number of the node's workers."""
    spec = discover(tiny_config("llama"))
    plan = ShardPlan.build(spec, 1)

    def layout(workers: int, reference: bool, dtype=torch.bfloat16) -> ArenaLayout:
        return ArenaLayout.build(spec, plan, 0, dtype, torch.float32, workers, reference=reference)

    for workers in (1, 2, 8):
        grown = layout(workers, True).nbytes - layout(workers, False).nbytes
        assert grown == layout(workers, True).reference_bytes == layout(1, True).reference_bytes
    assert spec.num_params * 2 <= layout(2, True).reference_bytes < spec.num_params * 2 + 4096 * len(spec.units)
    assert layout(2, True, torch.float32).reference_bytes >= spec.num_params * 4  # an fp32 run's reference: fp32
