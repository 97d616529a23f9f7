"""`pref.reference: precompute`: the reference's log-probs computed once with the starting weights train exactly
as the streamed reference does, are read back by a later run of the same key, and are computed again when the
key changes or the file holds another key."""

import json
from pathlib import Path

import pytest
import torch

from mt_ray.config.run import load_run_config
from mt_ray.data.assets import demo_registry_path
from mt_ray.training.reference_cache import CACHE_DIR
from mt_ray.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")  # a tiny model: intra-op threads only fight over 2 cores


def small_registry(folder: Path) -> Path:
    """dpo_en_demo's first 12 pairs (the precompute pass walks every pair, so fewer pairs keep it short), and the
    same as 12 KTO rows (each pair's chosen response desirable, its rejected one not)."""
    registry = json.loads(demo_registry_path().read_text())
    rows = json.loads((demo_registry_path().parent / registry["dpo_en_demo"]["file_name"]).read_text())[:12]
    feedback = [{"conversations": [*r["conversations"], r[k]], "tag": k == "chosen"}
                for r in rows[:6] for k in ("chosen", "rejected")]
    folder.mkdir()
    (folder / "pairs.json").write_text(json.dumps(rows))
    (folder / "feedback.json").write_text(json.dumps(feedback))
    (folder / "dataset_info.json").write_text(json.dumps({
        "pairs": {**registry["dpo_en_demo"], "file_name": "pairs.json"},
        "feedback": {"file_name": "feedback.json", "formatting": "sharegpt",
                     "columns": {"messages": "conversations", "kto_tag": "tag"}}}))
    return folder


def train(tmp_path, name: str, *overrides: str):
    registry = tmp_path / "registry"
    if not registry.exists():
        small_registry(registry)
    # 8 training pairs, 2 a step: the third step starts the second epoch, which the cache must still cover.
    cfg = load_run_config("jobs/configs/dpo_demo.yaml", [
        "training.steps=5", "training.log_every=1", "training.micro_batch_size=1", "training.grad_accum_steps=2",
        "data.max_seq_len=48", "data.packing_window=8", f"data.registry={registry}", "data.datasets=[pairs]",
        "engine.device=cpu", "tracking.enabled=false", "training.export=false", f"training.storage={tmp_path}",
        f"training.run_name={name}", "data.val_size=4", *overrides])
    trainer = Trainer(cfg)
    try:
        summary = trainer.fit()
        weights = {k: v.clone() for k, v in trainer.engine.state_dict().items()}
        return trainer, summary, [h["loss"] for h in trainer.history], weights
    finally:
        trainer.close()


def test_precompute_trains_as_the_stream_and_its_cache_is_reused(tmp_path):
    _, stream, stream_losses, stream_weights = train(tmp_path, "stream")
    first, pre, pre_losses, pre_weights = train(tmp_path, "pre1", "pref.reference=precompute")
    assert first.reference_logps.computed and first.engine.pref.reference is None  # no reference weights held
    assert pre_losses == pytest.approx(stream_losses, rel=1e-5)
    assert pre["eval_loss"] == pytest.approx(stream["eval_loss"], rel=1e-5)
    for k, v in stream_weights.items():
        torch.testing.assert_close(pre_weights[k], v, rtol=1e-5, atol=1e-6)
    cached = list((tmp_path / CACHE_DIR).iterdir())
    assert len(cached) == 1

    again, _, again_losses, _ = train(tmp_path, "pre2", "pref.reference=precompute")
    assert not again.reference_logps.computed and again_losses == pytest.approx(pre_losses, rel=1e-6)

    shorter, *_ = train(tmp_path, "pre3", "pref.reference=precompute", "data.max_seq_len=40")
    assert shorter.reference_logps.computed and len(list((tmp_path / CACHE_DIR).iterdir())) == 2

    stored = json.loads(cached[0].read_text())
    stored["key"]["template"] = "another"
    cached[0].write_text(json.dumps(stored))
    refused, *_ = train(tmp_path, "pre4", "pref.reference=precompute")
    assert refused.reference_logps.computed  # the file's key is not this run's: computed again and rewritten
    assert json.loads(cached[0].read_text())["key"]["template"] != "another"


def test_kto_precompute_covers_the_twins_of_every_step(tmp_path):
    kto = ("training.stage=kto", "data.datasets=[feedback]", "training.micro_batch_size=2",
           "training.grad_accum_steps=1", "training.steps=10")
    _, stream, stream_losses, stream_weights = train(tmp_path, "stream", *kto)
    first, pre, pre_losses, pre_weights = train(tmp_path, "pre1", "pref.reference=precompute", *kto)
    assert first.reference_logps.computed and first.engine.pref.reference is None
    # 8 training rows, 2 a step: three epochs, each shuffled its own way, so each pairs other twins (a pass over
    # the first epoch's windows would see two of them: packing windows of 8 rows end an epoch only once it is over)
    assert pre_losses == pytest.approx(stream_losses, rel=1e-5) and len(pre_losses) == 10
    assert pre["eval_loss"] == pytest.approx(stream["eval_loss"], rel=1e-5)
    for k, v in stream_weights.items():
        torch.testing.assert_close(pre_weights[k], v, rtol=1e-5, atol=1e-6)
    again, *_ = train(tmp_path, "pre2", "pref.reference=precompute", *kto)
    assert not again.reference_logps.computed
    more, *_ = train(tmp_path, "pre3", "pref.reference=precompute", *kto, "training.steps=11")
    assert more.reference_logps.computed  # more steps are more twins: another key
