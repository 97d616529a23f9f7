"""Data-parallel training of an image-text model equals one engine on the same global batches.

A tiny Qwen2.5-VL (tower frozen, projector trained: LLaMA-Factory's defaults) trains four steps on
two workers, with Adam's eps = 1 so that each update follows its gradient (a key projection's bias
has a gradient of zero but for rounding, which eps = 1e-8 would blow up to a full step). The global batches are packed by the data pipeline's own `collate`, with rows of 0, 1
and 2 images, so the workers' shares differ: rows split inside a micro-batch (images follow their
rows), a worker whose rows hold no image while the other's do, a step without any image (the
projector and its Adam count stay), and whole micro-batches per worker. A shard driven directly shows
what a recovery needs beyond that: the snapshot keeps each unit's Adam count.
"""

import itertools

import pytest
import torch

pytest.importorskip("ray")

from mt_ray.cluster import ClusterError, DataParallelTrainer, count_loss_tokens, shard_batch  # noqa: E402
from mt_ray.cluster.partition import ShardPlan  # noqa: E402
from mt_ray.data.packing import collate  # noqa: E402
from mt_ray.engine import StreamingEngine  # noqa: E402
from mt_ray.errors import ModelNotSupportedError  # noqa: E402
from mt_ray.models.discovery import discover  # noqa: E402
from mt_ray.tracking import CheckpointConfig, CheckpointManager  # noqa: E402
from tests.family_checks import OPT  # noqa: E402
from tests.unit.cluster.test_data_parallel import ENGINE, assert_same_weights  # noqa: E402
from tests.unit.engine.test_vlm import hand_made, packed  # noqa: E402
from tests.vlm_models import (  # noqa: E402
    QWEN_IMAGE,
    image_document,
    llava_document,
    make_image,
    qwen_example,
    save_llava,
    save_qwen_vl,
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_qwen_vl(tmp_path_factory.mktemp("qwen2_5_vl"))


@pytest.fixture(scope="module")
def steps(folder):
    one = qwen_example(folder, f"{QWEN_IMAGE}what is this? a cat", [make_image(0)])
    text = qwen_example(folder, "some text only here and more", [])
    two = qwen_example(folder, f"two {QWEN_IMAGE} and {QWEN_IMAGE} pictures ok", [make_image(1, 8, 16), make_image(2)])
    words = qwen_example(folder, "no picture in this one either", [])

    def mb(*rows):
        return {k: v for k, v in collate(rows, None, pad_id=0).items() if k != "segment_ids"}

    return [
        [mb([one, text], [words], [two])],  # rows split 2 + 1 inside the micro-batch: images on both workers
        [mb([text, one], [words])],  # worker 0's row has the image, worker 1's none
        [mb([text], [words, text])],  # no image anywhere: the projector is not updated
        [mb([two]), mb([one, words])],  # whole micro-batches, one per worker
    ]


def test_two_workers_train_an_image_text_model_as_one_engine(local_ray, folder, steps, tmp_path):
    """Then the workers' checkpoint resumes them (its Adam counts: the projector's is one behind) into a step
    with images, and evaluation splits image rows as training does."""
    spec = discover(str(folder))
    total = len(steps) + 1
    engine = StreamingEngine(spec, ENGINE, OPT, total_steps=total)
    try:
        engine.load_pretrained(folder)
        before = {k: v.clone() for k, v in engine.state_dict().items()}
        ref_losses = [engine.train_step(s).loss.item() for s in steps]
        ref_flat, ref_meta = engine.checkpoint_state()
        ref_flat = {k: v.clone() for k, v in ref_flat.items()}
        ref_losses.append(engine.train_step(steps[0]).loss.item())
        ref_eval = engine.evaluate(steps[0])
        ref_state = {k: v.clone() for k, v in engine.state_dict().items()}
    finally:
        engine.close()

    manager = CheckpointManager(CheckpointConfig(uri=str(tmp_path / "ckpt")))
    trainer = DataParallelTrainer(spec, ENGINE, OPT, num_workers=2, total_steps=total, weights=str(folder))
    try:
        losses = [trainer.train_step(s).loss.item() for s in steps]
        trainer.save_checkpoint(manager, len(steps), {})
        trainer.restore_checkpoint(manager)
        losses.append(trainer.train_step(steps[0]).loss.item())
        evaluated = trainer.evaluate(steps[0])
        state = trainer.state_dict()
    finally:
        trainer.close()

    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert_same_weights(state, ref_state)
    tower = [k for k in state if ".visual." in k and ".merger." not in k]
    projector = [k for k in state if ".visual.merger." in k]
    assert tower and all(torch.equal(state[k], before[k]) for k in tower)  # frozen: bit-identical
    assert all(not torch.equal(state[k], before[k]) for k in projector)  # trained
    assert evaluated.loss_sum.item() == pytest.approx(ref_eval.loss_sum.item(), rel=1e-5)
    assert evaluated.num_loss_tokens == ref_eval.num_loss_tokens
    # The checkpoint has the single engine's layout and meta: the frozen tower holds no moments.
    flat, meta = manager.load()
    trained = sum(u.numel for u in spec.trainable_units)
    assert flat["exp_avg"].numel() == flat["exp_avg_sq"].numel() == trained < flat["master"].numel()
    for name, ref in ref_flat.items():
        torch.testing.assert_close(flat[name], ref, atol=1e-6, rtol=1e-5, msg=name)
    assert meta["adam_counts"] == ref_meta["adam_counts"] == {"vision.projector": 3}


def test_image_rows_split_with_their_images(steps):
    batch = steps[0]
    shards = shard_batch(batch, 2)
    assert [mb["input_ids"].shape[0] for s in shards for mb in s] == [2, 1]
    assert [len(s[0]["images"]) for s in shards] == [2, 1]  # one list of images per row
    assert [len(row) for s in shards for row in s[0]["images"]] == [1, 0, 2]
    assert torch.equal(shards[1][0]["images"][0][1]["pixel_values"], batch[0]["images"][2][1]["pixel_values"])
    assert shards[1][0]["images"][0][1]["pixel_values"].untyped_storage().data_ptr() != \
        batch[0]["images"][2][1]["pixel_values"].untyped_storage().data_ptr()  # a copy, not a view of the batch
    assert sum(count_loss_tokens(s) for s in shards) == count_loss_tokens(batch)


def test_rows_without_an_entry_each_are_refused_a_row_split_but_travel_whole(folder):
    """The processor's own output holds the patches of all images in one tensor: it cannot follow rows."""
    doc = image_document(folder, f"{QWEN_IMAGE} a picture", [make_image(0)], 2)
    mb = {k: torch.cat([doc[k], doc[k]]) if k in ("input_ids", "labels") else doc[k]
          for k in ("input_ids", "labels", "pixel_values", "image_grid_thw")}
    with pytest.raises(ClusterError, match=r"'pixel_values' \(\(\d+, \d+\)\) has no entry per row of its 2 rows.*"
                                           r"training.grad_accum_steps a multiple of cluster.num_workers"):
        shard_batch([mb], 2)
    whole = shard_batch([mb, mb], 2)
    assert [torch.equal(s[0]["pixel_values"], doc["pixel_values"]) for s in whole] == [True, True]


def test_shards_cut_the_state_and_a_frozen_unit_has_no_moments(folder):
    spec = discover(str(folder))
    plan = ShardPlan.build(spec, 3)
    ranges = plan.flat_ranges()
    trained = sum(u.numel for u in spec.trainable_units)
    for name, total in (("master", spec.num_params), ("exp_avg", trained)):
        assert ranges[name][0][0] == 0 and ranges[name][-1][1] == total
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges[name]))  # contiguous
    moments = [hi - lo for lo, hi in ranges["exp_avg"]]
    assert moments == [sum(u.numel for u in part if not u.frozen) for part in plan.parts]


def test_a_shard_leaves_an_unused_projector_and_its_snapshot_keeps_adam_counts(local_ray, folder):
    """One shard, driven in this process as one worker drives it. The frozen tower is present at every
    version; a projector that no row used (None from the worker) keeps its weights and Adam count;
    the snapshot a recovery restores brings each unit's count back, the projector's one behind."""
    from mt_ray.cluster.arena import PRESENT, SLOT
    from mt_ray.cluster.run_spec import RunSpec, freeze_options, plan_nodes
    from mt_ray.cluster.shard import CoordinatorShard

    spec = discover(str(folder))
    threads = torch.get_num_threads()  # the shard sets the process's count, as it does in its actor
    run = RunSpec(spec.config, freeze_options(spec), ENGINE, OPT, total_steps=4, num_nodes=1)
    node = plan_nodes(spec, ShardPlan.build(spec, 1), ENGINE, workers_per_node=1, landers=1, ring=0, reference=False)
    shard = CoordinatorShard(run, node[0], snapshot_every=2)
    try:
        shard.set_peers([shard])
        shard.load_pretrained(str(folder))
        shard.start(0, 0)
        trained = [u.name for u in spec.trainable_units]
        assert shard.store.exp_avg.numel() == sum(u.numel for u in spec.trainable_units)
        assert shard.arena.version("vision.blocks.0") == PRESENT
        g = torch.Generator().manual_seed(0)

        def step(s: int, unused: tuple[str, ...] = ()) -> None:
            for unit in trained:  # as the worker waits for them (the snapshot of step 2 precedes the head)
                shard.arena.wait_version(unit, s, 0, timeout_s=30)
            for seq, unit in enumerate(reversed(trained)):
                if unit not in unused:  # the worker's device->host copy, into the unit's slot
                    shard.arena.grad(unit).copy_(torch.randn(spec.unit(unit).numel, generator=g) * 1e-2)
                shard.put_grad(0, s, 0, unit, None if unit in unused else SLOT, None, seq)
            shard.apply_norm(s, shard.local_norm_sq(0, s))
            shard.wait_updated(s + 1)

        def counts() -> dict[str, int]:
            return {u: opt.step_count() for u, opt in shard.optimizers.items()}

        step(0)
        projector = shard.store.master_of("vision.projector").clone()
        step(1, unused=("vision.projector",))
        assert torch.equal(shard.store.master_of("vision.projector"), projector)
        step(2)
        assert counts() == {u: 2 if u == "vision.projector" else 3 for u in trained}
        assert shard.arena.version("vision.blocks.0") == PRESENT  # the frozen tower, whatever the version
        shard.stop(3)
        assert shard.start(1, 3, restore_snapshot=True) == 2
        assert counts() == {u: 1 if u == "vision.projector" else 2 for u in trained}
        assert torch.equal(shard.store.master_of("vision.projector"), projector)
    finally:
        shard.close()
        torch.set_num_threads(threads)


def test_a_trained_tower_with_tensors_get_image_features_never_reads_is_refused_data_parallel(local_ray, tmp_path):
    """One engine leaves LLaVA's unread CLIP post-layernorm as torch does; the shards would decay it: refused."""
    folder = save_llava(tmp_path)
    spec = discover(str(folder), freeze_vision_tower=False)
    trainer = DataParallelTrainer(spec, ENGINE, OPT, num_workers=2, total_steps=1, weights=str(folder))
    try:
        with pytest.raises(ModelNotSupportedError, match="got no gradient.*keep model.freeze_vision_tower: true"):
            trainer.train_step([packed(hand_made(llava_document))] * 2)
    finally:
        trainer.close()
