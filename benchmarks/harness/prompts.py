"""Prompt sets: Spec-Bench (stratified by category, MT-bench's second turns after the model's
own first answers) and folders of .txt prompts. A third of each set is held out for checking
a change (`split == "check"`): tune on the rest."""

from __future__ import annotations

import collections
import json
import random
from dataclasses import dataclass
from pathlib import Path

from harness.common import SHARED

QUESTIONS = SHARED / "data" / "spec_bench" / "question.jsonl"
CHECK_EVERY = 3  # every third question (by id) is held out


@dataclass
class Item:
    """One generation: a raw prompt, or chat messages (the last a user turn; a second turn's
    first answer is filled in from the first turn's text, `follows`)."""

    id: str
    category: str
    split: str  # "dev" or "check"
    prompt: str | None = None  # raw text (a base model)
    messages: list[dict] | None = None  # chat (an instruct model)
    follows: str | None = None  # the id of the first turn this second turn follows


def question_format(question: str) -> str:
    # A base model answers "Question/Answer" text.
    return f"Question: {question}\nAnswer:"


def stratified(rows: list[dict], per_category: int, seed: str, key: str) -> list[dict]:
    """Up to per_category rows of each category, drawn in a seeded order; in `key` order within."""
    by_cat: dict[str, list[dict]] = collections.defaultdict(list)
    for row in rows:
        by_cat[row["category"]].append(row)
    out = []
    for cat, group in by_cat.items():
        group = sorted(group, key=lambda r: r[key])
        random.Random(f"{seed}-{cat}").shuffle(group)
        out += sorted(group[:per_category], key=lambda r: r[key])
    return out


def spec_bench(per_category: int, chat: bool, two_turn_per_category: int | None = None, path: Path = QUESTIONS) -> list[Item]:
    """A stratified sample of Spec-Bench. Two-turn (MT-bench) categories take
    `two_turn_per_category` questions (default: half of per_category, so that both turns make
    about per_category texts)."""
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    two = two_turn_per_category if two_turn_per_category is not None else max(1, per_category // 2)
    single = [r for r in rows if len(r["turns"]) == 1]
    double = [r for r in rows if len(r["turns"]) > 1]
    items = []
    for row in sorted(stratified(single, per_category, "0", "question_id") + stratified(double, two, "0", "question_id"),
                      key=lambda r: r["question_id"]):
        qid, cat = row["question_id"], row["category"]
        split = "check" if qid % CHECK_EVERY == 0 else "dev"
        first = row["turns"][0]
        if chat:
            items.append(Item(f"q{qid}", cat, split, messages=[{"role": "user", "content": first}]))
        else:
            items.append(Item(f"q{qid}", cat, split, prompt=question_format(first)))
        if len(row["turns"]) > 1:
            second = row["turns"][1]
            items.append(Item(f"q{qid}t2", cat, split, follows=f"q{qid}",
                              messages=[{"role": "user", "content": second}] if chat else None,
                              prompt=None if chat else question_format(second)))
    return items


def folder(path: Path, chat: bool = False) -> list[Item]:
    """Every .txt file, read verbatim; the kind is the name up to its first '-'; names ending
    in '-check' are held out."""
    items = []
    for p in sorted(Path(path).glob("*.txt")):
        split = "check" if p.stem.endswith("-check") else "dev"
        text = p.read_text(encoding="utf-8")
        kind = p.stem.split("-", 1)[0]
        items.append(Item(p.stem, kind, split, messages=[{"role": "user", "content": text}]) if chat
                     else Item(p.stem, kind, split, prompt=text))
    return items


EDIT_TASKS = [
    "Add type hints to this function. Keep everything else as it is and reply with the code only.",
    "Add a docstring to this function. Keep the code as it is and reply with the code only.",
    "Rename the variables of this function to longer, descriptive names and reply with the code only.",
    "Rewrite this function with comments explaining each step. Reply with the code only.",
]


def code_edits(n: int, chat: bool = True, seed: int = 0,
               packages: tuple[str, ...] = ("click", "jinja2", "starlette", "rich", "typer")) -> list[Item]:
    """Edits of real functions nobody wrote for a benchmark: `n` functions of 8-40 lines drawn
    (seeded) from installed packages' sources, each with one of EDIT_TASKS, as a user turn.
    The kind is the package; a third is held out. Copy-heavy work, where lookup should pay.
    For a base model (not chat) the task and code, then the answer's opening code fence."""
    import ast
    import importlib.util

    found = []
    for package in packages:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            continue
        for path in sorted(Path(next(iter(spec.submodule_search_locations))).rglob("*.py")):
            source = path.read_text(encoding="utf-8", errors="replace")
            try:
                tree = ast.parse(source)
            except SyntaxError:
                continue
            lines = source.splitlines()
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and 8 <= node.end_lineno - node.lineno + 1 <= 40:
                    body = "\n".join(lines[node.lineno - 1 : node.end_lineno])
                    if body.startswith(("def ", "async def ")):  # (top level: no indentation to strip)
                        found.append((package, f"{path.name}:{node.name}", body))
    rng = random.Random(seed)
    rng.shuffle(found)
    items = []
    for i, (package, where, body) in enumerate(found[:n]):
        task = EDIT_TASKS[i % len(EDIT_TASKS)]
        text = f"{task}\n\n```python\n{body}\n```"
        item = Item(f"edit{i:02d}-{where}", package, "check" if i % CHECK_EVERY == 2 else "dev")
        if chat:
            item.messages = [{"role": "user", "content": text}]
        else:
            item.prompt = f"{text}\n\nAnswer:\n```python\n"
        items.append(item)
    return items
