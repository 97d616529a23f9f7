"""GRPO equals TRL's `GRPOTrainer`: advantages, reward metrics, loss, clip and KL metrics, and the weights after
`num_iterations` steps on one rollout, for every loss_type, with beta 0 and above, on fixed completions.

TRL gets the completions through its own generation hook (`rollout_func`), scores them with the same reward
functions (their rewards are columns of the prompt rows, which TRL passes as keyword arguments), and
computes each micro-batch's loss with `_compute_loss`; its gradients take plain torch AdamW steps.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from mt_ray.data import load_tiny_tokenizer
from mt_ray.engine import EngineConfig, OptimizerConfig, StreamingEngine
from mt_ray.engine.grpo import GrpoConfig
from mt_ray.models.discovery import discover
from mt_ray.training.grpo.old_logps import keep_old_logps
from mt_ray.training.grpo.rewards import Rewards, advantages_and_metrics
from mt_ray.training.grpo.rollout import Rollout, completion_batches, cut_completions
from tests.tiny_models import VOCAB, reference_model, tiny_config

trl = pytest.importorskip("trl")
os.environ.setdefault("TQDM_DISABLE", "1")

OPT = OptimizerConfig(lr=1e-2, eps=1e-3, max_grad_norm=0.0, schedule="constant")  # as test_preference's
PROMPTS, G, MICRO, ACCUM, MAX_NEW = 2, 4, 4, 2, 6
EOS_IDS = {0, 2}  # the tokenizer's eos and the model's generation eos, as TRL collects them
PAD = 1


def score_a(prompts, completions, score_a, **_):
    return score_a


def score_b(prompts, completions, score_b, **_):
    return score_b


def fixed_rollout(seed: int = 0):
    """Prompts of different lengths (TRL pads them on the left), completions ending in an eos or cut at
    MAX_NEW (truncated), and two reward columns that differ within each group."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, VOCAB, (3 + 2 * i,), generator=g).tolist() for i in range(PROMPTS)]
    sampled = []
    for k in range(PROMPTS * G):
        n = MAX_NEW if k % 3 == 0 else 1 + k % MAX_NEW
        row = torch.randint(3, VOCAB, (n,), generator=g).tolist()
        sampled.append(row if n == MAX_NEW else row[:-1] + [2 if k % 2 else 0] + [PAD] * (MAX_NEW - n))
    completions, truncated = cut_completions(sampled, EOS_IDS, PAD)
    scores = torch.rand(PROMPTS * G, 2, generator=g).round(decimals=1).tolist()
    rows = [{"prompt": f"prompt {i}", "score_a": scores[i * G + j][0], "score_b": scores[i * G + j][1]}
            for i in range(PROMPTS) for j in range(G)]
    return Rollout([p for p in prompts for _ in range(G)], completions, truncated), rows


def models(seed: int = 0):
    cfg = tiny_config("llama")
    policy = reference_model(cfg, seed)
    ref = reference_model(cfg, seed + 1)  # another model, so the KL term is far from 0
    return cfg, policy, ref


def ours(cfg, policy, ref, rollout, rows, grpo: GrpoConfig, engine_kw: dict):
    rewards = Rewards(["score_a", "score_b"], [score_a, score_b], torch.tensor([1.0, 0.5]))
    columns = {k: [r[k] for r in rows] for k in ("score_a", "score_b")}
    per_func = rewards.score([r["prompt"] for r in rows], ["" for _ in rows], columns)
    advantages, reward_metrics = advantages_and_metrics(per_func, rewards, G, grpo.scale_rewards)
    batches = completion_batches(rollout, advantages, grpo.mask_truncated_completions, MICRO, PAD)
    engine = StreamingEngine(discover(cfg), EngineConfig(device="cpu", compute_dtype="fp32", **engine_kw), OPT,
                             total_steps=grpo.num_iterations, stage="grpo", grpo=grpo)
    try:
        engine.load_state_dict(policy.state_dict())
        if grpo.beta:
            engine.load_reference(ref.state_dict())
        for i in range(grpo.num_iterations):
            if i == 1:  # the first step's log-probs are the old policy's, as GrpoSteps keeps them
                keep_old_logps(engine, batches)
            result = engine.train_step(batches)
        metrics = {k: v.item() for k, v in result.metrics.items()}
        return advantages, reward_metrics, result.loss.item(), metrics, engine.state_dict()
    finally:
        engine.close()


def theirs(policy, ref, rollout, rows, grpo: GrpoConfig, tmp_path):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
    from trl.trainer.utils import split_tensor_dict

    def rollout_func(prompts, trainer):
        assert len(prompts) == len(rollout.prompt_ids)
        return {"prompt_ids": rollout.prompt_ids, "completion_ids": rollout.completion_ids, "logprobs": None}

    if grpo.beta:  # TRL builds its reference from the policy's path: the reference's weights are saved there
        ref.save_pretrained(tmp_path / "ref")
        policy.config._name_or_path = str(tmp_path / "ref")
    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False, per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=ACCUM, num_generations=G, max_completion_length=MAX_NEW, beta=grpo.beta,
        epsilon=grpo.epsilon, epsilon_high=grpo.epsilon_high, num_iterations=grpo.num_iterations,
        scale_rewards=grpo.scale_rewards, loss_type=grpo.loss_type, temperature=grpo.temperature,
        mask_truncated_completions=grpo.mask_truncated_completions, use_bias_correction_kl=grpo.use_bias_correction_kl,
        reward_weights=[1.0, 0.5])
    trainer = GRPOTrainer(model=policy, reward_funcs=[score_a, score_b], args=args,
                          train_dataset=Dataset.from_list(rows), processing_class=load_tiny_tokenizer(),
                          rollout_func=rollout_func)
    trainer.current_gradient_accumulation_steps = ACCUM
    policy.train()
    inputs = trainer._generate_and_score_completions(rows)
    reward_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    parts = split_tensor_dict({k: v for k, v in inputs.items() if k != "num_items_in_batch"}, ACCUM)
    opt = torch.optim.AdamW(policy.parameters(), lr=OPT.lr, betas=OPT.betas, eps=OPT.eps, weight_decay=0.0)
    for _ in range(grpo.num_iterations):
        opt.zero_grad()
        trainer._metrics["train"].clear()
        losses = [trainer._compute_loss(policy, {**part, "num_items_in_batch": inputs["num_items_in_batch"]})
                  for part in parts]
        torch.stack(losses).sum().backward()
        opt.step()
    metrics = {k: sum(v) / len(v) for k, v in trainer._metrics["train"].items()}  # TRL's log averages them
    state = {k: v.detach() for k, v in policy.state_dict().items()}
    return inputs["advantages"], reward_metrics, sum(x.item() for x in losses), metrics, state


CLIP_METRICS = ["clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
                "clip_ratio/high_max"]
REWARD_METRICS = ["reward", "reward_std", "frac_reward_zero_std", "rewards/score_a/mean", "rewards/score_a/std",
                  "rewards/score_b/mean", "rewards/score_b/std"]


def compare(grpo: GrpoConfig, tmp_path, engine_kw: dict | None = None):
    cfg, policy, ref = models()
    rollout, rows = fixed_rollout()
    mine = ours(cfg, policy, ref, rollout, rows, grpo, engine_kw or {"checkpoint_every": 2, "loss_chunk_tokens": 5})
    trl_out = theirs(policy, ref, rollout, rows, grpo, tmp_path)
    (adv, rew, loss, metrics, state), (t_adv, t_rew, t_loss, t_metrics, t_state) = mine, trl_out
    torch.testing.assert_close(adv, t_adv, rtol=1e-6, atol=1e-6)
    for name in REWARD_METRICS:
        assert rew[name] == pytest.approx(t_rew[name], rel=1e-6, abs=1e-7), name
    assert loss == pytest.approx(t_loss, rel=1e-5, abs=1e-6)
    for name in CLIP_METRICS + (["kl"] if grpo.beta else []):
        assert metrics[name] == pytest.approx(t_metrics[name], rel=1e-4, abs=1e-6), name
    for name, w in state.items():
        torch.testing.assert_close(w, t_state[name], atol=2e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("num_iterations", [1, 2])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_grpo_equals_trl(loss_type, beta, num_iterations, tmp_path):
    grpo = GrpoConfig(num_generations=G, max_completion_length=MAX_NEW, loss_type=loss_type, beta=beta,
                      num_iterations=num_iterations, epsilon=0.1, epsilon_high=0.15, temperature=0.7)
    compare(grpo, tmp_path)


@pytest.mark.parametrize("scale_rewards", ["batch", "none"])
def test_grpo_options_equal_trl_resident(scale_rewards, tmp_path):
    """The resident schedule, reward scaling over the batch or none, truncated completions masked, and the KL
    term without TRL's bias correction."""
    grpo = GrpoConfig(num_generations=G, max_completion_length=MAX_NEW, loss_type="grpo", beta=0.04,
                      num_iterations=2, scale_rewards=scale_rewards, mask_truncated_completions=True,
                      use_bias_correction_kl=scale_rewards == "batch")
    compare(grpo, tmp_path, {"schedule": "resident"})


class MatmulFlops(TorchDispatchMode):
    """FLOPs of the matrix products run under it, by torch's own formulas (FlopCounterMode's module tracker
    cannot follow the engine's `autograd.grad` on leaves)."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if (formula := flop_registry.get(func._overloadpacket)) is not None:
            self.flops += formula(*args, **kwargs, out_val=out)
        return out


@pytest.mark.parametrize("num_iterations", [1, 2])
def test_a_grpo_step_costs_what_an_sft_step_costs(num_iterations):
    """No pass beyond SFT's: the head's log-probs and their coefficients come from its one chunked forward, β 0
    streams no reference, and a rollout trained on twice keeps its first step's log-probs (no forward of its own)."""
    cfg, policy, _ = models()
    rollout, _ = fixed_rollout()
    batches = completion_batches(rollout, torch.linspace(-1, 1, PROMPTS * G), False, MICRO, PAD)
    grpo = GrpoConfig(num_generations=G, max_completion_length=MAX_NEW, num_iterations=num_iterations)

    def flops_per_step(stage: str) -> list[int]:
        engine = StreamingEngine(discover(cfg), EngineConfig(device="cpu", compute_dtype="fp32", loss_chunk_tokens=5),
                                 OPT, total_steps=num_iterations, stage=stage, grpo=grpo)
        engine.load_state_dict(policy.state_dict())
        out = []
        try:
            for i in range(num_iterations):
                if stage == "grpo" and i == 1:
                    keep_old_logps(engine, batches)
                with MatmulFlops() as counter:
                    engine.train_step(batches)
                out.append(counter.flops)
        finally:
            engine.close()
        return out

    sft = flops_per_step("sft")
    assert flops_per_step("grpo") == sft and sft[0] > 0
