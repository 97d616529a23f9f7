"""GRPO (`training.stage: grpo`): prompts, rollouts, rewards and the steps that train on them."""
