"""Every training command written down in the README and the cluster definitions (comments included) would
start: module, flags, config file and overrides; and the checks reject a command that would not."""

from __future__ import annotations

import pytest

from tests.integration.infra.compose import ROOT
from tests.integration.infra.entrypoints import documented_commands, entrypoint_problems

DOCUMENTS = ["README.md", "infra/compose.yaml", "infra/ray/cluster.yaml", "infra/k8s/rayjob.yaml"]


@pytest.mark.parametrize("document", DOCUMENTS)
def test_documented_training_commands_resolve(document):
    commands = documented_commands((ROOT / document).read_text())
    assert commands, f"{document} shows how to start training"
    assert {c: entrypoint_problems(c) for c in commands} == dict.fromkeys(commands, [])


def test_comment_commands_are_joined_across_continuations():
    text = "# ray job submit -- \\\n#     python -m jobs.train --config jobs/configs/demo.yaml a.b=1\n"
    assert documented_commands(text) == ["python -m jobs.train --config jobs/configs/demo.yaml a.b=1"]


@pytest.mark.parametrize("command, expected", [
    ("python -m jobs.trian", "module 'jobs.trian' is not part of this repository"),
    ("python -m json.tool", "module 'json.tool' is not part of this repository"),
    ("python jobs/train.py", "not a `python -m MODULE` command"),
    ("python -m jobs.train --confg jobs/configs/demo.yaml", "unrecognized arguments: --confg"),
    ("python -m jobs.train --config jobs/configs/demo.yml", "config 'jobs/configs/demo.yml' does not exist"),
    ("python -m jobs.train training.micro_batch_size=0", "training.micro_batch_size"),
])
def test_a_command_that_would_not_start_is_rejected(command, expected):
    problems = entrypoint_problems(command)
    assert len(problems) == 1 and expected in problems[0], problems
