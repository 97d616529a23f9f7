"""Training one family from its own checkpoint, in the engine and in transformers: the checks of
tests/unit/engine/test_families.py (CPU) and tests/gpu/test_families_cuda.py (CUDA)."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from transformers.loss.loss_utils import ForCausalLMLoss

from mt_ray.data.packing import collate
from mt_ray.data.schema import TokenizedExample
from mt_ray.engine import EngineConfig, OptimizerConfig, StreamingEngine
from mt_ray.models.discovery import discover
from tests.tiny_models import VOCAB, checkpoint_config, reference_train

# eps = 1 makes Adam's first update ~ lr * gradient (not lr * sign), so comparing one step's weights
# compares the gradients themselves; clipping and decay are on, as in training.
OPT = OptimizerConfig(lr=0.1, eps=1.0, weight_decay=0.01, max_grad_norm=1.0)
ROW = 24
DOCUMENTS = [(9, 3), (6, 2), (7, 3), (13, 4), (11, 5)]  # (length, prompt tokens): rows [9 6 7 +2 pad], [13 11]


def documents(seed: int = 0) -> list[TokenizedExample]:
    g = torch.Generator().manual_seed(seed)
    docs = []
    for n, prompt in DOCUMENTS:
        ids = torch.randint(3, VOCAB, (n,), generator=g).tolist()
        docs.append(TokenizedExample(tuple(ids), tuple([-100] * prompt + ids[prompt:])))
    return docs


def packed_micro_batch(docs: list[TokenizedExample]) -> dict[str, torch.Tensor]:
    batch = collate([docs[:3], docs[3:]], ROW, pad_id=0)  # the data pipeline's own packing
    return {k: batch[k] for k in ("input_ids", "labels", "position_ids")}


def save_checkpoint(family: str, folder, **overrides) -> None:
    """A random model of `family` written by transformers; saved buffers (DeepSeek-V3's per-layer
    routing bias) get random values, so a layer computing with another layer's values shows."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(checkpoint_config(family, **overrides))
    saved = model.state_dict(keep_vars=True)
    for name, buf in model.named_buffers():
        if name in saved and buf.is_floating_point():
            buf.normal_()
    model.save_pretrained(folder)


def engine_step(folder, micro_batches, **engine_kw):
    """One step of the engine (default settings, on the CPU unless `engine_kw` says otherwise) from `folder`."""
    _, result, state = stepped_engine(folder, micro_batches, **engine_kw)
    return result, state


def stepped_engine(folder, micro_batches, **engine_kw):
    """`engine_step` with the (closed) engine beside its result and weights, for what it decided about the family."""
    cfg = EngineConfig(**{"device": "cpu", **engine_kw})
    engine = StreamingEngine(discover(str(folder)), cfg, OPT, total_steps=1)
    try:
        engine.load_pretrained(folder)
        result = engine.train_step(micro_batches)
        return engine, result, {k: v.clone() for k, v in engine.state_dict().items()}
    finally:
        engine.close()


def rows_apart(docs: list[TokenizedExample]) -> list[dict[str, torch.Tensor]]:
    """The packed rows of `docs`, each its own micro-batch."""
    packed = packed_micro_batch(docs)
    return [{k: v[r:r + 1] for k, v in packed.items()} for r in range(packed["input_ids"].shape[0])]


def eager_reference(folder, device: str = "cpu") -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").float().to(device)


def reference_step(folder, docs: list[TokenizedExample], device: str = "cpu"):
    """transformers' eager model, one step over each document alone: (loss, weights before, weights after).

    A causal-LM class whose forward computes its own unshifted cross-entropy (BART's, Pegasus', Whisper's decoders:
    each logit scored against its own position's label) is scored on next-token prediction, transformers'
    `ForCausalLMLoss` of its logits, which is what mt-ray trains every causal LM on."""
    ref = eager_reference(folder, device)
    before = {k: v.detach().cpu().clone() for k, v in ref.state_dict().items()}
    alone = [{"input_ids": torch.tensor([d.input_ids], device=device), "labels": torch.tensor([d.labels], device=device)}
             for d in docs]
    if shifts_labels(type(ref)):
        [loss] = reference_train(ref, [alone], OPT)
    else:
        vocab = ref.config.get_text_config().vocab_size
        [loss] = reference_train(ref, [alone], OPT, lambda out, mb, n: ForCausalLMLoss(
            out.logits, mb["labels"], vocab, num_items_in_batch=n))
    return loss, before, {k: v.detach().cpu() for k, v in ref.state_dict().items()}


def shifts_labels(causal_lm: type) -> bool:
    """Whether the class's forward scores its logits with transformers' (shifted) causal-LM loss."""
    return "self.loss_function" in inspect.getsource(causal_lm.forward)


def assert_same_step(state, before, ref_state, loss, ref_loss, rel=1e-5, rtol=1e-4, atol=3e-7):
    """Same loss, and the same update of every weight (so the same gradients: see OPT)."""
    assert loss == pytest.approx(ref_loss, rel=rel)
    for name, w in ref_state.items():
        if name in state:  # a tied head is the embedding
            torch.testing.assert_close(state[name] - before[name], w - before[name], rtol=rtol, atol=atol, msg=name)


def assert_exports_as_saved(saved: Path, exported: Path) -> None:
    """`saved` (a `save_pretrained` folder) loaded into an engine and exported to `exported`: every tensor comes back
    under its saved name with its saved value (tied ones stored once, as transformers stores them)."""
    engine = StreamingEngine(discover(str(saved)), EngineConfig(device="cpu"), OPT, total_steps=1)
    try:
        engine.load_pretrained(saved)
        out = engine.export(exported)
    finally:
        engine.close()
    before, after = load_file(saved / "model.safetensors"), load_file(out / "model.safetensors")
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)

