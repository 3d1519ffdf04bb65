"""Clock-free replays of every drafter and policy on known greedy texts
(specli.decoding.replay): per text and cost table, tokens per target pass, drafted and refused
tokens, and the modelled speedup over plain decoding (passes and draft-model tokens charged
from the table), with the oracle (the best choice of draft lengths for a drafter's proposals)."""

from __future__ import annotations

import time
from typing import Callable

from harness.common import log
from harness.costs import Costs
from harness.native_ngram import PORTS
from specli.decoding.drafters import PromptLookupDrafter
from specli.decoding.memory import TokenMemory
from specli.decoding.memory_drafter import MemoryDrafter, MemoryRecord
from specli.decoding.replay import DraftTrace, ReplayHybrid, TraceDrafter, candidates, oracle, replay
from specli.modes import DraftLength

AUTO = DraftLength.auto()
POLICY_MODULES = ("specli.decoding.policy.constants", "specli.decoding.policy.adaptive", "specli.decoding.policy.acceptance",
                  "specli.decoding.policy.costs", "specli.decoding.policy.store", "specli.decoding.drafters",
                  "specli.decoding.memory_drafter")


def policy_constants() -> dict[str, float]:
    """The policy's numeric tuned constants (policy/constants.py; not the saved file's format
    limits): name -> value, for a sweep."""
    import importlib

    module = importlib.import_module(POLICY_MODULES[0])
    return {name: value for name, value in vars(module).items()
            if name.isupper() and isinstance(value, (int, float)) and not isinstance(value, bool)}


def set_constant(name: str, value: str) -> None:
    """Set a policy constant in every module that holds it (they import each other's by name),
    and on the classes that hold it as an attribute (PromptLookupDrafter.RESYNC_DRAFT)."""
    import importlib

    found = False
    for module in map(importlib.import_module, POLICY_MODULES):
        owner, attr = module, name
        if "." in name:
            cls, attr = name.split(".", 1)
            owner = getattr(module, cls, None)
        if owner is not None and hasattr(owner, attr):
            old = getattr(owner, attr)
            setattr(owner, attr, type(old)(eval(value, {})) if not isinstance(old, tuple) else tuple(eval(value, {})))
            found = True
    if not found:
        raise SystemExit(f"no policy constant {name}")
    log(f"{name} = {value}")


def configs(has_trace: bool, lookup_n=(8, 16), draft_n=range(1, 9)) -> dict[str, tuple[str, object]]:
    """name -> (drafter kind, draft length). Native's draft-simple at N drafts exactly what
    specli's draft model does at a fixed N (greedy, up to N, no confidence cut by default:
    --spec-draft-p-min 0), so 'draft N' stands for both."""
    out: dict[str, tuple[str, object]] = {"lookup auto": ("lookup", AUTO), "lookup auto warm": ("lookup", AUTO)}
    out.update({f"lookup {n}": ("lookup", n) for n in lookup_n})
    out["memory auto"] = ("memory", AUTO)
    out.update({f"native {name}": ("native " + name, 64) for name in PORTS})
    if has_trace:
        out["draft auto"] = out["draft auto warm"] = ("draft", AUTO)
        out.update({f"draft {n}": ("draft", n) for n in draft_n})
        out["hybrid auto"] = out["hybrid auto warm"] = ("hybrid", AUTO)
    return out


def noise_of(spec: str | None) -> tuple[float, float, int] | None:
    """--noise SIGMA,STALLS[,SEED] as numbers (None: the policy is told the table's costs)."""
    if not spec:
        return None
    sigma, stalls, *seed = spec.split(",")
    return float(sigma), float(stalls), int(seed[0]) if seed else 0


def told(table: Callable[[int], float], noise: tuple[float, float, int], seed: str) -> Callable[[int], tuple[float, float]]:
    """What a pass is told to have taken on a shared machine: the table's cost times a
    log-normal factor, and now and then a stall (3x, at half the CPU use of a quiet pass: two
    threads' worth is 2.0). Seeded by `seed`, so that two policies replayed on one text meet
    the same machine."""
    import random
    import zlib

    sigma, stalls, salt = noise
    rng = random.Random(zlib.crc32(f"{salt}/{seed}".encode()))

    def timing(width: int) -> tuple[float, float]:
        factor = rng.lognormvariate(0.0, sigma)
        return (3 * factor * table(width), 1.0) if rng.random() < stalls else (factor * table(width), 2.0)

    return timing


def run_all(rows: list[dict], traces: dict[str, DraftTrace], tables: list[Costs], conf: dict[str, tuple[str, object]],
            progress: Callable[[str], None] = log, noise: tuple[float, float, int] | None = None) -> list[dict]:
    """Every configuration on every text under every table. Memory holds the texts before
    each one (in the given order), with one MemoryRecord per table, as a server process keeps.
    A configuration named '... warm' starts from what the same configuration saved after the
    text before (specli run's file between runs: a returning user), others from nothing.
    With `noise` (sigma, stall share, seed) the policies are told noisy timings (`told`); the
    figures still charge the table's costs."""
    from specli.decoding.policy import AdaptivePolicy, store

    out = []
    saved: dict[tuple[str, str], object] = {}
    memory = TokenMemory("bench", max_tokens=1_000_000)
    records = {t.label: MemoryRecord() for t in tables}
    t0 = time.perf_counter()
    for i, row in enumerate(rows):
        text = list(row["prompt_ids"]) + list(row["output_ids"])
        p = len(row["prompt_ids"])
        trace = traces.get(row["id"])
        res = {"id": row["id"], "category": row["category"], "split": row["split"], "n": len(text) - p, "tables": {}}
        lookup_proposals = candidates(text, p, PromptLookupDrafter())
        for costs in tables:
            table, t_draft = costs.table, costs.t_draft
            plain_s = (len(text) - p) * table(1)
            per = {}

            def drafter(kind: str, costs=costs, text=text, trace=trace, t_draft=t_draft):  # (this iteration's)
                if kind == "lookup":
                    return PromptLookupDrafter()
                if kind == "memory":
                    return MemoryDrafter(memory, record=records[costs.label])
                if kind.startswith("native "):
                    return PORTS[kind.removeprefix("native ")]()
                model = TraceDrafter(text, trace, t_draft)
                return model if kind == "draft" else ReplayHybrid(PromptLookupDrafter(), model)

            for name, (kind, n_draft) in conf.items():
                if kind in ("draft", "hybrid") and trace is None:
                    continue
                policy = None
                if n_draft == AUTO:
                    policy = AdaptivePolicy(AUTO.maximum)
                    if name.endswith(" warm") and saved.get((name, costs.label)) is not None:
                        policy.seed(saved[(name, costs.label)])
                timing = told(table, noise, f"{row['id']}/{name}/{costs.label}") if noise is not None else None
                r = replay(text, p, drafter(kind), n_draft, table, policy=policy, timing=timing)
                if name.endswith(" warm"):
                    state = policy.saved(1_800_000_000.0 + i)
                    saved[(name, costs.label)] = None if state is None else store.parse(store.dumps(state), now=1_800_000_001.0 + i)
                per[name] = {"tpp": r.tokens_per_pass, "drafted": r.drafted, "refused": r.refused,
                             "speedup": plain_s / r.modelled_s(table), "passes": r.passes}
            best = oracle(text, p, lookup_proposals, table)
            per["oracle lookup"] = {"tpp": best.tokens_per_pass, "drafted": sum(best.widths) - len(best.widths), "refused": 0,
                                    "speedup": plain_s / best.modelled_s, "passes": len(best.widths)}
            if trace is not None:
                proposals = [trace.draft(text, pos, 16)[0] for pos in range(p, len(text))]
                best = oracle(text, p, proposals, table, t_draft=t_draft)
                per["oracle draft"] = {"tpp": best.tokens_per_pass, "drafted": sum(best.widths) - len(best.widths), "refused": 0,
                                       "speedup": plain_s / best.modelled_s, "passes": len(best.widths)}
            res["tables"][costs.label] = per
        out.append(res)
        memory.add(text)
        if i % 20 == 0:
            progress(f"replay [{i + 1}/{len(rows)}] {time.perf_counter() - t0:.0f}s")
    return out
