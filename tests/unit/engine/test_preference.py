"""Preference training equals TRL: loss, metrics and one step's updated weights, for every loss, through the
streamed and resident schedules, packed and unpacked.

TRL computes its loss with its own trainer (`DPOTrainer.compute_loss`, `KTOTrainer.compute_loss`) or, for
the experimental SimPO (CPO) trainer, its own loss function on the model's log-probs; its gradients then take one
plain torch AdamW step, which the engine's update must equal. ORPO runs `ORPOTrainer.train` itself, two steps.
"""

from __future__ import annotations

import copy
import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from mt_ray.data.packing import collate
from mt_ray.data.schema import (
    ROLE_CHOSEN,
    ROLE_DESIRABLE,
    ROLE_KL,
    ROLE_REJECTED,
    ROLE_UNDESIRABLE,
)
from mt_ray.data.schema import TokenizedExample as Seq
from mt_ray.engine import EngineConfig, OptimizerConfig, StreamingEngine
from mt_ray.engine.preference import PreferenceConfig
from mt_ray.models.discovery import discover
from tests.tiny_models import (
    VOCAB,
    assert_freed_once_closed,
    preference_sequence,
    reference_model,
    tiny_config,
)

trl = pytest.importorskip("trl")
os.environ.setdefault("TQDM_DISABLE", "1")

# eps above most gradients: a first Adam step is then nearly linear in the gradient, so the
# updated weights compare the gradients (with eps 1e-8 it is lr·sign(g), which float rounding can flip)
OPT = OptimizerConfig(lr=1e-2, eps=1e-3, max_grad_norm=0.0, schedule="constant")
PAIRS = 4
LAYOUTS = {  # (engine kwargs, packed): pairs per row and micro-batches
    "stream-packed": ({"checkpoint_every": 2, "loss_chunk_tokens": 5}, True),
    "stream-unpacked": ({"checkpoint_every": 3}, False),
    "resident-packed": ({"schedule": "resident"}, True),
}


def make_pairs(seed: int = 0, n: int = PAIRS) -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(seed)

    def ids(k: int) -> list[int]:
        return torch.randint(3, VOCAB, (k,), generator=g).tolist()

    return [{"prompt_ids": ids(3 + i % 3), "chosen_ids": ids(2 + i), "rejected_ids": ids(5 - i % 3)} for i in range(n)]


def micro_batches(groups: list[list[Seq]], packed: bool) -> list[dict]:
    """Two micro-batches: packed, one row holding half the groups each; unpacked, a row per group."""
    half = len(groups) // 2
    parts = [groups[:half], groups[half:]]
    if packed:
        return [collate([[s for g in part for s in g]], None, 0) for part in parts]
    return [collate(part, None, 0) for part in parts]


def models(seed: int = 0):
    """The policy, and a reference near it (so rewards are not zero)."""
    cfg = tiny_config("llama")
    policy = reference_model(cfg, seed)
    ref = copy.deepcopy(policy)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return cfg, policy, ref


def engine_step(cfg, policy, ref, mbs, stage: str, pref: PreferenceConfig, engine_kw: dict):
    engine_cfg = EngineConfig(device="cpu", compute_dtype="fp32", **engine_kw)
    engine = StreamingEngine(discover(cfg), engine_cfg, OPT, total_steps=1, stage=stage, pref=pref)
    try:
        engine.load_state_dict(policy.state_dict())
        if ref is not None and engine.pref.reference is not None:
            engine.load_reference(ref.state_dict())
        result = engine.train_step(mbs)
        metrics = {k: v.item() for k, v in result.metrics.items()}
        return result.loss.item(), metrics, {k: v.clone() for k, v in engine.state_dict().items()}
    finally:
        engine.close()


def torch_step(model, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    """One AdamW step on `loss`'s gradients, as the engine's optimizer takes it (no decay, no clipping)."""
    opt = torch.optim.AdamW(model.parameters(), lr=OPT.lr, betas=OPT.betas, eps=OPT.eps, weight_decay=0.0)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def assert_same(ours, theirs, metric_names):
    loss, metrics, state = ours
    ref_loss, ref_metrics, ref_state = theirs
    assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
    for name in metric_names:
        assert metrics[name] == pytest.approx(ref_metrics[name], rel=1e-4, abs=1e-5), name
    for name, w in state.items():
        torch.testing.assert_close(w, ref_state[name], atol=2e-6, rtol=1e-5, msg=name)


def trainer_args(cls, **kw):
    return cls(output_dir="/tmp/mt-ray-trl", report_to=[], use_cpu=True, bf16=False, max_length=None,
               per_device_train_batch_size=PAIRS, **kw)


# ---------------------------------------------------------------------------------------------- DPO


def trl_loss_and_step(trainer, policy, batch) -> tuple[float, dict, dict[str, torch.Tensor]]:
    """TRL's loss on `batch` through its own collator, the metrics it logged, and one AdamW step of `policy`."""
    policy.train()
    loss = trainer.compute_loss(policy, trainer.data_collator(batch))
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return loss.item(), metrics, torch_step(policy, loss)


def trl_dpo(policy, ref, pairs, loss_types, weights, beta):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from mt_ray.data import load_tiny_tokenizer

    args = trainer_args(DPOConfig, beta=beta, loss_type=loss_types, loss_weights=weights)
    dummy = Dataset.from_list([{"prompt": "hi", "chosen": " yes", "rejected": " no"}])
    trainer = DPOTrainer(model=policy, ref_model=ref, args=args, train_dataset=dummy,
                         processing_class=load_tiny_tokenizer())
    return trl_loss_and_step(trainer, policy, pairs)


DPO_METRICS = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
               "logps/rejected"]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("loss", ["sigmoid", "ipo", "hinge"])
def test_dpo_equals_trl(loss, layout):
    engine_kw, packed = LAYOUTS[layout]
    cfg, policy, ref = models()
    pairs = make_pairs()
    groups = [[preference_sequence(p["prompt_ids"], p["chosen_ids"], ROLE_CHOSEN),
               preference_sequence(p["prompt_ids"], p["rejected_ids"], ROLE_REJECTED)] for p in pairs]
    ftx = 0.5 if loss == "sigmoid" else 0.0  # TRL's "sft" loss term beside sigmoid: LLaMA-Factory's pref_ftx
    pref = PreferenceConfig(beta=0.5, loss=loss, ftx=ftx)
    ours = engine_step(cfg, policy, ref, micro_batches(groups, packed), "dpo", pref, engine_kw)
    types, weights = ([loss, "sft"], [1.0, ftx]) if ftx else ([loss], [1.0])
    theirs = trl_dpo(policy, ref, pairs, types, weights, beta=0.5)
    assert_same(ours, theirs, DPO_METRICS)


def test_a_closed_engine_that_streams_a_reference_is_freed_with_its_last_reference():
    """The stage refers back to its engine weakly, so it makes no cycle with it."""
    cfg, policy, ref = models()
    groups = [[preference_sequence(p["prompt_ids"], p["chosen_ids"], ROLE_CHOSEN),
               preference_sequence(p["prompt_ids"], p["rejected_ids"], ROLE_REJECTED)] for p in make_pairs()]

    def trained_engine():
        engine = StreamingEngine(discover(cfg), EngineConfig(device="cpu"), OPT, 1, stage="dpo", pref=PreferenceConfig())
        engine.load_state_dict(policy.state_dict())
        engine.load_reference(ref.state_dict())
        engine.train_step(micro_batches(groups, packed=True))
        return engine

    assert_freed_once_closed(trained_engine)


# ---------------------------------------------------------------------------------------------- ORPO


ORPO_PAIRS = [{"prompt": f"Question {i}: what is {i} plus {3 * i}?", "chosen": f" It is {4 * i}.",
               "rejected": f" Maybe {i + 7}, or not at all{'!' * i}"} for i in range(PAIRS)]
ORPO_METRICS = [*DPO_METRICS, "nll_loss", "log_odds_ratio", "log_odds_chosen"]
ORPO_OPT = OptimizerConfig(lr=1e-2, eps=1e-3, max_grad_norm=0.0, schedule="constant")


@pytest.fixture(scope="module")
def orpo_trainer_run():
    """TRL's ORPOTrainer, unmodified, trained two steps on ORPO_PAIRS (all four a step) from a tiny Llama: the
    config, the starting weights, the pairs as it tokenized them (mt-ray's sequences), its logged metrics and
    its weights after."""
    from datasets import Dataset
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    from mt_ray.data import load_tiny_tokenizer

    tok = load_tiny_tokenizer()
    cfg = tiny_config("llama", vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    policy = reference_model(cfg)
    start = copy.deepcopy(policy.state_dict())
    args = ORPOConfig(output_dir="/tmp/mt-ray-trl", report_to=[], use_cpu=True, bf16=False, max_length=64, beta=0.5,
                      per_device_train_batch_size=PAIRS, max_steps=2, learning_rate=ORPO_OPT.lr,
                      adam_epsilon=ORPO_OPT.eps, lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0,
                      logging_steps=1, save_strategy="no", seed=0)
    trainer = ORPOTrainer(model=policy, args=args, train_dataset=Dataset.from_list(ORPO_PAIRS), processing_class=tok)
    groups = [[preference_sequence(ids[:labels.count(-100)], ids[labels.count(-100):], role)
               for ids, labels, role in ((row[f"{side}_input_ids"], row[f"{side}_labels"], r)
                                         for side, r in (("chosen", ROLE_CHOSEN), ("rejected", ROLE_REJECTED)))]
              for row in trainer.train_dataset]
    assert all(len(g[0].input_ids) > g[0].prompt_len > 3 for g in groups)  # prompts the NLL must cover
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    return cfg, start, groups, logged, {k: v.detach().clone() for k, v in policy.state_dict().items()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_orpo_equals_trl_orpo_trainer(orpo_trainer_run, layout):
    """pref.loss orpo trains as ORPOTrainer does, its NLL over the chosen prompts and responses: each step's loss
    and TRL's metrics, and the weights after two steps (the engine's step split in two micro-batches)."""
    cfg, start, groups, logged, theirs = orpo_trainer_run
    engine_kw, packed = LAYOUTS[layout]
    engine = StreamingEngine(discover(cfg), EngineConfig(device="cpu", compute_dtype="fp32", **engine_kw), ORPO_OPT,
                             total_steps=2, stage="dpo", pref=PreferenceConfig(beta=0.5, loss="orpo"))
    try:
        engine.load_state_dict(start)
        for step in logged:
            result = engine.train_step(micro_batches(groups, packed))
            assert result.loss.item() == pytest.approx(step["loss"], rel=1e-5)
            for name in ORPO_METRICS:
                assert result.metrics[name].item() == pytest.approx(step[name], rel=1e-4, abs=1e-5), name
        for name, w in engine.state_dict().items():
            torch.testing.assert_close(w, theirs[name], atol=2e-6, rtol=1e-5, msg=name)
    finally:
        engine.close()


def test_orpo_llamafactory_nll_is_each_pairs_mean_response_nll():
    """pref.orpo_nll llamafactory: LLaMA-Factory's orpo loss, -a_c + β·(-logσ(log-odds)) per pair with a the mean
    response-token log-prob, averaged over the pairs (its `odds_ratio_loss` written out); one step's loss, NLL and
    weights."""
    cfg, policy, _ = models()
    pairs = make_pairs(seed=3)
    groups = [[preference_sequence(p["prompt_ids"], p["chosen_ids"], ROLE_CHOSEN),
               preference_sequence(p["prompt_ids"], p["rejected_ids"], ROLE_REJECTED)] for p in pairs]
    pref = PreferenceConfig(beta=0.5, loss="orpo", orpo_nll="llamafactory")
    loss, metrics, state = engine_step(cfg, policy, None, micro_batches(groups, True), "dpo", pref,
                                       LAYOUTS["stream-packed"][0])
    chosen, rejected = mean_logps(policy, pairs)
    log_odds = (chosen - rejected) - (torch.log1p(-torch.exp(chosen)) - torch.log1p(-torch.exp(rejected)))
    sft = -chosen
    total = (sft + 0.5 * -F.logsigmoid(log_odds)).mean()
    assert loss == pytest.approx(total.item(), rel=1e-5)
    assert metrics["nll_loss"] == pytest.approx(sft.mean().item(), rel=1e-5)
    for name, w in torch_step(policy, total).items():
        torch.testing.assert_close(state[name], w, atol=2e-6, rtol=1e-5, msg=name)


# ---------------------------------------------------------------------------------------------- SimPO


def mean_logps(policy, pairs) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's mean response-token log-prob of each pair's chosen and rejected sequence (with graph)."""
    from trl.experimental.orpo import ORPOTrainer

    seqs = [(p["prompt_ids"], p[k]) for k in ("chosen_ids", "rejected_ids") for p in pairs]
    width = max(len(a) + len(b) for a, b in seqs)
    ids = torch.tensor([a + b + [0] * (width - len(a) - len(b)) for a, b in seqs])
    labels = torch.tensor([[-100] * len(a) + b + [-100] * (width - len(a) - len(b)) for a, b in seqs])
    mask = (torch.arange(width) < torch.tensor([len(a) + len(b) for a, b in seqs])[:, None]).long()
    policy.train()
    logits = policy(input_ids=ids, attention_mask=mask, use_cache=False).logits
    logps = ORPOTrainer.get_batch_logps(logits, labels, average_log_prob=True)
    return logps[:len(pairs)], logps[len(pairs):]


def trl_simpo(policy, pairs, beta: float, gamma: float, smoothing: float, ftx: float):
    """TRL's CPOTrainer.cpo_loss (loss_type simpo) on the model's mean token log-probs, with the token-mean NLL of
    the chosen responses weighted by `ftx`."""
    from trl.experimental.cpo import CPOTrainer

    chosen, rejected = mean_logps(policy, pairs)
    nll = -(chosen * torch.tensor([len(p["chosen_ids"]) for p in pairs])).sum() / sum(len(p["chosen_ids"]) for p in pairs)
    me = SimpleNamespace(beta=beta, accelerator=SimpleNamespace(device="cpu"), loss_type="simpo", simpo_gamma=gamma,
                         label_smoothing=smoothing, alpha=0.0)
    losses, rew_c, rew_r = CPOTrainer.cpo_loss(me, chosen, rejected)
    total = losses.mean() + ftx * nll
    metrics = {"rewards/chosen": rew_c.mean().item(), "rewards/rejected": rew_r.mean().item(),
               "rewards/accuracies": (rew_c > rew_r).float().mean().item(),
               "rewards/margins": (rew_c - rew_r).mean().item(), "logps/chosen": chosen.mean().item(),
               "logps/rejected": rejected.mean().item()}
    return total.item(), metrics, torch_step(policy, total)


@pytest.mark.parametrize("layout", ["stream-packed", "resident-packed", "stream-unpacked"])
def test_simpo_equals_trl(layout):
    engine_kw, packed = LAYOUTS[layout]
    cfg, policy, _ = models()
    pairs = make_pairs(seed=1)
    groups = [[preference_sequence(p["prompt_ids"], p["chosen_ids"], ROLE_CHOSEN),
               preference_sequence(p["prompt_ids"], p["rejected_ids"], ROLE_REJECTED)] for p in pairs]
    pref = PreferenceConfig(beta=2.0, loss="simpo", simpo_gamma=0.4, label_smoothing=0.1, ftx=0.3)
    ours = engine_step(cfg, policy, None, micro_batches(groups, packed), "dpo", pref, engine_kw)
    theirs = trl_simpo(policy, pairs, 2.0, 0.4, 0.1, 0.3)
    assert_same(ours, theirs, DPO_METRICS)


def test_reference_free_losses_hold_no_reference():
    cfg = tiny_config("llama")
    engine = StreamingEngine(discover(cfg), EngineConfig(device="cpu"), OPT, 1, stage="dpo",
                             pref=PreferenceConfig(loss="simpo"))
    try:
        assert engine.pref.reference is None
    finally:
        engine.close()


# ---------------------------------------------------------------------------------------------- KTO


KTO_METRICS = ["rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "kl"]


def trl_kto(policy, ref, examples, beta, w_d, w_u, precompute: bool = False):
    """TRL's KTO loss and step; with `precompute`, the reference's log-probs of each example and its KL
    completion computed first (`compute_ref_log_probs`, as its precompute pass does) and read from the batch."""
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer

    from mt_ray.data import load_tiny_tokenizer

    args = trainer_args(KTOConfig, beta=beta, desirable_weight=w_d, undesirable_weight=w_u,
                        train_sampling_strategy="sequential")
    dummy = Dataset.from_list([{"prompt": "hi", "completion": " yes", "label": True},
                               {"prompt": "ho", "completion": " no", "label": False}])
    trainer = KTOTrainer(model=policy, ref_model=ref, args=args, train_dataset=dummy,
                         processing_class=load_tiny_tokenizer())
    if precompute:
        # What precompute_ref_log_probs=True sets, after init: its own pass at init would run the dummy's text
        # through a model whose vocabulary is smaller than the tokenizer's.
        trainer.precompute_ref_logps = True
        ref_logps, ref_kl_logps = trainer.compute_ref_log_probs(ref, trainer.data_collator(examples))
        examples = [{**ex, "ref_logps": r.item(), "ref_KL_logps": k.item()}
                    for ex, r, k in zip(examples, ref_logps, ref_kl_logps, strict=True)]
    return trl_loss_and_step(trainer, policy, examples)


def kto_examples(packed: bool) -> tuple[list[dict], list[dict]]:
    """Four KTO examples as TRL takes them, each with its KL completion, and as the engine's micro-batches."""
    pairs = make_pairs(seed=2)
    labels = [True, False, True, True]
    examples = [{"prompt_ids": p["prompt_ids"], "completion_ids": p["chosen_ids"], "label": lab}
                for p, lab in zip(pairs, labels, strict=True)]
    for i, ex in enumerate(examples):  # TRL's KL completions: each takes the one before's (the first, the last's)
        ex["KL_completion_ids"] = examples[i - 1]["completion_ids"]
    groups = [[preference_sequence(ex["prompt_ids"], ex["completion_ids"], ROLE_DESIRABLE if ex["label"] else ROLE_UNDESIRABLE),
               preference_sequence(ex["prompt_ids"], ex["KL_completion_ids"], ROLE_KL)] for ex in examples]
    return examples, [collate([[s for g in groups for s in g]], None, 0)] if packed else [collate(groups, None, 0)]


@pytest.mark.parametrize("layout", ["stream-packed", "stream-unpacked", "resident-packed"])
def test_kto_equals_trl(layout):
    engine_kw, packed = LAYOUTS[layout]
    cfg, policy, ref = models()
    examples, mbs = kto_examples(packed)
    pref = PreferenceConfig(beta=0.5, kto_chosen_weight=1.0, kto_rejected_weight=1.5)
    ours = engine_step(cfg, policy, ref, mbs, "kto", pref, engine_kw)
    theirs = trl_kto(policy, ref, examples, 0.5, 1.0, 1.5)
    assert_same(ours, theirs, KTO_METRICS)


@pytest.mark.parametrize("layout", ["stream-packed", "stream-unpacked"])
def test_kto_with_a_precomputed_reference_equals_trl(layout):
    """`pref.reference: precompute` as the run does it: the engine's `evaluate` collects each sequence's sum under
    the reference's weights (KL twins included), then the policy's step reads them from the batch (`ref_logps`)."""
    engine_kw, packed = LAYOUTS[layout]
    cfg, policy, ref = models()
    examples, mbs = kto_examples(packed)
    pref = PreferenceConfig(beta=0.5, kto_chosen_weight=1.0, kto_rejected_weight=1.5, reference="precompute")
    engine = StreamingEngine(discover(cfg), EngineConfig(device="cpu", compute_dtype="fp32", **engine_kw), OPT,
                             total_steps=1, stage="kto", pref=pref)
    try:
        assert engine.pref.reference is None  # no reference weights held
        engine.load_state_dict(ref.state_dict())
        with engine.pref.collecting() as sums:
            engine.evaluate(mbs)
        mbs = [{**mb, "ref_logps": s.reshape(mb["seq_role"].shape)} for mb, s in zip(mbs, sums, strict=True)]
    finally:
        engine.close()
    ours = engine_step(cfg, policy, None, mbs, "kto", pref, engine_kw)
    theirs = trl_kto(policy, ref, examples, 0.5, 1.0, 1.5, precompute=True)
    assert_same(ours, theirs, KTO_METRICS)
