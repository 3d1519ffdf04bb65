"""What `--draft-max auto` keeps between runs, and how a saved file is read back (pure: no I/O here).

Only facts about the machine and the model pair are kept: what a target pass over n tokens
costs (the median of the run's recent uncontended passes, with how many and when), what the
context adds to a pass, the loop's time between passes, a drafter's cost per token, and the
CPU use of an uncontended pass (to recognise contention). Acceptance belongs to the text: a
draft model's (partly the pair's) seeds the next run only as a weak prior (a couple of verdicts
per draft position), which its first evidence overrides; prompt lookup's is kept for
`specli cache` to show, and the next run starts from the prior. Nothing about probing is kept.

A file is checked whole before anything in it is used: its size, JSON (nested deeper than
Python's parser goes: refused), every field's type and range (finite, positive, within
physical bounds), timestamps not in the future, and costs that agree with each other (a pass
over k tokens costs at most NOISE times k one-token passes). Anything else makes the whole file
ignored, with a reason (`Rejected`).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field

from specli.decoding.policy.constants import NOISE, PRIOR_WEIGHT

FORMAT = "specli-policy"
VERSION = 4
MAX_BYTES = 256 * 1024  # a saved file is a few kB; anything much larger is not ours
MAX_SOURCES = 8  # drafters a file may name (specli has three)
MAX_WIDTH = 65  # pass sizes: up to specli.modes.MAX_DRAFT drafts and the token before them (draft positions: one fewer)
MAX_AGE_S = 30 * 86400.0  # saved pass costs older than this are dropped (the machine changes)
FUTURE_SLACK_S = 86400.0  # a timestamp later than now by more than this is damage, not clock skew
# Any duration in the file (a pass, a draft token, the loop's gap; a context slope's one token
# of context for one token), and the most CPU seconds per second (threads) a pass may use.
MIN_PASS_S, MAX_PASS_S = 1e-7, 120.0
MAX_UTILIZATION = 1024.0


class Rejected(ValueError):
    """A saved file that is ignored; the message says why (for --verbose and `specli cache`)."""


@dataclass
class Cost:
    """A measured duration: the median of `samples` timings, the latest taken at `at` (Unix time)."""

    seconds: float
    samples: int
    at: float


@dataclass
class SourceRecord:
    """A drafter's facts: cost per drafted token, start-up cost of a drafting step, and weak
    priors on acceptance (per position: [judged, accepted]) and, for a draft model, on how far
    its confidence can be trusted (per bin: [judged, accepted]; and how often its first token
    falls in each bin)."""

    t_draft: Cost | None = None
    start_s: Cost | None = None
    runs_model: bool = False  # a draft model (its acceptance is partly the pair's), not lookup
    acceptance: list[tuple[float, float]] = field(default_factory=list)
    calibration: list[tuple[float, float]] = field(default_factory=list)
    first_seen: list[float] = field(default_factory=list)


@dataclass
class Saved:
    """Everything a policy file holds. `key` says what it is for (target, drafter, threads...),
    for people: the file name already encodes it."""

    passes: dict[int, Cost] = field(default_factory=dict)  # T(n) as at no context
    context_one: float = 0.0  # what a token of context adds to a one-token pass, per token
    context_wide: float = 0.0  # likewise per token of a wider pass
    plain_gap_s: float | None = None
    draft_gap_s: float | None = None
    utilization: float | None = None  # CPU seconds per second of an uncontended pass
    sources: dict[str, SourceRecord] = field(default_factory=dict)
    key: dict[str, object] = field(default_factory=dict)
    saved_at: float = 0.0

    @property
    def empty(self) -> bool:
        return not self.passes and not self.sources


def _cost_json(c: Cost | None) -> dict | None:
    return None if c is None else {"s": c.seconds, "samples": c.samples, "at": c.at}


def to_json(saved: Saved) -> dict:
    """The file's content (a JSON-ready dict)."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "key": saved.key,
        "saved_at": saved.saved_at,
        "passes": {str(n): _cost_json(c) for n, c in sorted(saved.passes.items())},
        "context_one": saved.context_one,
        "context_wide": saved.context_wide,
        "plain_gap_s": saved.plain_gap_s,
        "draft_gap_s": saved.draft_gap_s,
        "utilization": saved.utilization,
        "sources": {
            name: {
                "t_draft": _cost_json(s.t_draft),
                "start_s": _cost_json(s.start_s),
                "runs_model": s.runs_model,
                "acceptance": [list(p) for p in s.acceptance],
                "calibration": [list(p) for p in s.calibration],
                "first_seen": list(s.first_seen),
            }
            for name, s in saved.sources.items()
        },
    }


def dumps(saved: Saved) -> str:
    # allow_nan=False: a NaN that slipped through is an error here, never a saved value.
    return json.dumps(to_json(saved), allow_nan=False, sort_keys=True)


def _no_constants(name: str):
    raise Rejected(f"it holds {name}, which no measurement is")


def _number(value, what: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Rejected(f"{what} is {type(value).__name__}, not a number")
    value = float(value)
    if not math.isfinite(value) or not low <= value <= high:
        raise Rejected(f"{what} = {value!r} is outside {low:g}..{high:g}")
    return value


def _optional(value, what: str, low: float, high: float) -> float | None:
    return None if value is None else _number(value, what, low, high)


def _dict(value, what: str) -> dict:
    if not isinstance(value, dict):
        raise Rejected(f"{what} is {type(value).__name__}, not an object")
    return value


def _flag(value, what: str) -> bool:
    if not isinstance(value, bool):
        raise Rejected(f"{what} is {type(value).__name__}, not true or false")
    return value


def _list(value, what: str, limit: int) -> list:
    if not isinstance(value, list):
        raise Rejected(f"{what} is {type(value).__name__}, not a list")
    if len(value) > limit:
        raise Rejected(f"{what} has {len(value)} entries, more than {limit}")
    return value


def _time(value, what: str, now: float) -> float:
    return _number(value, what, 1.5e9, now + FUTURE_SLACK_S)  # after 2017, not in the future


def _cost(value, what: str, now: float, low: float, high: float) -> Cost | None:
    if value is None:
        return None
    value = _dict(value, what)
    seconds = _number(value.get("s"), f"{what}.s", low, high)
    samples = value.get("samples")
    if isinstance(samples, bool) or not isinstance(samples, int) or not 1 <= samples <= 10**9:
        raise Rejected(f"{what}.samples is not a count")
    return Cost(seconds, samples, _time(value.get("at"), f"{what}.at", now))


def _pairs(value, what: str, limit: int) -> list[tuple[float, float]]:
    out = []
    for i, pair in enumerate(_list(value, what, limit)):
        pair = _list(pair, f"{what}[{i}]", 2)
        if len(pair) != 2:
            raise Rejected(f"{what}[{i}] is not [judged, accepted]")
        judged = _number(pair[0], f"{what}[{i}] judged", 0.0, 1e6)
        accepted = _number(pair[1], f"{what}[{i}] accepted", 0.0, judged)
        if judged > PRIOR_WEIGHT:  # (a file written by hand with more weight: scaled to a prior's)
            judged, accepted = PRIOR_WEIGHT, accepted * PRIOR_WEIGHT / judged
        out.append((judged, accepted))
    return out


def parse(text: str, now: float | None = None) -> Saved:
    """A saved file's content, checked whole. Raises Rejected naming the first problem."""
    now = time.time() if now is None else now
    if len(text) > MAX_BYTES:
        raise Rejected(f"it is {len(text)} bytes, more than {MAX_BYTES}")
    try:
        data = json.loads(text, parse_constant=_no_constants)
    except Rejected:
        raise
    except RecursionError:
        raise Rejected("it is nested deeper than any saved file is") from None
    except ValueError as err:
        raise Rejected(f"it is not JSON ({err})") from None
    data = _dict(data, "the file")
    if data.get("format") != FORMAT:
        raise Rejected(f"it is not a {FORMAT} file")
    if data.get("version") != VERSION:
        raise Rejected(f"it is version {data.get('version')!r}, this specli reads {VERSION}")
    saved = Saved(saved_at=_time(data.get("saved_at"), "saved_at", now))
    key = _dict(data.get("key", {}), "key")
    for name, value in key.items():
        if not isinstance(value, (str, int, float, type(None))) or isinstance(value, float) and not math.isfinite(value):
            raise Rejected(f"key.{name} is not a plain value")
        if isinstance(value, str) and len(value) > 4096:
            raise Rejected(f"key.{name} is too long")
    saved.key = dict(key)
    passes = _dict(data.get("passes", {}), "passes")
    for width, value in passes.items():
        if not (isinstance(width, str) and width.isdigit() and len(width) <= 3 and 1 <= int(width) <= MAX_WIDTH):
            raise Rejected(f"passes has a pass size {width[:20]!r}")
        cost = _cost(value, f"passes.{width}", now, MIN_PASS_S, MAX_PASS_S)
        if cost is not None and now - cost.at <= MAX_AGE_S:  # old measurements age out
            saved.passes[int(width)] = cost
    one = saved.passes.get(1)
    if one is not None:
        for width, cost in saved.passes.items():
            if cost.seconds > NOISE * width * one.seconds:
                raise Rejected(
                    f"a pass over {width} tokens is saved as {cost.seconds:.4g} s, more than {NOISE:g} x {width} one-token "
                    f"passes ({one.seconds:.4g} s each): measured on a busy machine"
                )
    saved.context_one = _number(data.get("context_one", 0.0), "context_one", 0.0, MAX_PASS_S)
    saved.context_wide = _number(data.get("context_wide", 0.0), "context_wide", 0.0, MAX_PASS_S)
    saved.plain_gap_s = _optional(data.get("plain_gap_s"), "plain_gap_s", 0.0, MAX_PASS_S)
    saved.draft_gap_s = _optional(data.get("draft_gap_s"), "draft_gap_s", 0.0, MAX_PASS_S)
    saved.utilization = _optional(data.get("utilization"), "utilization", 0.01, MAX_UTILIZATION)
    sources = _dict(data.get("sources", {}), "sources")
    if len(sources) > MAX_SOURCES:
        raise Rejected(f"it names {len(sources)} drafters, more than {MAX_SOURCES}")
    for name, value in sources.items():
        if len(name) > 64:
            raise Rejected("a drafter's name is too long")
        value = _dict(value, f"sources.{name}")
        saved.sources[name] = SourceRecord(
            t_draft=_cost(value.get("t_draft"), f"sources.{name}.t_draft", now, 0.0, MAX_PASS_S),
            start_s=_cost(value.get("start_s"), f"sources.{name}.start_s", now, 0.0, MAX_PASS_S),
            runs_model=_flag(value.get("runs_model", False), f"sources.{name}.runs_model"),
            acceptance=_pairs(value.get("acceptance", []), f"sources.{name}.acceptance", MAX_WIDTH - 1),
            calibration=_pairs(value.get("calibration", []), f"sources.{name}.calibration", 16),
            first_seen=[
                _number(v, f"sources.{name}.first_seen", 0.0, 1e6)
                for v in _list(value.get("first_seen", []), f"sources.{name}.first_seen", 16)
            ],
        )
    return saved
