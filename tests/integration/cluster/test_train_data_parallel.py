"""`jobs.train` with cluster.num_workers=2 trains the demo as one engine does, and resumes exactly.

Per-step metrics are read back from the final checkpoint's trainer state, which is what the
MLflow callback was given; the weights from each run's exported Hugging Face folder.
"""

import json

import pytest
import torch
from safetensors.torch import load_file

from jobs.train import main
from mt_ray.tracking import CheckpointConfig, CheckpointManager

pytest.importorskip("ray")

STEPS = 4


def train(tmp_path, name, workers, *extra, config="jobs/configs/demo.yaml"):
    """One `python -m jobs.train` run of the demo config (in this process, joining the test's Ray)."""
    out = tmp_path / "runs" / name
    ckpt = out / "checkpoints"
    argv = ["--config", config, f"training.steps={STEPS}", "training.log_every=1",
            "data.max_seq_len=64", "engine.device=cpu", "tracking.enabled=false", "checkpoint.every_steps=2",
            f"training.storage={tmp_path / 'runs'}", f"training.run_name={name}", f"cluster.num_workers={workers}",
            *extra]
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    _, meta = CheckpointManager(CheckpointConfig(uri=str(ckpt))).load()
    weights = load_file(out / "hf_model" / "model.safetensors")
    return summary, meta["trainer"]["history"], weights, ckpt


def assert_close_weights(a, b, atol):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=0, msg=name)


def test_two_workers_match_one_engine_and_resume_exactly(local_ray, tmp_path):
    one_summary, one_history, one_weights, _ = train(tmp_path, "one", 1)
    dp_summary, dp_history, dp_weights, dp_ckpt = train(tmp_path, "dp", 2)

    assert dp_summary["steps"] == one_summary["steps"] == STEPS
    assert [h["step"] for h in dp_history] == list(range(1, STEPS + 1))
    assert [h["loss"] for h in dp_history] == pytest.approx([h["loss"] for h in one_history], abs=1e-5)
    assert [h["grad_norm"] for h in dp_history] == pytest.approx([h["grad_norm"] for h in one_history], rel=1e-5)
    assert [h["lr"] for h in dp_history] == [h["lr"] for h in one_history]
    assert all(h["host_bytes_per_param"] > 0 for h in dp_history)
    assert_close_weights(dp_weights, one_weights, atol=1e-5)

    # Resume the 2-worker run from its step-2 checkpoint: the same losses and bit-identical weights.
    step2 = CheckpointManager(CheckpointConfig(uri=str(dp_ckpt))).list()[0]
    assert step2.step == 2
    _, resumed_history, resumed_weights, _ = train(tmp_path, "resumed", 2, f"training.resume={step2.uri}")
    assert [h["loss"] for h in resumed_history] == [h["loss"] for h in dp_history]
    assert_close_weights(resumed_weights, dp_weights, atol=0)

    # The checkpoint has the single engine's format: one engine carries the 2-worker run on.
    _, single_history, single_weights, _ = train(tmp_path, "single", 1, f"training.resume={step2.uri}")
    assert [h["loss"] for h in single_history] == pytest.approx([h["loss"] for h in dp_history], abs=1e-5)
    assert_close_weights(single_weights, dp_weights, atol=1e-5)


def test_dpo_on_two_workers_matches_one_engine_and_resumes_exactly(local_ray, tmp_path):
    """`jobs.train` (what `ray job submit` runs) with the DPO demo: each step's micro-batch of 4 packed rows split
    over two workers, pairs whole; the reference is each node's arena's. Losses, TRL's metrics, the held-out
    reward accuracy and the weights are one engine's; a resume (the reference loaded again from the starting
    weights, the policy from the checkpoint) continues bit-identically."""
    dpo = ("data.max_seq_len=128", "training.grad_accum_steps=1", "optimizer.warmup_steps=0")
    one_summary, one_history, one_weights, _ = train(tmp_path, "dpo-one", 1, *dpo, config="jobs/configs/dpo_demo.yaml")
    dp_summary, dp_history, dp_weights, dp_ckpt = train(tmp_path, "dpo-dp", 2, *dpo,
                                                         config="jobs/configs/dpo_demo.yaml")
    for name in ("loss", "rewards/chosen", "rewards/margins", "rewards/accuracies", "logps/rejected"):
        assert [h[name] for h in dp_history] == pytest.approx([h[name] for h in one_history], rel=1e-4, abs=1e-5), name
    assert dp_history[-1]["rewards/margins"] != 0
    for name in ("eval_loss", "eval_rewards/accuracies", "eval_rewards/margins", "eval_examples"):
        assert dp_summary[name] == pytest.approx(one_summary[name], rel=1e-4, abs=1e-5), name
    assert_close_weights(dp_weights, one_weights, atol=1e-5)

    step2 = CheckpointManager(CheckpointConfig(uri=str(dp_ckpt))).list()[0]
    _, resumed_history, resumed_weights, _ = train(tmp_path, "dpo-resumed", 2, *dpo, f"training.resume={step2.uri}",
                                                   config="jobs/configs/dpo_demo.yaml")
    assert [h["rewards/margins"] for h in resumed_history] == [h["rewards/margins"] for h in dp_history]
    assert_close_weights(resumed_weights, dp_weights, atol=0)


def test_grpo_on_two_workers_matches_one_engine_and_resumes_exactly(local_ray, tmp_path):
    """`jobs.train` with the GRPO demo, two iterations a rollout: the rollout replica beside each worker samples
    half the prompt groups (each group from its own seeded stream) from its copy, refreshed from the node's arena,
    and together they sample what one engine's copy samples in one batch; the workers train on it as one engine
    does. Resumed from the step-3 checkpoint (between the second rollout's iterations: the rollout and its
    old log-probs kept in it), the run continues bit-identically."""
    grpo = ("grpo.max_completion_length=8", "grpo.num_iterations=2", "checkpoint.every_steps=1",
            "checkpoint.keep_last=4", "optimizer.warmup_steps=0")
    demo = "jobs/configs/grpo_demo.yaml"
    _, one_history, one_weights, _ = train(tmp_path, "grpo-one", 1, *grpo, config=demo)
    _, dp_history, dp_weights, dp_ckpt = train(tmp_path, "grpo-dp", 2, *grpo, config=demo)
    for name in ("reward", "rewards/digits/mean", "completions/mean_length", "frac_reward_zero_std"):
        assert [h[name] for h in dp_history] == [h[name] for h in one_history], name
    for name in ("loss", "grad_norm", "clip_ratio/region_mean"):
        assert [h[name] for h in dp_history] == pytest.approx([h[name] for h in one_history], rel=1e-4, abs=1e-6), name
    assert dp_history[3]["clip_ratio/region_mean"] > 0  # step 4 trained on step 3's log-probs, not its own
    assert_close_weights(dp_weights, one_weights, atol=1e-5)

    step3 = next(c for c in CheckpointManager(CheckpointConfig(uri=str(dp_ckpt))).list() if c.step == 3)
    _, resumed_history, resumed_weights, _ = train(tmp_path, "grpo-resumed", 2, *grpo, f"training.resume={step3.uri}",
                                                   config=demo)
    assert [(h["loss"], h["reward"]) for h in resumed_history] == [(h["loss"], h["reward"]) for h in dp_history]
    assert_close_weights(resumed_weights, dp_weights, atol=0)


def test_an_image_text_model_trains_on_two_workers_as_on_one(local_ray, tmp_path):
    """The multimodal demo on the tiny Qwen2.5-VL, each micro-batch's rows split over two workers with their
    images. Freezing the other way round than by default (tower trained, projector frozen) shows the workers
    and the shard freeze as asked. Adam's eps = 1 makes each update follow its gradient (a key projection's
    bias has a gradient of rounding alone)."""
    from tests.vlm_models import save_qwen_vl

    folder = save_qwen_vl(tmp_path / "model")
    vlm = (f"model.path={folder}", "data.datasets=demo_mllm", "training.steps=2", "training.micro_batch_size=4",
           "training.grad_accum_steps=1", "model.freeze_vision_tower=false", "model.freeze_multi_modal_projector=true",
           "optimizer.eps=1.0", "optimizer.warmup_steps=0")
    _, one_history, one_weights, _ = train(tmp_path, "vlm-one", 1, *vlm)
    _, dp_history, dp_weights, _ = train(tmp_path, "vlm-dp", 2, *vlm)

    assert [h["loss"] for h in dp_history] == pytest.approx([h["loss"] for h in one_history], abs=1e-5)
    assert_close_weights(dp_weights, one_weights, atol=1e-5)
    before = load_file(folder / "model.safetensors")
    projector = [k for k in before if ".merger." in k]
    assert projector and all(torch.equal(dp_weights[k], before[k]) for k in projector)  # frozen: bit-identical
    assert not [k for k in before if "visual.blocks." in k and torch.equal(dp_weights[k], before[k])]  # trained
    assert (tmp_path / "runs" / "vlm-dp" / "hf_model" / "preprocessor_config.json").exists()  # the processor's files


@pytest.mark.parametrize("when", ["mid-step", "at-checkpoint"])
def test_lost_shard_restarts_the_job_from_its_checkpoint(local_ray, tmp_path, monkeypatch, capsys, when):
    """Killed after step 3 (step 4 fails; the step-2 checkpoint resumes), or after step 2 before
    its checkpoint is written (the checkpoint fails; no checkpoint yet, so the job starts over)."""
    import ray

    import mt_ray.training.launch as launch
    from mt_ray.training.callbacks import Callback

    kill_at = 3 if when == "mid-step" else 2
    fired = []

    class KillShard(Callback):
        def on_step_end(self, trainer, step):
            if step == kill_at and not fired:
                fired.append(step)
                ray.kill(trainer.engine.shards[0], no_restart=True)

    build = launch.build_callbacks
    if when == "mid-step":
        monkeypatch.setattr(launch, "build_callbacks", lambda cfg, run: [*build(cfg, run), KillShard()])
    else:
        monkeypatch.setattr(launch, "build_callbacks", lambda cfg, run: [KillShard(), *build(cfg, run)])
    _, history, weights, _ = train(tmp_path, "lost", 2)

    assert fired == [kill_at]
    assert "restart 1/1 from the newest checkpoint" in capsys.readouterr().err
    # Steps since the checkpoint (or since the start) replayed on a new cluster: the same run as
    # one with no failure (its losses come from the checkpointed history, then the replay).
    _, clean_history, clean_weights, _ = train(tmp_path, "clean", 2)
    assert [h["loss"] for h in history] == [h["loss"] for h in clean_history]
    assert_close_weights(weights, clean_weights, atol=0)
