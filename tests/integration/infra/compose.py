"""Load a compose file as `docker compose` would, and find what `docker compose up` would trip on.

`load_compose` parses the YAML (anchors and merge keys included) and substitutes `${VAR:-default}`
in every string value. `compose_problems` returns readable problems: schema violations (the
vendored compose-spec schema), images that are malformed or unpinned, builds whose context or
Dockerfile is missing, dependencies on unknown services or on a health no healthcheck reports,
dependency cycles and host ports published twice. An empty list means the file is sound.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[3]
COMPOSE_SCHEMA = ROOT / "tests" / "fixtures" / "schemas" / "compose-spec.json"

_VARIABLE = re.compile(r"\$(?:\$|\{(?P<braced>[^}]*)\}|(?P<named>[A-Za-z_][A-Za-z0-9_]*))")
_EXPRESSION = re.compile(r"^(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?-)(?P<default>.*))?$")
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
IMAGE_REFERENCE = re.compile(rf"^(?:[a-zA-Z0-9.-]+(?::[0-9]+)?/)?{_COMPONENT}(?:/{_COMPONENT})*"
                    r"(?::(?P<tag>[\w][\w.-]{0,127}))?(?:@sha256:[a-f0-9]{64})?$")
_ONE_SHOT_RESTARTS = {None, "no", "on-failure"}


class UndefinedVariableError(KeyError):
    """A `${VAR}` with no value and no default: compose would substitute an empty string."""


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """Compose's substitution: `${VAR}`, `$VAR`, `${VAR:-default}`, `${VAR-default}`; `$$` is a literal `$`."""

    def substitute(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        expr = m.group("braced") if m.group("braced") is not None else m.group("named")
        parsed = _EXPRESSION.match(expr)
        if parsed is None:
            raise ValueError(f"unsupported substitution ${{{expr}}}")
        name, op, default = parsed.group("name", "op", "default")
        if op == ":-":
            return env.get(name) or default
        if op == "-":
            return env.get(name, default)
        if name not in env:
            raise UndefinedVariableError(name)
        return env[name]

    return _VARIABLE.sub(substitute, text)


def interpolate_tree(node: Any, env: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [interpolate_tree(v, env) for v in node]
    if isinstance(node, dict):
        return {k: interpolate_tree(v, env) for k, v in node.items()}
    return node


def load_compose(path: Path, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The file as compose sees it with `env` as the environment (default: none, so defaults apply)."""
    return interpolate_tree(yaml.safe_load(path.read_text()), env or {})


def merge(base: Any, override: Any) -> Any:
    """`docker compose -f base -f override`: mappings merge key by key, anything else is replaced."""
    if isinstance(base, dict) and isinstance(override, dict):
        return {**base, **{k: merge(base.get(k), v) for k, v in override.items()}}
    return override


def schema_problems(doc: Mapping[str, Any]) -> list[str]:
    schema = json.loads(COMPOSE_SCHEMA.read_text())
    validator = jsonschema.Draft7Validator(schema)
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator.iter_errors(doc)]


def compose_problems(doc: Mapping[str, Any], base_dir: Path) -> list[str]:
    """Everything below, for a file whose relative paths start at `base_dir`."""
    problems = schema_problems(doc)
    services = doc.get("services", {})
    for name, service in services.items():
        problems += [f"{name}: {p}" for p in image_problems(service, base_dir)]
        problems += [f"{name}: {p}" for p in dependency_problems(service, services)]
    problems += cycle_problems(services)
    problems += port_problems(services)
    return problems


def image_problems(service: Mapping[str, Any], base_dir: Path) -> list[str]:
    """The image is a well-formed, pinned reference, or it is built from a context that exists."""
    problems = []
    build = service.get("build")
    if build is not None:
        build = {"context": build} if isinstance(build, str) else build
        context = base_dir / build.get("context", ".")
        dockerfile = context / build.get("dockerfile", "Dockerfile")
        if not context.is_dir():
            problems.append(f"build context {context} does not exist")
        elif not dockerfile.is_file():
            problems.append(f"Dockerfile {dockerfile} does not exist")
    image = service.get("image")
    if image is None and build is None:
        problems.append("neither image nor build")
    elif image is not None and (problem := image_reference_problem(image, pinned=build is None)):
        problems.append(problem)
    return problems


def image_reference_problem(image: str, pinned: bool = True) -> str | None:
    """Why `image` is not a valid reference (or, with `pinned`, not tied to a version or digest)."""
    m = IMAGE_REFERENCE.match(image)
    if m is None:
        return f"image {image!r} is not a valid reference"
    if pinned and m.group("tag") in (None, "latest") and "@sha256:" not in image:
        return f"image {image!r} is not pinned to a version"
    return None


def depends_on(service: Mapping[str, Any]) -> dict[str, str]:
    """`depends_on` in either syntax, as {service: condition}."""
    deps = service.get("depends_on") or {}
    if isinstance(deps, list):
        return dict.fromkeys(deps, "service_started")
    return {name: spec.get("condition", "service_started") for name, spec in deps.items()}


def dependency_problems(service: Mapping[str, Any], services: Mapping[str, Any]) -> list[str]:
    problems = []
    for dep, condition in depends_on(service).items():
        target = services.get(dep)
        if target is None:
            problems.append(f"depends on unknown service {dep!r}")
        elif condition == "service_healthy" and not _has_healthcheck(target):
            problems.append(f"waits for {dep!r} to be healthy, but {dep!r} has no healthcheck")
        elif condition == "service_completed_successfully" and target.get("restart") not in _ONE_SHOT_RESTARTS:
            problems.append(f"waits for {dep!r} to complete, but {dep!r} restarts {target.get('restart')!r}")
    return problems


def cycle_problems(services: Mapping[str, Any]) -> list[str]:
    """Compose refuses a dependency cycle; report the first one found."""
    state: dict[str, str] = {}

    def visit(name: str, path: list[str]) -> list[str]:
        if state.get(name) == "open":
            return [f"dependency cycle: {' -> '.join([*path, name])}"]
        if state.get(name) == "done" or name not in services:
            return []
        state[name] = "open"
        for dep in depends_on(services[name]):
            if found := visit(dep, [*path, name]):
                return found
        state[name] = "done"
        return []

    for name in services:
        if found := visit(name, []):
            return found
    return []


def published_ports(service: Mapping[str, Any]) -> list[tuple[str, int, str]]:
    """(host ip, host port, protocol) of every published port, short or long syntax."""
    out = []
    for port in service.get("ports", []):
        if isinstance(port, dict):
            if port.get("published") is not None:
                out.append((port.get("host_ip", ""), int(port["published"]), port.get("protocol", "tcp")))
            continue
        spec, _, protocol = str(port).partition("/")
        parts = spec.rsplit(":", 2)
        if len(parts) >= 2 and parts[-2]:
            out.append((parts[0] if len(parts) == 3 else "", int(parts[-2]), protocol or "tcp"))
    return out


def port_problems(services: Mapping[str, Any]) -> list[str]:
    seen: dict[tuple[str, int, str], str] = {}
    problems = []
    for name, service in services.items():
        for key in published_ports(service):
            if key in seen:
                problems.append(f"host port {key[1]}/{key[2]} published by both {seen[key]!r} and {name!r}")
            seen.setdefault(key, name)
    return problems


def _has_healthcheck(service: Mapping[str, Any]) -> bool:
    check = service.get("healthcheck") or {}
    return bool(check.get("test")) and not check.get("disable", False) and check.get("test") != ["NONE"]
