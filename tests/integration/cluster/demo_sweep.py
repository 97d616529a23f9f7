"""The sweep the integration tests run: jobs/configs/demo.yaml made small, over jobs/spaces/demo.yaml."""

from tests.conftest import ROOT

STEPS = 6
# Short rows, 6 steps, an eval every 2 steps on 16 held-out rows, a checkpoint every 2 steps.
DEMO_OVERRIDES = [f"training.steps={STEPS}", "training.eval_every=2", "data.val_size=16", "data.max_seq_len=64",
                  "training.micro_batch_size=2", "training.grad_accum_steps=1", "training.export=false",
                  "engine.device=cpu", "checkpoint.every_steps=2"]
DEMO = str(ROOT / "jobs/configs/demo.yaml")
SPACE = str(ROOT / "jobs/spaces/demo.yaml")
