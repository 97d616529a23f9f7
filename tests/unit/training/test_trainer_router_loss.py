"""A MoE run whose config asks for the router's load-balancing loss logs it beside the loss it is part of."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from mt_ray.config.run import load_run_config
from mt_ray.data.assets import load_tiny_tokenizer, tiny_tokenizer_path
from mt_ray.training import Trainer
from tests.conftest import RecordLogs
from tests.tiny_models import checkpoint_config


def test_router_aux_loss_is_logged(tmp_path):
    vocab = (len(load_tiny_tokenizer()) + 63) // 64 * 64
    config = checkpoint_config("qwen3_moe", vocab_size=vocab, output_router_logits=True, router_aux_loss_coef=0.1)
    torch.manual_seed(0)  # the weights (and so the routing) must not depend on the tests that ran before
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "moe")
    cfg = load_run_config(None, [
        f"model.path={tmp_path / 'moe'}", f"model.tokenizer={tiny_tokenizer_path()}", "training.steps=2",
        "training.micro_batch_size=2", "training.log_every=1", "data.max_seq_len=64", "engine.device=cpu",
        "training.export=false", f"training.storage={tmp_path}", "training.run_name=moe"])
    recorder = RecordLogs()
    trainer = Trainer(cfg, [recorder])
    try:
        trainer.fit()
    finally:
        trainer.close()
    assert len(recorder.logged) == 2
    for metrics in recorder.logged:
        assert metrics["aux_loss"] == pytest.approx(2.0, abs=0.5)  # balanced routing over 4 experts, top 2: ~2
