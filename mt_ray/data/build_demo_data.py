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
VENDORED = ("dpo_en_demo.json", "kto_en_demo.json")
"""Files shipped as their authors wrote them (LLaMA-Factory's data/, Apache-2.0), not generated: copied along."""

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
COLOURS = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (40, 60, 220), "yellow": (240, 220, 40),
           "black": (10, 10, 10), "white": (245, 245, 245)}
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


def mllm_row(rng: random.Random) -> dict[str, object]:
    """LLaMA-Factory's ``mllm_demo`` format: an image's colour, or whether two images share one."""
    first = rng.choice(sorted(COLOURS))
    if rng.randrange(3):
        turns = [("<image>What colour is this picture?", f"It is {first}.")]
        return {"messages": _mllm_turns(turns), "images": [f"mllm/{first}.png"]}
    second = rng.choice(sorted(COLOURS))
    answer = f"Yes, both are {first}." if first == second else f"No, one is {first} and one is {second}."
    turns = [("<image><image>Are these pictures the same colour?", answer)]
    return {"messages": _mllm_turns(turns), "images": [f"mllm/{first}.png", f"mllm/{second}.png"]}


def _mllm_turns(pairs: list[tuple[str, str]]) -> list[dict[str, str]]:
    return [turn for user, assistant in pairs
            for turn in ({"role": "user", "content": user}, {"role": "assistant", "content": assistant})]


def write_images(out_dir: Path) -> None:
    """One small PNG per colour (solid, 16x16: a few image tokens in any Qwen-VL processor)."""
    from PIL import Image

    out_dir.mkdir(parents=True, exist_ok=True)
    for name, rgb in COLOURS.items():
        tmp = out_dir / f"{name}.png.tmp"
        Image.new("RGB", (16, 16), rgb).save(tmp, format="PNG")
        os.replace(tmp, out_dir / f"{name}.png")


def math_prompt_row(rng: random.Random) -> dict[str, object]:
    """A GRPO prompt with its exact answer in a column of its own (passed to the reward functions)."""
    a, b = rng.randint(1, 50), rng.randint(1, 50)
    op = rng.choice("+-")
    return {"instruction": f"What is {a} {op} {b}? End with #### and the number.", "answer": a + b if op == "+" else a - b}


def registry() -> dict[str, dict[str, object]]:
    """The demo registry, in LLaMA-Factory's ``dataset_info.json`` format."""
    return {
        "demo_alpaca": {"file_name": "demo_alpaca.json"},
        "demo_sharegpt": {
            "file_name": "demo_sharegpt.jsonl",
            "formatting": "sharegpt",
            "columns": {"messages": "conversations", "system": "system", "tools": "tools"},
        },
        "demo_mllm": {  # as LLaMA-Factory's mllm_demo entry: images relative to this folder
            "file_name": "demo_mllm.json",
            "formatting": "sharegpt",
            "columns": {"messages": "messages", "images": "images"},
            "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"},
        },
        # GRPO prompts: alpaca rows without a response; their `answer` column goes to the reward functions.
        "demo_math_prompts": {"file_name": "demo_math_prompts.json"},
        # LLaMA-Factory's own ranking demo (data/dpo_en_demo.json, Apache-2.0), copied unchanged, with its entry.
        "dpo_en_demo": {
            "file_name": "dpo_en_demo.json",
            "ranking": True,
            "formatting": "sharegpt",
            "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"},
        },
        # LLaMA-Factory's own KTO demo (data/kto_en_demo.json, Apache-2.0), copied unchanged, with its entry.
        "kto_en_demo": {
            "file_name": "kto_en_demo.json",
            "formatting": "sharegpt",
            "columns": {"messages": "messages", "kto_tag": "label"},
            "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"},
        },
    }


def _write(path: Path, text: str) -> None:
    """Write to a temporary name, then rename, so a crash never leaves half a file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def build(out_dir: Path = DEMO_DIR, seed: int = 0, n_alpaca: int = 400, n_sharegpt: int = 300,
          n_mllm: int = 120, n_math: int = 200) -> None:
    """Write ``demo_alpaca.json``, ``demo_sharegpt.jsonl``, ``demo_mllm.json`` with its images under ``mllm/``,
    ``demo_math_prompts.json`` (GRPO prompts) and ``dataset_info.json`` to ``out_dir``."""
    rng = random.Random(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    alpaca = [alpaca_row(rng) for _ in range(n_alpaca)]
    sharegpt = [sharegpt_row(rng) for _ in range(n_sharegpt)]
    _write(out_dir / "demo_alpaca.json", json.dumps(alpaca, indent=1) + "\n")
    _write(out_dir / "demo_sharegpt.jsonl", "".join(json.dumps(r) + "\n" for r in sharegpt))
    mllm_rng = random.Random(f"mllm/{seed}")  # its own stream: the text demos stay as they were
    _write(out_dir / "demo_mllm.json", json.dumps([mllm_row(mllm_rng) for _ in range(n_mllm)], indent=1) + "\n")
    write_images(out_dir / "mllm")
    math_rng = random.Random(f"math/{seed}")  # its own stream too
    _write(out_dir / "demo_math_prompts.json", json.dumps([math_prompt_row(math_rng) for _ in range(n_math)], indent=1) + "\n")
    for name in VENDORED if out_dir.resolve() != DEMO_DIR else ():
        _write(out_dir / name, (DEMO_DIR / name).read_text(encoding="utf-8"))
    _write(out_dir / "dataset_info.json", json.dumps(registry(), indent=2) + "\n")


if __name__ == "__main__":
    build()
