"""A Dockerfile and its build context, checked the way `docker build` would use them, with no daemon.

`Dockerfile` parses the instructions (continuations, comments, `ARG` defaults in `FROM`) and
maps every `COPY` into the image's file system. `DockerIgnore` applies `.dockerignore` with
Docker's rules (Go-style globs, `**`, `!` re-includes, the last matching pattern wins, and a
file is excluded when it or any parent directory matches). `context_problems` lists what
would break the build: a COPY source that is missing or ignored, a FROM that is not a pinned
image reference.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from tests.integration.infra.compose import image_reference_problem

_ARG_REF = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?")


@dataclass
class Instruction:
    keyword: str
    args: str
    line: int

    def words(self) -> list[str]:
        """Exec (JSON) form or shell-split words."""
        if self.args.startswith("["):
            return json.loads(self.args)
        return shlex.split(self.args)


@dataclass
class Copy:
    sources: list[str]
    dest: str  # absolute path in the image
    line: int


@dataclass
class Dockerfile:
    instructions: list[Instruction]
    args: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> Dockerfile:
        instructions, pending, start = [], "", 0
        for number, raw in enumerate(text.splitlines(), start=1):
            line = raw.strip()
            if not pending and (not line or line.startswith("#")):
                continue  # comments and parser directives
            if pending and line.startswith("#"):
                continue  # comment lines inside a continuation are dropped by Docker too
            start = start if pending else number
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            keyword, _, args = (pending + line).partition(" ")
            instructions.append(Instruction(keyword.upper(), args.strip(), start))
            pending = ""
        parsed = cls(instructions)
        for ins in instructions:
            if ins.keyword == "ARG" and "=" in ins.args:
                name, value = ins.args.split("=", 1)
                parsed.args.setdefault(name, value.strip('"'))
        return parsed

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def base_images(self) -> list[str]:
        """FROM images with ARG defaults substituted (stages named earlier are not images)."""
        stages: set[str] = set()
        images = []
        for ins in self.all("FROM"):
            words = [w for w in ins.args.split() if not w.startswith("--")]
            image = _ARG_REF.sub(lambda m: self.args.get(m.group(1), m.group(0)), words[0])
            if image not in stages:
                images.append(image)
            if len(words) == 3 and words[1].lower() == "as":
                stages.add(words[2])
        return images

    def copies(self) -> list[Copy]:
        """COPY/ADD from the build context (not `--from=` another stage), destinations made absolute."""
        workdir, out = "/", []
        for ins in self.instructions:
            if ins.keyword == "WORKDIR":
                workdir = posixpath.join(workdir, ins.args)
            elif ins.keyword in ("COPY", "ADD"):
                words = ins.words()
                flags = [w for w in words if w.startswith("--")]
                paths = [w for w in words if not w.startswith("--")]
                if not any(f.startswith("--from=") for f in flags):
                    out.append(Copy(paths[:-1], posixpath.normpath(posixpath.join(workdir, paths[-1])), ins.line))
        return out

    def final_workdir(self) -> str:
        workdir = "/"
        for ins in self.all("WORKDIR"):
            workdir = posixpath.join(workdir, ins.args)
        return workdir

    def image_files(self, context: Path, ignore: DockerIgnore) -> dict[str, str]:
        """{path in the image: path in the context} for every file the COPY instructions bring in.

        A directory source copies its contents into the destination; file sources land in it
        by name when there are several or it ends in `/`, else they become it.
        """
        files = {}
        for copy in self.copies():
            into_dir = len(copy.sources) > 1 or copy.dest.endswith("/")
            for source in (posixpath.normpath(s) for s in copy.sources):
                if (context / source).is_dir():
                    for rel in context_files(context, ignore, under=source):
                        files[posixpath.join(copy.dest, posixpath.relpath(rel, source))] = rel
                elif (context / source).is_file() and not ignore.excluded(source):
                    files[posixpath.join(copy.dest, posixpath.basename(source)) if into_dir else copy.dest] = source
        return files


@dataclass
class _Pattern:
    regex: re.Pattern
    exclusion: bool
    text: str


class DockerIgnore:
    """`.dockerignore` rules; `excluded("a/b.py")` says whether that context path stays out."""

    def __init__(self, lines: list[str]):
        self.patterns = []
        for raw in lines:
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            exclusion = line.startswith("!")
            text = posixpath.normpath(line.lstrip("!").strip().lstrip("/"))
            self.patterns.append(_Pattern(re.compile(_glob_regex(text)), exclusion, text))

    @classmethod
    def for_context(cls, context: Path) -> DockerIgnore:
        path = context / ".dockerignore"
        return cls(path.read_text().splitlines() if path.is_file() else [])

    def excluded(self, path: str) -> bool:
        parents = path.split("/")[:-1]
        candidates = [path] + ["/".join(parents[: i + 1]) for i in range(len(parents))]
        matched = False
        for p in self.patterns:
            if any(p.regex.fullmatch(c) for c in candidates):
                matched = not p.exclusion
        return matched

    def pruned(self, directory: str) -> bool:
        """Excluded, and no `!` pattern could let anything under it back in: the walk skips it."""
        if not self.excluded(directory):
            return False
        return not any(p.exclusion and (p.text.startswith(directory + "/") or "*" in p.text) for p in self.patterns)


def context_files(context: Path, ignore: DockerIgnore, under: str = "") -> list[str]:
    """Context-relative paths of the files (under `under`) that the daemon would receive."""
    out = []
    for dirpath, dirnames, filenames in os.walk(context / under):
        rel_dir = Path(dirpath).relative_to(context).as_posix()
        rel_dir = "" if rel_dir == "." else rel_dir + "/"
        dirnames[:] = [d for d in dirnames if not ignore.pruned(rel_dir + d)]
        out += [rel_dir + f for f in filenames if not ignore.excluded(rel_dir + f)]
    return sorted(out)


def context_problems(dockerfile: Path, context: Path) -> list[str]:
    """What `docker build -f dockerfile context` would fail on, or pull unpinned."""
    df = Dockerfile.parse(dockerfile.read_text())
    ignore = DockerIgnore.for_context(context)
    problems = [f"FROM: {p}" for image in df.base_images() if (p := image_reference_problem(image))]
    for copy in df.copies():
        for source in (posixpath.normpath(s) for s in copy.sources):
            src = context / source
            if not src.exists():
                problems.append(f"line {copy.line}: COPY source {source!r} does not exist")
            elif src.is_file() and ignore.excluded(source):
                problems.append(f"line {copy.line}: COPY source {source!r} is excluded by .dockerignore")
            elif src.is_dir() and not context_files(context, ignore, under=source):
                problems.append(f"line {copy.line}: .dockerignore leaves nothing of {source!r} in the context")
    return problems


def _glob_regex(pattern: str) -> str:
    """Docker's glob: `*` and `?` stay inside one path segment, `**` crosses segments."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pattern[i] == "[":
            end = pattern.find("]", i)
            out, i = out + pattern[i : end + 1], end + 1
        elif pattern[i] == "\\" and i + 1 < len(pattern):
            out, i = out + re.escape(pattern[i + 1]), i + 2
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return out
