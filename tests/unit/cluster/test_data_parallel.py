"""Data-parallel training on Ray trains exactly like one engine on the whole batch, and survives a lost worker."""

import math
import os
import signal
import time

import pytest
import torch

pytest.importorskip("ray")

from mt_ray.cluster import ClusterConfig, ClusterError, DataParallelTrainer, count_loss_tokens, shard_batch  # noqa: E402
from mt_ray.cluster.recovery import RecoveryAction  # noqa: E402
from mt_ray.engine import EngineConfig, OptimizerConfig, StreamingEngine  # noqa: E402
from mt_ray.errors import ConfigError  # noqa: E402
from mt_ray.models.discovery import discover  # noqa: E402
from tests.tiny_models import checkpoint_config, tiny_batches, tiny_config  # noqa: E402

STEPS = 4
OPT = OptimizerConfig(lr=2e-3, weight_decay=0.1, max_grad_norm=1.0, warmup_steps=1, schedule="cosine")
ENGINE = EngineConfig(device="cpu", compute_dtype="fp32", checkpoint_every=2)


def global_batches(steps=STEPS):
    """Each step: 3 micro-batches of 2 rows, so 2 workers split rows (3 is not a multiple of 2).

    Step 2 has long rows so its backward lasts long enough for a test to kill a worker inside it.
    """
    batches = [tiny_batches(n_micro=3, seed=s, seq=384 if s == 2 else 12) for s in range(steps)]
    for mb in batches[1]:
        mb["labels"][1, :] = -100  # step 1: worker 1's rows carry no loss at all
    return batches


def single_engine(opt=OPT, steps=STEPS):
    engine = StreamingEngine(discover(tiny_config("llama")), ENGINE, opt, total_steps=steps)
    try:
        engine.load_random(seed=0)
        losses = [engine.train_step(b).loss.item() for b in global_batches(steps)]
        evaluated = engine.evaluate(global_batches()[0])
        return losses, {k: v.clone() for k, v in engine.state_dict().items()}, evaluated
    finally:
        engine.close()


def data_parallel(opt=OPT, steps=STEPS, cluster=None, after_launch=None, workers=2):
    # "auto" is pinned once for coordinator and workers alike: fp32 here, where workers have no GPU.
    engine = ENGINE.model_copy(update={"compute_dtype": "auto"})
    trainer = DataParallelTrainer(tiny_config("llama"), engine, opt, num_workers=workers, total_steps=steps,
                                  cluster=cluster, weights=0, after_launch=after_launch)
    try:
        assert trainer.engine_cfg.compute_dtype == "fp32"
        result = trainer.train(global_batches(steps))
        result.evaluated = trainer.evaluate(global_batches()[0])
        return result, trainer.state_dict()
    finally:
        trainer.close()


def assert_same_weights(state, ref, atol=1e-6):
    assert state.keys() == ref.keys()
    for name, w in ref.items():
        torch.testing.assert_close(state[name], w, atol=atol, rtol=1e-5, msg=name)


@pytest.mark.parametrize("clip", [1.0, 0.0])
def test_a_lone_worker_trains_bit_identically_to_one_engine(local_ray, clip):
    """One worker on one node: its gradients land in the arena's slots and go to the optimizer as they are,
    the clip takes the norm its engine computed, and it streams the master the optimizer updates in place:
    every loss, norm and weight is the single engine's to the bit."""
    opt = OPT.model_copy(update={"max_grad_norm": clip})
    engine = StreamingEngine(discover(tiny_config("llama")), ENGINE, opt, total_steps=2)
    try:
        engine.load_random(seed=0)
        ref = [engine.train_step(b) for b in global_batches(2)]
        ref_state = {k: v.clone() for k, v in engine.state_dict().items()}
    finally:
        engine.close()
    result, state = data_parallel(opt, steps=2, workers=1)
    assert result.losses == [r.loss.item() for r in ref]
    assert result.grad_norms == [r.grad_norm.item() for r in ref]
    assert state.keys() == ref_state.keys() and all(torch.equal(state[k], ref_state[k]) for k in ref_state)


def test_the_router_loss_is_reported_as_one_engine_reports_it(local_ray):
    """Two workers of a MoE model whose config asks for the load-balancing loss, a whole micro-batch each."""
    cfg = checkpoint_config("qwen3_moe", output_router_logits=True, router_aux_loss_coef=0.1)
    batch = tiny_batches(n_micro=2, seed=0, seq=12)
    engine = StreamingEngine(discover(cfg), ENGINE, OPT, total_steps=1)
    try:
        engine.load_random(seed=0)
        ref = engine.train_step(batch)
    finally:
        engine.close()
    trainer = DataParallelTrainer(cfg, ENGINE, OPT, num_workers=2, total_steps=1, weights=0)
    try:
        got = trainer.train_step(batch)
    finally:
        trainer.close()
    assert got.aux_loss is not None and float(got.aux_loss) == pytest.approx(float(ref.aux_loss), rel=1e-6)
    assert float(got.loss) == pytest.approx(float(ref.loss), rel=1e-6)


def test_sharding_keeps_every_row_and_the_global_token_count():
    batch = global_batches()[1]
    shards = shard_batch(batch, 2)
    assert [len(s) for s in shards] == [3, 3]
    assert sum(count_loss_tokens(s) for s in shards) == count_loss_tokens(batch)
    assert [len(s) for s in shard_batch(batch[:2], 2)] == [1, 1]  # whole micro-batches when they divide
    with pytest.raises(ClusterError, match="cannot feed 7 workers"):
        shard_batch(batch[:1], 7)


@pytest.mark.parametrize("cluster", [ClusterConfig(), ClusterConfig(grad_ring_mb=0.004), ClusterConfig(grad_reduce="nccl")],
                         ids=["host", "host-pieces", "nccl"])
def test_two_workers_match_one_engine(local_ray, cluster):
    """host: each worker's gradient lands in the node's arena and the shard adds them; host-pieces: a ring of
    4 KiB, so the second worker's gradients land in 2 KiB pieces, each summed as both workers' are in; nccl
    (gloo on CPU workers): the workers sum each gradient between them and one lands."""
    ref_losses, ref_state, ref_eval = single_engine()
    result, state = data_parallel(cluster=cluster)
    assert result.losses == pytest.approx(ref_losses, rel=1e-5)
    # Evaluation splits the rows across the workers too: the same summed loss and token counts.
    assert result.evaluated.loss_sum.item() == pytest.approx(ref_eval.loss_sum.item(), rel=1e-5)
    assert result.evaluated.num_loss_tokens == ref_eval.num_loss_tokens
    assert result.events == []
    assert len(result.grad_norms) == STEPS and all(n > 0 for n in result.grad_norms)
    assert_same_weights(state, ref_state)


@pytest.mark.parametrize("clip", [1.0, 0.0], ids=["clipped", "unclipped"])
def test_killed_worker_mid_step_is_replaced_and_nothing_is_lost(local_ray, clip):
    opt = OPT.model_copy(update={"max_grad_norm": clip})
    ref_losses, ref_state, _ = single_engine(opt)

    def kill_worker_in_step_2(step, trainer):
        if step == 2 and not trainer.events:
            # Kill mid-backward: once the head's summed gradient is in (unclipped: already applied).
            deadline = time.monotonic() + 30
            while local_ray.get(trainer.shards[0].units_summed.remote(2)) == 0 and time.monotonic() < deadline:
                time.sleep(0.005)
            local_ray.kill(trainer.workers[0])

    cluster = ClusterConfig(snapshot_every=2)
    result, state = data_parallel(opt, cluster=cluster, after_launch=kill_worker_in_step_2)
    assert len(result.events) == 1
    event = result.events[0]
    # A slow machine may let worker 0 finish step 2 before the kill lands: the loss then shows in step 3.
    assert event.step in (2, 3) and event.lost_ranks == [0]
    assert event.resumed_at in (event.step, event.step + 1)
    if clip == 0.0 and event.resumed_at == 2:  # units were updated, so the snapshot of step 2 was restored
        assert event.action is RecoveryAction.RESTORED
    losses, expected = list(result.losses), list(ref_losses)
    if event.resumed_at == event.step + 1 and event.action is RecoveryAction.COMPLETED:
        # Every gradient was in when the kill landed: the shards completed the step, and its loss (the lost worker
        # held a share) is NaN by design; the weights still equal one engine's.
        assert math.isnan(losses.pop(event.step))
        expected.pop(event.step)
    assert losses == pytest.approx(expected, rel=1e-5)
    assert_same_weights(state, ref_state)


def test_unclipped_step_left_half_applied_without_a_snapshot_restarts_from_a_checkpoint(local_ray):
    """Worker 0 dies in step 2 right after the shard summed, and (unclipped) applied, its first unit's gradient:
    the step is left half-applied whatever the machine's speed, and with no snapshot only a checkpoint restores it."""
    from mt_ray.cluster import ClusterLostError

    def die_after_the_first_unit_of_step_2(worker) -> None:  # runs in worker 0's process, before step 2
        submit, submitted = worker.grads.submit_device, []

        def submit_or_die(unit, *args, **kwargs):
            if worker.grads.step == 2:
                if submitted:
                    worker.grads.flush()  # the first unit's sum is in, and applied
                    os.kill(os.getpid(), signal.SIGKILL)
                submitted.append(unit)
            return submit(unit, *args, **kwargs)

        worker.grads.submit_device = submit_or_die

    def arm_worker_0(step, trainer):
        if step == 1:  # queued behind step 1's task on the actor, so it runs between steps 1 and 2
            local_ray.get(trainer.workers[0].__ray_call__.remote(die_after_the_first_unit_of_step_2))

    opt = OPT.model_copy(update={"max_grad_norm": 0.0})
    with pytest.raises(ClusterLostError, match="restarts from the newest checkpoint"):
        data_parallel(opt, cluster=ClusterConfig(snapshot_every=0), after_launch=arm_worker_0)


def test_a_cluster_that_cannot_place_the_run_is_refused_naming_the_key(local_ray):
    with pytest.raises(ConfigError, match=r"cluster.num_workers=3 cannot spread evenly over cluster.num_nodes=2"):
        DataParallelTrainer(tiny_config("llama"), ENGINE, OPT, num_workers=3, total_steps=1,
                            cluster=ClusterConfig(num_nodes=2))
    with pytest.raises(ConfigError, match=r"cluster.num_workers=2 .* need 2 GPUs; the cluster has 0"):
        DataParallelTrainer(tiny_config("llama"), ENGINE, OPT, num_workers=2, total_steps=1,
                            cluster=ClusterConfig(gpus_per_worker=1))
    # The placement group would wait forever for a bundle no node can hold: refused before it is made.
    with pytest.raises(ConfigError, match=r"only 0 of the cluster's nodes can .* lower cluster.cpus_per_worker \(now 3"):
        DataParallelTrainer(tiny_config("llama"), ENGINE, OPT, num_workers=1, total_steps=1,
                            cluster=ClusterConfig(cpus_per_worker=3))


def test_a_read_of_a_gradient_that_never_comes_ends_when_the_step_is_stopped(local_ray):
    """Ray can wait forever on an object whose owner died mid-read; the shard's read gives up once
    the driver stops the generation, so `stop` (which waits for the reduce thread) returns."""
    import threading
    from types import SimpleNamespace

    from mt_ray.cluster.errors import StaleGenerationError
    from mt_ray.cluster.shard_state import read_unless_stopped

    @local_ray.remote(num_cpus=0)
    class Never:
        def value(self):
            threading.Event().wait()

    never = Never.remote()
    gen = SimpleNamespace(number=7, stopped=False)
    outcome = []

    def read():
        try:
            read_unless_stopped(gen, never.value.remote())
        except StaleGenerationError as e:
            outcome.append(e)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(1.5)
    assert reader.is_alive()  # still waiting: the step runs
    gen.stopped = True
    reader.join(10)
    local_ray.kill(never)
    assert not reader.is_alive() and "generation 7 was stopped" in str(outcome[0])


def test_a_start_that_fails_after_placement_leaves_nothing_of_its_own_behind(local_ray, tmp_path):
    """A run whose shards fail to load (here: a checkpoint folder with nothing in it) removes its named
    placement group and actors, so the next run on the same Ray starts (it was refused: 'name already exists')."""
    from ray.util import placement_group_table

    with pytest.raises(Exception, match="safetensors|checkpoint|no such|not found"):
        DataParallelTrainer(tiny_config("llama"), ENGINE, OPT, num_workers=2, total_steps=1, weights=str(tmp_path))
    live = [g for g in placement_group_table().values() if g["name"] == "mt-ray-nodes" and g["state"] != "REMOVED"]
    assert live == []
    trainer = DataParallelTrainer(tiny_config("llama"), ENGINE, OPT, num_workers=2, total_steps=1, weights=0)
    trainer.close()


def test_four_workers_of_a_64_layer_model_never_stall_and_match_one_engine(local_ray):
    """Deeper than the shard's call threads once were (a blocking report held one per unsummed unit): four workers'
    reports are one-way and acknowledged in the arena, so 64 layers' gradients, three workers' through rings of a
    few pieces, finish the step; losses and weights equal one engine's on the whole batch."""
    cfg = tiny_config("llama", num_hidden_layers=64)
    batch = tiny_batches(n_micro=4, batch=2, seq=8, seed=3)
    engine = StreamingEngine(discover(cfg), ENGINE, OPT, total_steps=1)
    try:
        engine.load_random(seed=0)
        ref = engine.train_step(batch).loss.item()
        ref_state = {k: v.clone() for k, v in engine.state_dict().items()}
    finally:
        engine.close()
    trainer = DataParallelTrainer(cfg, ENGINE, OPT, num_workers=4, total_steps=1, weights=0,
                                  cluster=ClusterConfig(grad_ring_mb=0.05, step_timeout_s=300, cpus_per_worker=0.5))
    try:
        loss = trainer.train_step(batch).loss.item()
        state = trainer.state_dict()
    finally:
        trainer.close()
    assert loss == pytest.approx(ref, rel=1e-5)
    assert_same_weights(state, ref_state)
