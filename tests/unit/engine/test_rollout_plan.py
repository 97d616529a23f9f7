"""GRPO's rollout copy planned with the step on one GPU (`plan_beside_rollout`): the copy's placement, the kept
block graphs beside it, and the refusals before step 1. The shape is the issue's: Qwen2.5-7B, 16 prompts x 8
completions of 64 + 128 tokens, micro-batches of 16, K=4; on the cluster each of 2 workers updates 4 micro-batches
beside a replica in another process generating 64 completions."""

import json
from dataclasses import replace

import pytest

from mt_ray.cli.main import main
from mt_ray.engine.calculator import GPU_HEADROOM
from mt_ray.engine.config import EngineConfig
from mt_ray.engine.grpo import GrpoConfig
from mt_ray.engine.kept_blocks import plan_beside_rollout
from mt_ray.engine.sizing import GIB, REPLICA_CONTEXT_BYTES, Stage, device_bytes, rollout_bytes
from mt_ray.errors import InsufficientMemoryError
from mt_ray.models.discovery import discover
from mt_ray.models.presets import preset_config

H200_GB = 140.4  # what torch reports for an H200
CFG = EngineConfig(device="cpu", compute_dtype="bf16", checkpoint_every=4)
GRPO = Stage.of("grpo", grpo=GrpoConfig(max_prompt_length=64, max_completion_length=128))
REPLICA = replace(GRPO, rollout_rows=64, rollout_apart=True)


@pytest.fixture(scope="module")
def spec():
    return discover(preset_config("qwen2.5-7b"))


def _peak(spec, stage, kept):
    return device_bytes(spec, CFG.model_copy(update={"keep_activations": kept}), 16, 192, 64, stage=stage)["total"]


def test_a_replica_in_another_process_is_counted_whole_beside_the_step(spec):
    """Its key/value cache and workspace stay reserved through the update: counted on top, not within what the
    update frees; auto keeps fewer graphs than with no replica, and the plan fits the budget with one more not."""
    copy, generation = rollout_bytes(spec, CFG, 64, 192)
    alone, with_none = plan_beside_rollout(spec, CFG, replace(GRPO, rollout_tokens=0), H200_GB, 16, 192, 4)
    stage, kept = plan_beside_rollout(spec, CFG, REPLICA, H200_GB, 16, 192, 4)
    assert stage.rollout_placement == "resident" and 0 < kept < with_none
    assert _peak(spec, stage, kept) - _peak(spec, alone, kept) == copy + generation + REPLICA_CONTEXT_BYTES
    assert _peak(spec, stage, kept) <= H200_GB * GIB * GPU_HEADROOM < _peak(spec, stage, kept + 1)
    # The crash: 28 graphs were planned as if no replica shared the GPU.
    assert with_none == 28 and _peak(spec, stage, with_none) > H200_GB * GIB * GPU_HEADROOM


def test_a_number_that_cannot_fit_beside_the_replica_is_refused_naming_the_largest(spec):
    _, largest = plan_beside_rollout(spec, CFG, REPLICA, H200_GB, 16, 192, 4)
    given = CFG.model_copy(update={"keep_activations": largest})
    assert plan_beside_rollout(spec, given, REPLICA, H200_GB, 16, 192, 4)[1] == largest
    too_many = CFG.model_copy(update={"keep_activations": largest + 1})
    with pytest.raises(InsufficientMemoryError, match=f"rollout copy: the largest that fits is {largest}"):
        plan_beside_rollout(spec, too_many, REPLICA, H200_GB, 16, 192, 4)


def test_a_replica_that_cannot_fit_resident_is_streamed_and_one_that_cannot_fit_streamed_is_refused(spec):
    stage, kept = plan_beside_rollout(spec, CFG, replace(REPLICA, rollout_placement="auto"), 24, 16, 192, 4)
    assert stage.rollout_placement == "streamed" and _peak(spec, stage, kept) <= 24 * GIB * GPU_HEADROOM
    with pytest.raises(InsufficientMemoryError, match="rollout.placement: streamed"):
        plan_beside_rollout(spec, CFG, replace(REPLICA, rollout_placement="resident"), 24, 16, 192, 4)
    with pytest.raises(InsufficientMemoryError, match=r"(?s)64 completions.*grpo.max_completion_length"):
        plan_beside_rollout(spec, CFG, replace(REPLICA, rollout_placement="auto"), 20, 16, 192, 4)


def test_on_the_cpu_there_is_nothing_to_plan(spec):
    stage, kept = plan_beside_rollout(spec, CFG, replace(REPLICA, rollout_placement="auto"), None, 16, 192, 4)
    assert (stage.rollout_placement, kept) == ("resident", 0)
    given = CFG.model_copy(update={"keep_activations": 3})
    assert plan_beside_rollout(spec, given, REPLICA, None, 16, 192, 4)[1] == 3


def test_calc_for_workers_plans_each_gpu_with_its_replica_beside_it(capsys):
    """`--workers 2` on the GRPO demo: each worker's half of the 16 completions, and its replica's copy, cache and
    context counted whole beside the update (not within what it frees, as one engine's copy is)."""
    args = ["calc", "--gpu-mem-gb", "80", "--host-mem-gb", "256", "--json", "--config", "jobs/configs/grpo_demo.yaml"]
    assert main(args) == 0
    one = json.loads(capsys.readouterr().out)
    assert main([*args, "--workers", "2"]) == 0
    two = json.loads(capsys.readouterr().out)
    assert (one["global_batch"], two["global_batch"]) == (16, 8)
    beside = two["rollout_copy_gib"] + two["rollout_generation_gib"] + REPLICA_CONTEXT_BYTES / GIB
    assert two["device_gib"] > beside and two["rollout_placement"] == "resident"
