"""infra/Dockerfile and infra/mlflow.Dockerfile build from the repository root: every COPY source is in the
context, the context holds what `pip install .` needs and little else, and the image runs the job configs."""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.integration.infra.compose import ROOT
from tests.integration.infra.docker_context import Dockerfile, DockerIgnore, context_files, context_problems
from tests.integration.infra.entrypoints import entrypoint_problems

if sys.version_info >= (3, 11):
    import tomllib
else:  # the dev extra installs tomli there
    import tomli as tomllib

IMAGE = ROOT / "infra" / "Dockerfile"
DOCKERFILES = [IMAGE, ROOT / "infra" / "mlflow.Dockerfile"]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
INSTALL_METADATA = ["pyproject.toml", PYPROJECT["project"]["readme"], "constraints.txt"]


def package_files() -> list[str]:
    """What `pip install .` reads: pyproject.toml, its readme and every tracked file of the packages it finds."""
    include = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return INSTALL_METADATA[:2] + [p for p in tracked
                                   if "/" in p and any(fnmatch.fnmatch(p.split("/")[0], pat) for pat in include)]


def image_files() -> dict[str, str]:
    return Dockerfile.parse(IMAGE.read_text()).image_files(ROOT, DockerIgnore.for_context(ROOT))


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_builds_from_the_repository_root(dockerfile):
    assert context_problems(dockerfile, ROOT) == []


def test_context_is_small_and_only_what_the_images_copy():
    files = context_files(ROOT, DockerIgnore.for_context(ROOT))
    outside = [f for f in files if f not in INSTALL_METADATA and f.split("/")[0] not in ("mt_ray", "jobs")]
    assert outside == []
    assert not any("__pycache__" in f or f.endswith(".pyc") for f in files)
    assert sum((ROOT / f).stat().st_size for f in files) < 4 << 20


def test_every_package_file_reaches_the_image():
    copied = set(image_files().values())
    missing = [f for f in package_files() if f not in copied]
    assert missing == [] and "mt_ray/assets/tiny_tokenizer/tokenizer.json" in copied


def test_image_installs_extras_that_exist_with_the_constraints():
    runs = " ".join(i.args for i in Dockerfile.parse(IMAGE.read_text()).all("RUN"))
    extras = re.search(r'pip install "\.\[([a-z,]+)\]" -c constraints\.txt', runs)
    assert extras is not None, "the package is installed with its extras and constraints.txt"
    assert set(extras.group(1).split(",")) == {"tracking", "cluster"} <= set(PYPROJECT["project"]["optional-dependencies"])
    mlflow_runs = " ".join(i.args for i in Dockerfile.parse(DOCKERFILES[1].read_text()).all("RUN"))
    assert "-c /tmp/constraints.txt" in mlflow_runs and "mlflow==" in (ROOT / "constraints.txt").read_text()


def test_torch_pin_matches_the_makefile():
    pinned = re.search(r"torch==([\w.]+)", (ROOT / "Makefile").read_text()).group(1)
    assert Dockerfile.parse(IMAGE.read_text()).args["TORCH_VERSION"] == pinned


def test_default_command_and_job_configs_resolve_in_the_image():
    df = Dockerfile.parse(IMAGE.read_text())
    files = image_files()
    workdir = df.final_workdir()
    assert entrypoint_problems(df.all("CMD")[-1].words()) == []
    assert f"{workdir}/jobs/train.py" in files
    for config in sorted((ROOT / "jobs" / "configs").glob("*.yaml")):
        assert f"{workdir}/jobs/configs/{config.name}" in files
        assert entrypoint_problems(["python", "-m", "jobs.train", "--config", f"jobs/configs/{config.name}"]) == []


def test_every_cluster_definition_runs_this_image_at_the_project_version():
    """compose builds it, `make image` tags it, `ray up` and KubeRay pull it: one name, one version."""
    compose = yaml.safe_load((ROOT / "infra" / "compose.yaml").read_text())["services"]
    k8s = yaml.safe_load_all((ROOT / "infra" / "k8s" / "raycluster.yaml").read_text())
    refs = {
        "compose": {s["image"] for s in compose.values() if s.get("build", {}).get("dockerfile") == "infra/Dockerfile"},
        "make image": {re.search(r"^IMAGE \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)},
        "ray up": {yaml.safe_load((ROOT / "infra" / "ray" / "cluster.yaml").read_text())["docker"]["image"]},
        "KubeRay": {c["image"] for d in k8s if d["kind"] == "RayCluster"
                    for g in [d["spec"]["headGroupSpec"], *d["spec"]["workerGroupSpecs"]]
                    for c in g["template"]["spec"]["containers"]},
    }
    version = PYPROJECT["project"]["version"]
    assert {where: {r.rsplit("/", 1)[-1] for r in found} for where, found in refs.items()} == dict.fromkeys(
        refs, {f"mt-ray:{version}"})


@pytest.fixture
def context_copy(tmp_path) -> Path:
    """The build's inputs in a scratch context, to break one thing at a time."""
    for name in [".dockerignore", *INSTALL_METADATA]:
        shutil.copy(ROOT / name, tmp_path / name)
    for name in ("mt_ray", "jobs"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "infra").mkdir()
    shutil.copy(IMAGE, tmp_path / "infra" / "Dockerfile")
    return tmp_path


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))


def _without_lines(problems: list[str]) -> list[str]:
    return [re.sub(r"^line \d+: ", "", p) for p in problems]


def test_context_check_rejects_an_ignored_copy_source(context_copy):
    _edit(context_copy / ".dockerignore", "!README.md\n", "")
    problems = context_problems(context_copy / "infra" / "Dockerfile", context_copy)
    assert _without_lines(problems) == ["COPY source 'README.md' is excluded by .dockerignore"]


def test_context_check_rejects_a_missing_copy_source_and_an_unpinned_base(context_copy):
    _edit(context_copy / "infra" / "Dockerfile", "COPY jobs ./jobs", "COPY jobs notebooks ./")
    _edit(context_copy / "infra" / "Dockerfile", "cudnn-runtime-ubuntu24.04", "cudnn-runtime-ubuntu24.04@sha1:x")
    problems = context_problems(context_copy / "infra" / "Dockerfile", context_copy)
    assert "COPY source 'notebooks' does not exist" in _without_lines(problems)
    assert any(p.startswith("FROM: image 'nvidia/cuda:") and "not a valid reference" in p for p in problems)


def test_context_check_rejects_a_directory_the_ignore_file_empties(context_copy):
    (context_copy / ".dockerignore").write_text((context_copy / ".dockerignore").read_text() + "jobs/**\n")
    problems = context_problems(context_copy / "infra" / "Dockerfile", context_copy)
    assert _without_lines(problems) == [".dockerignore leaves nothing of 'jobs' in the context"]


def test_an_ignored_asset_never_reaches_the_image(context_copy):
    (context_copy / ".dockerignore").write_text((context_copy / ".dockerignore").read_text() + "**/*.jinja\n")
    df = Dockerfile.parse((context_copy / "infra" / "Dockerfile").read_text())
    copied = set(df.image_files(context_copy, DockerIgnore.for_context(context_copy)).values())
    assert "mt_ray/assets/tiny_tokenizer/chat_template.jinja" not in copied
    assert "mt_ray/assets/tiny_tokenizer/tokenizer.json" in copied


@pytest.mark.parametrize("patterns, path, excluded", [
    (["*", "!src"], "src/pkg/mod.py", False),  # a re-included directory brings back its contents
    (["*", "!src"], "tests/test_x.py", True),  # `*` matches the top-level directory, so all below it
    (["*", "!src", "**/__pycache__"], "src/a/__pycache__/m.pyc", True),
    (["docs", "!docs/keep.md"], "docs/keep.md", False),  # the last matching pattern wins
    (["docs", "!docs/keep.md"], "docs/other.md", True),
    (["*.md"], "sub/readme.md", False),  # `*` stays inside one path segment
    (["**/*.md"], "sub/deep/readme.md", True),
    (["data?.csv"], "data1.csv", True),
    (["/build/"], "build/out.o", True),  # leading and trailing slashes are cleaned away
])
def test_dockerignore_follows_docker_rules(patterns, path, excluded):
    assert DockerIgnore(patterns).excluded(path) is excluded
