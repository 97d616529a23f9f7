"""GRPO's update on Ray: two workers train on a rollout exactly as one engine trains on it (loss, grad norm, every
metric, the old policy's log-probs they keep, the weights after each step), for every loss_type, β 0 and above,
and one or two iterations per rollout. Groups of G straddle micro-batches and workers: no normaliser is per group
(the advantages are the driver's, computed before the split)."""

import time

import pytest
import torch

ray = pytest.importorskip("ray")

from mt_ray.cluster import DataParallelTrainer, shard_batch  # noqa: E402
from mt_ray.cluster.errors import ClusterError  # noqa: E402
from mt_ray.cluster.placement import RolloutPlace  # noqa: E402
from mt_ray.config.run import load_run_config  # noqa: E402
from mt_ray.engine import EngineConfig, OptimizerConfig, StreamingEngine  # noqa: E402
from mt_ray.engine.grpo import GrpoConfig  # noqa: E402
from mt_ray.models.discovery import discover  # noqa: E402
from mt_ray.training.grpo.old_logps import keep_old_logps  # noqa: E402
from mt_ray.training.grpo.remote import wait_replies  # noqa: E402
from mt_ray.training.grpo.rewards import RewardError  # noqa: E402
from mt_ray.training.grpo.rollout import Rollout, completion_batches, cut_completions  # noqa: E402
from mt_ray.training.grpo.steps import GrpoSteps  # noqa: E402
from mt_ray.training.model_source import load_model_and_tokenizer  # noqa: E402
from tests.tiny_models import VOCAB, tiny_config  # noqa: E402

OPT = OptimizerConfig(lr=1e-2, eps=1e-3, max_grad_norm=1.0, schedule="constant")
ENGINE = EngineConfig(device="cpu", compute_dtype="fp32", checkpoint_every=2, loss_chunk_tokens=5)
PROMPTS, G, MICRO, MAX_NEW, PAD = 4, 3, 4, 6, 1  # 12 completions in 3 micro-batches: 2 and 1 per worker
# Every loss_type, β 0 and > 0 each with one and with two iterations; a case costs a cluster start (about 15 s on
# CI's 2 cores), so not the whole product: the loss types differ only in their normalisers, each covered here.
CASES = {f"{loss}-beta{beta}-it{it}": GrpoConfig(loss_type=loss, beta=beta, num_iterations=it,
                                                 num_generations=G, max_completion_length=MAX_NEW)
         for loss, beta, it in [("grpo", 0.0, 2), ("bnpo", 0.04, 1), ("dr_grpo", 0.0, 1), ("dapo", 0.04, 2)]}


def rollout_batches(seed: int = 0) -> list[dict]:
    """A fixed rollout: prompts of different lengths, completions that end or are cut, advantages that differ
    within each group."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, VOCAB, (2 + i,), generator=g).tolist() for i in range(PROMPTS)]
    sampled = []
    for k in range(PROMPTS * G):
        n = MAX_NEW if k % 4 == 0 else 1 + k % MAX_NEW
        row = torch.randint(3, VOCAB, (n,), generator=g).tolist()
        sampled.append(row if n == MAX_NEW else row[:-1] + [2] + [PAD] * (MAX_NEW - n))
    completions, truncated = cut_completions(sampled, {2}, PAD)
    rollout = Rollout([p for p in prompts for _ in range(G)], completions, truncated)
    advantages = torch.randn(PROMPTS * G, generator=g)
    return completion_batches(rollout, advantages, False, MICRO, PAD)


def train(backend, grpo: GrpoConfig) -> tuple[list, list[torch.Tensor]]:
    """`num_iterations` steps on one rollout, as GrpoSteps runs them; each step's loss, norm and metrics, and the
    old log-probs the first step kept."""
    batches, steps = rollout_batches(), []
    for i in range(grpo.num_iterations):
        if i == 1:
            keep_old_logps(backend, batches)
        r = backend.train_step(batches)
        steps.append((float(r.loss), float(r.grad_norm), {k: float(v) for k, v in r.metrics.items()}))
    return steps, [b["old_logps"].cpu() for b in batches if "old_logps" in b]


def one_engine(grpo: GrpoConfig):
    engine = StreamingEngine(discover(tiny_config("llama")), ENGINE, OPT, grpo.num_iterations, stage="grpo", grpo=grpo)
    try:
        engine.load_random(seed=0)
        steps, old = train(engine, grpo)
        return steps, old, {k: v.clone() for k, v in engine.state_dict().items()}
    finally:
        engine.close()


def two_workers(grpo: GrpoConfig):
    trainer = DataParallelTrainer(tiny_config("llama"), ENGINE, OPT, num_workers=2, total_steps=grpo.num_iterations,
                                  weights=0, stage="grpo", grpo=grpo)
    try:
        steps, old = train(trainer, grpo)
        return steps, old, trainer.state_dict()
    finally:
        trainer.close()


@pytest.mark.parametrize("case", list(CASES))
def test_two_workers_train_a_grpo_rollout_as_one_engine(local_ray, case):
    """Each worker takes whole micro-batches and normalises by the whole step's counts (micro-batches, loss
    tokens), streams the reference (β > 0) from its node's arena, and keeps the old policy's log-probs of its
    micro-batches; the driver adds the metric sums and gathers the log-probs in micro-batch order."""
    grpo = CASES[case]
    ref_steps, ref_old, ref_state = one_engine(grpo)
    steps, old, state = two_workers(grpo)
    for (loss, norm, metrics), (ref_loss, ref_norm, ref_metrics) in zip(steps, ref_steps, strict=True):
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)
        assert norm == pytest.approx(ref_norm, rel=1e-5)
        assert metrics.keys() == ref_metrics.keys()
        assert metrics == pytest.approx(ref_metrics, rel=1e-5, abs=1e-6)
    assert len(old) == len(ref_old) == (3 if grpo.num_iterations > 1 else 0)
    for ours, theirs in zip(old, ref_old, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    if grpo.num_iterations > 1:  # the second step's ratio moved off 1: the old log-probs are the first step's
        assert steps[1][0] != pytest.approx(steps[0][0], rel=1e-4)
    if grpo.beta and grpo.num_iterations > 1:
        assert steps[1][2]["kl"] > 0  # the policy left the reference held in the arena
    for name, w in ref_state.items():
        torch.testing.assert_close(state[name], w, atol=1e-6, rtol=1e-5, msg=name)


def test_grpo_micro_batches_go_whole_to_the_workers_in_order():
    """Whole micro-batches, in order (a worker's kept log-probs follow its micro-batches), with their advantages
    and old log-probs whole."""
    batches = rollout_batches()
    for b in batches:
        b["old_logps"] = torch.randn(int((b["labels"][:, 1:] != -100).sum()))
    pieces = shard_batch(batches, 2, whole=True)
    assert [len(p) for p in pieces] == [2, 1]
    for ours, theirs in zip(pieces[0] + pieces[1], batches, strict=True):
        assert ours.keys() == theirs.keys()
        for key in ours:
            assert torch.equal(ours[key], theirs[key]), key


def fails_on_a_minus(prompts, completions, **_):
    """A user reward that cannot score the demo's subtraction prompts."""
    if any("-" in p for p in prompts):
        raise ValueError("no subtraction")
    return [0.0] * len(completions)


def test_a_reward_that_raises_on_the_cluster_stops_the_step_naming_it(local_ray):
    """The rollout replicas sample, the driver scores: a raising reward is reported as on one engine (the function,
    the completion and its prompt), before any step is handed to the workers (one here: the path is the same)."""
    cfg = load_run_config("jobs/configs/grpo_demo.yaml", [
        "engine.device=cpu", "grpo.max_completion_length=4", f"grpo.rewards=[{{name: '{__name__}:fails_on_a_minus'}}]"])
    spec, tokenizer = load_model_and_tokenizer(cfg)
    trainer = DataParallelTrainer(spec, cfg.engine, cfg.optimizer, 1, cfg.training.steps, weights=cfg.training.seed,
                                  stage="grpo", grpo=cfg.grpo)
    steps = GrpoSteps(cfg, trainer, spec, tokenizer)
    try:
        with pytest.raises(RewardError, match=r"^reward 'fails_on_a_minus' raised on completion \d+ \(prompt .*-.*\): "
                                              "ValueError: no subtraction"):
            next(steps)
        assert trainer.step_idx == 0
    finally:
        steps.close()
        trainer.close()


def test_a_rollout_replica_sits_beside_each_worker_unless_given_gpus_of_its_own():
    """VERL's colocated layout by default: a replica beside each worker, on its GPU, within the worker's reservation
    (nothing more is asked of the cluster); `cluster.rollout_gpus` gives one replica GPUs of its own."""
    shared = RolloutPlace.resolve("grpo", None)
    assert (shared.gpus, shared.own_gpus, shared.beside(3)) == (0.0, 0.0, [0, 1, 2])
    own = RolloutPlace.resolve("grpo", 1.0)
    assert (own.gpus, own.own_gpus, own.beside(3)) == (1.0, 1.0, [0])
    assert RolloutPlace.resolve("dpo", None) is None


def test_a_hung_or_lost_rollout_replica_is_named_with_what_it_was_asked(local_ray):
    """Every wait for the replicas is bounded (`cluster.step_timeout_s` and a grace for the reply) and names the
    replica that did not answer and what it was asked; one that answered is not blamed."""

    class Replica:  # a stand-in that answers after `seconds` (local: Ray ships it by value)
        def answer(self, seconds: float) -> float:
            time.sleep(seconds)
            return seconds

    replica = ray.remote(Replica).options(num_cpus=0).remote()
    ray.get(replica.__ray_ready__.remote())  # started: the bounds below are the calls', not a worker process's start
    names = ["the rollout replica beside worker 0", "the rollout replica beside worker 1"]
    assert wait_replies([replica.answer.remote(0), replica.answer.remote(0)], names, "x", 30.0, 0.0) == [0, 0]
    with pytest.raises(ClusterError, match=r"^the rollout replica beside worker 1 did not generate its share of the "
                                           r"prompts within 1 s \(cluster.step_timeout_s=1 s"):
        wait_replies([replica.answer.remote(0), replica.answer.remote(60)], names, "generate its share of the prompts",
                     1.0, 0.0)
    ray.kill(replica, no_restart=True)
    with pytest.raises(ClusterError, match=r"^the rollout replica beside worker 0 was lost while asked to refresh"):
        wait_replies([replica.answer.remote(0)], names[:1], "refresh its copy to step 3", 30.0, 0.0)
