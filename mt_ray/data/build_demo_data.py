"""Writes the built-in demo datasets under ``mt_ray/assets/demo_data/``.

The rows follow simple, fully learnable rules (arithmetic, word reversal, capital
cities, a calculator tool) so that a tiny model's loss falls visibly within a couple
of minutes of CPU training. Generated from a fixed seed so the files are reproducible:

    python -m mt_ray.data.build_demo_data
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parents[1] / "assets" / "demo_data"

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo",
    "Canada": "Ottawa", "Egypt": "Cairo", "Kenya": "Nairobi", "Peru": "Lima", "Chile": "Santiago",
    "Norway": "Oslo", "Sweden": "Stockholm", "Poland": "Warsaw", "Greece": "Athens", "India": "New Delhi",
    "China": "Beijing", "Brazil": "Brasilia", "Mexico": "Mexico City", "Cuba": "Havana", "Ireland": "Dublin",
}
WORDS = [
    "apple", "river", "stone", "garden", "planet", "yellow", "window", "silver", "mirror", "candle",
    "forest", "rocket", "guitar", "pencil", "summer", "tiger", "butter", "castle", "dragon", "island",
]
SYSTEM = "You are a concise assistant."
CALC_TOOLS = [{
    "name": "multiply",
    "description": "Multiply two integers.",
    "parameters": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    },
}]


def alpaca_row(rng: random.Random) -> dict[str, str]:
    """One instruction/response pair drawn from one of the three rules."""
    kind = rng.randrange(3)
    if kind == 0:
        a, b = rng.randrange(10, 50), rng.randrange(10, 50)
        return {"instruction": "Add the two numbers.", "input": f"{a} {b}", "output": str(a + b)}
    if kind == 1:
        word = rng.choice(WORDS)
        return {"instruction": "Reverse the word.", "input": word, "output": word[::-1]}
    country = rng.choice(sorted(CAPITALS))
    return {"instruction": f"What is the capital of {country}?", "input": "", "output": CAPITALS[country]}


def sharegpt_row(rng: random.Random) -> dict[str, object]:
    """A multi-turn conversation; one in four uses the calculator tool."""
    a, b = rng.randrange(2, 10), rng.randrange(2, 10)
    if rng.randrange(4) == 0:
        call = {"name": "multiply", "arguments": {"a": a, "b": b}}
        turns = [
            ("human", f"Use the calculator: {a} times {b}"),
            ("function_call", json.dumps(call)),
            ("observation", json.dumps({"result": a * b})),
            ("gpt", f"{a} times {b} is {a * b}."),
        ]
        return {"conversations": _turns(turns), "system": SYSTEM, "tools": json.dumps(CALC_TOOLS)}
    turns = [
        ("human", f"What is {a} plus {b}?"),
        ("gpt", f"{a} plus {b} is {a + b}."),
        ("human", "And doubled?"),
        ("gpt", f"Doubled, {a + b} is {2 * (a + b)}."),
    ]
    row: dict[str, object] = {"conversations": _turns(turns)}
    if rng.randrange(2):
        row["system"] = SYSTEM
    return row


def _turns(pairs: list[tuple[str, str]]) -> list[dict[str, str]]:
    return [{"from": role, "value": text} for role, text in pairs]


def registry() -> dict[str, dict[str, object]]:
    """The demo registry, in LLaMA-Factory's ``dataset_info.json`` format."""
    return {
        "demo_alpaca": {"file_name": "demo_alpaca.json"},
        "demo_sharegpt": {
            "file_name": "demo_sharegpt.jsonl",
            "formatting": "sharegpt",
            "columns": {"messages": "conversations", "system": "system", "tools": "tools"},
        },
    }


def _write(path: Path, text: str) -> None:
    """Write to a temporary name, then rename, so a crash never leaves half a file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def build(out_dir: Path = DEMO_DIR, seed: int = 0, n_alpaca: int = 400, n_sharegpt: int = 300) -> None:
    """Write ``demo_alpaca.json``, ``demo_sharegpt.jsonl`` and ``dataset_info.json`` to ``out_dir``."""
    rng = random.Random(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    alpaca = [alpaca_row(rng) for _ in range(n_alpaca)]
    sharegpt = [sharegpt_row(rng) for _ in range(n_sharegpt)]
    _write(out_dir / "demo_alpaca.json", json.dumps(alpaca, indent=1) + "\n")
    _write(out_dir / "demo_sharegpt.jsonl", "".join(json.dumps(r) + "\n" for r in sharegpt))
    _write(out_dir / "dataset_info.json", json.dumps(registry(), indent=2) + "\n")


if __name__ == "__main__":
    build()
