"""Drafting replayed on a known text: figures that do not move with the machine.

At temperature 0 the output is the target's greedy text whatever is drafted, so once that text
is known (a plain run's output), what a model-free drafter proposes, what the target accepts,
and how wide each target pass is depend only on the text and the choices made: no model is
needed to replay a run. Charging each pass from a cost table (the seconds of a pass by its
width, measured once per machine) gives a modelled time that compares policies without the
noise of a shared machine, and `oracle` says how fast the best choice of draft lengths could
have been for the same drafter, text and table.

The replay follows the engine's step (step.SequenceStep) with the target's pass replaced by
the text: n_max = min(the draft length, tokens left - 1); the drafter proposes from the context (prompt and
output so far); the accepted drafts are the proposal's agreeing prefix with the text, then the
target's own token. Under `--draft-max auto` the policy is told each step as the engine tells
it, with the table's seconds as the pass's time and no time for drafting or the loop (lookup
spends 0.1-0.3 ms a step in Python, against passes of milliseconds or more).

A draft model is replayed from its trace (`DraftTrace`): its greedy choice and confidence at
every position of the text, from one batch pass over the text. Its greedy draft from a position
is the trace's choices as long as they equal the text (each conditioned on the text so far,
which the draft equals up to there), then its first wrong token; the tokens after that are
conditioned on a wrong token, so the trace cannot know them: they count as refused, with the
confidences of the positions they stand at as a stand-in (only `--draft-max auto`'s choice to
keep them reads those). A drafted token costs `t_draft` seconds (a draft pass), so does a token
the draft model was run to look at and the policy did not keep.

What it cannot replay: a text that batch numerics would make differ from the plain run's
(near-ties on quantized models, README "Limits"): the replay's text is the plain run's
throughout; nor a draft model's catch-up after plain steps (a batch pass, cheap per token), nor
its window when it starts over after a long plain stretch. docs/benchmarking.md, "Replays",
says how the benchmarks use it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

from specli.decoding.drafters import Drafter, Proposal
from specli.decoding.policy import FIXED, AdaptivePolicy, DraftJudge, StepReport
from specli.modes import DraftLength

WIDEST = 65  # pass widths a cost table holds (a draft of 64 and the newest token)


@dataclass(frozen=True)
class CostTable:
    """Seconds of one target pass by its width (tokens in the pass): `seconds[n - 1]` is T(n).

    Beyond the table a pass costs what the last step of the table adds per token."""

    seconds: tuple[float, ...]
    label: str = ""

    def __post_init__(self) -> None:
        if not self.seconds or any(not (s > 0 and math.isfinite(s)) for s in self.seconds):
            raise ValueError("a cost table needs positive, finite seconds for every width from 1")

    def __call__(self, width: int) -> float:
        table = self.seconds
        if width <= len(table):
            return table[width - 1]
        step = table[-1] - table[-2] if len(table) > 1 else table[-1]
        return table[-1] + (width - len(table)) * max(step, 0.0)

    @classmethod
    def from_points(cls, points: Mapping[int, float], label: str = "", widest: int = WIDEST) -> "CostTable":
        """From measured widths (e.g. {1: 0.0225, 4: 0.066, 16: 0.127}): straight lines between
        them, the last segment's slope beyond, and never cheaper for a wider pass."""
        known = sorted((int(n), float(s)) for n, s in points.items())
        if not known or known[0][0] != 1:
            raise ValueError("a cost table needs the time of a one-token pass")
        out: list[float] = []
        for n in range(1, widest + 1):
            right = next((i for i, (w, _) in enumerate(known) if w >= n), None)
            if right is None:  # beyond the widest measured: the last segment's slope
                (w0, s0), (w1, s1) = known[-2] if len(known) > 1 else known[-1], known[-1]
                slope = (s1 - s0) / (w1 - w0) if w1 > w0 else 0.0
                value = s1 + slope * (n - w1)
            elif known[right][0] == n or right == 0:
                value = known[right][1]
            else:
                (w0, s0), (w1, s1) = known[right - 1], known[right]
                value = s0 + (s1 - s0) * (n - w0) / (w1 - w0)
            out.append(max(value, out[-1] if out else value))
        return cls(tuple(out), label)

    @classmethod
    def from_medians(cls, medians: Mapping[int, float], label: str = "", widest: int = WIDEST) -> "CostTable":
        """From a median timing per width: the closest non-decreasing sequence by least squares
        (isotonic regression; a wider pass never costs less, and one noisy width must not lift
        every width after it as a running maximum would), then `from_points`."""
        known = sorted((int(n), float(s)) for n, s in medians.items())
        blocks: list[list[float]] = []  # [sum, count] of pooled adjacent widths
        for _, seconds in known:
            blocks.append([seconds, 1.0])
            while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
                total, count = blocks.pop()
                blocks[-1][0] += total
                blocks[-1][1] += count
        fitted = [b[0] / b[1] for b in blocks for _ in range(int(b[1]))]
        return cls.from_points({n: f for (n, _), f in zip(known, fitted)}, label, widest)

    @classmethod
    def flat(cls, one: float = 0.01, at_16: float = 1.1, label: str = "flat", widest: int = WIDEST) -> "CostTable":
        """A GPU-like table: a pass over 16 tokens costs `at_16` one-token passes, growing in a
        straight line (on a GPU a small model's pass is bound by reading its weights)."""
        per_token = (at_16 - 1.0) / 15
        return cls(tuple(one * (1 + per_token * (n - 1)) for n in range(1, widest + 1)), label)

    def to_json(self) -> dict:
        return {"label": self.label, "seconds": list(self.seconds)}

    @classmethod
    def from_json(cls, data: Mapping) -> "CostTable":
        return cls(tuple(float(s) for s in data["seconds"]), str(data.get("label", "")))

    @classmethod
    def load(cls, path: Path) -> "CostTable":
        return cls.from_json(json.loads(Path(path).read_text(encoding="utf-8")))


@dataclass
class Replay:
    """One replayed generation: the width of each target pass and what it accepted."""

    widths: list[int] = field(default_factory=list)  # tokens in each pass (1 + drafted)
    accepted: list[int] = field(default_factory=list)  # drafts accepted by each pass
    n_tokens: int = 0  # tokens generated
    draft_s: float = 0.0  # the draft model's time (a trace's t_draft per token it drafted or looked at)

    @property
    def passes(self) -> int:
        return len(self.widths)

    @property
    def drafted(self) -> int:
        return sum(self.widths) - len(self.widths)

    @property
    def n_accepted(self) -> int:
        return sum(self.accepted)

    @property
    def refused(self) -> int:
        """Drafted tokens the target did not keep (checked and refused, or after a refusal)."""
        return self.drafted - self.n_accepted

    @property
    def tokens_per_pass(self) -> float:
        return self.n_tokens / self.passes if self.passes else 0.0

    def modelled_s(self, costs: Callable[[int], float]) -> float:
        """The generation's time with every pass charged from `costs` (width -> seconds), and
        the draft model's time."""
        return sum(costs(w) for w in self.widths) + self.draft_s


def agreeing(draft: Sequence[int], text: Sequence[int], at: int) -> int:
    """How many leading tokens of `draft` equal text[at:]."""
    n = 0
    while n < len(draft) and at + n < len(text) and draft[n] == text[at + n]:
        n += 1
    return n


def replay(
    text: Sequence[int], prompt_len: int, drafter: Drafter, draft_length: DraftLength | int | str, costs: Callable[[int], float], *,
    policy: AdaptivePolicy | None = None, end: int | None = None, utilization: float | None = None,
    timing: Callable[[int], tuple[float, float | None]] | None = None,
) -> Replay:
    """Replay a generation of text[prompt_len:end] (default: to the end of `text`) with a
    model-free `drafter` (drafters.Drafter) at a fixed `draft_length` or
    auto (a DraftLength, or "auto" or a number; ValueError for anything else; auto: a fresh
    AdaptivePolicy up to its maximum unless `policy` is given, e.g. one seeded with saved state,
    or one that lived through earlier replays). `costs` is what the policy is told each pass
    took (width -> seconds); `utilization`, the CPU seconds per second it is told each pass
    used (None: not measured; 2.0 is two quiet threads, less says other processes share the
    cores). `timing`, when given, says instead what each pass is told to have taken and the
    CPU seconds per second it used (width -> (seconds, utilization)): a noisy or contended
    machine, while the replay's own figures stay the text's."""
    text = list(text)
    end = len(text) if end is None else end
    if not 0 < prompt_len < end <= len(text):
        raise ValueError("a replay needs a prompt and at least one token after it")
    length = DraftLength.of(draft_length)
    judge: DraftJudge = FIXED
    if length.is_auto:
        policy = policy if policy is not None else AdaptivePolicy(length.maximum)
        judge, n_max = policy, policy.max_draft
    else:
        policy, n_max = None, length.maximum
    context = text[:prompt_len]
    drafter.begin(list(context))
    out = Replay()
    pos = prompt_len
    step = 0
    while pos < end:
        k = min(n_max, end - pos - 1)
        if step == 0 and policy is not None:
            k = 0  # (as the engine: auto's first step, the pass that finishes the prompt, drafts nothing)
        proposal = drafter.propose(context, k, judge) if k > 0 else None
        draft = list(proposal.tokens) if proposal is not None else []
        assert len(draft) <= k
        n_acc = agreeing(draft, text, pos)
        emitted = text[pos : pos + n_acc + 1]
        draft_s = drafter.last_draft_s if proposal is not None else 0.0
        if draft:
            drafter.update(len(draft), n_acc)
        if policy is not None and step > 0:  # (the first pass's times price the prompt: the engine tells only its verdict)
            pass_s, used = timing(len(draft) + 1) if timing is not None else (costs(len(draft) + 1), utilization)
            policy.observe(StepReport(
                source=proposal.source if proposal is not None else None, n_drafted=len(draft), n_accepted=n_acc,
                confidences=proposal.confidences if proposal is not None else None, draft_s=draft_s,
                pass_tokens=len(draft) + 1, pass_s=pass_s,
                token_s=proposal.token_s if proposal is not None else None,
                first_s=proposal.first_s if proposal is not None else None,
                context_len=len(context), gap_s=None if step == 1 else 0.0,
                cpu_s=None if used is None else used * pass_s,
            ))
        if step > 0:  # (the first step's drafting is part of the prompt's time, as its pass)
            out.draft_s += draft_s
        step += 1
        out.widths.append(len(draft) + 1)
        out.accepted.append(n_acc)
        out.n_tokens += len(emitted)
        context.extend(emitted)
        pos += len(emitted)
    return out


def candidates(text: Sequence[int], prompt_len: int, drafter: Drafter, n_max: int = 64, end: int | None = None) -> list[list[int]]:
    """The drafter's longest proposal at every position of the generation (index i: after
    text[:prompt_len + i]), visiting them all in order: its continuation(context, n_max), before
    any cap of its own on the length (what `oracle` chooses lengths from)."""
    text = list(text)
    end = len(text) if end is None else end
    drafter.begin(text[:prompt_len])
    out = []
    for pos in range(prompt_len, end):
        k = min(n_max, end - pos - 1)
        out.append(list(drafter.continuation(text[:pos], k)) if k > 0 else [])
    return out


@dataclass(frozen=True)
class Oracle:
    """The best any choice of draft lengths could do with a drafter's proposals."""

    modelled_s: float  # passes and drafting
    widths: tuple[int, ...]  # the passes of the best choice
    n_tokens: int

    @property
    def tokens_per_pass(self) -> float:
        return self.n_tokens / len(self.widths) if self.widths else 0.0


def oracle(text: Sequence[int], prompt_len: int, proposals: Sequence[Sequence[int]], costs: Callable[[int], float],
           end: int | None = None, t_draft: float = 0.0) -> Oracle:
    """The least modelled time over every choice of draft length at every step, each step's
    draft being a prefix of the drafter's proposal at that position (`candidates`), each
    drafted token costing `t_draft` on top of the pass (a draft model's).

    Dynamic programming from the end: from position p, a draft of k <= a tokens (a = how many
    of the proposal the text agrees with) is accepted whole and moves to p + k + 1 for T(k + 1);
    a longer draft moves no further and costs more, so it is never best."""
    text = list(text)
    end = len(text) if end is None else end
    n = end - prompt_len
    if n <= 0 or len(proposals) < n:
        raise ValueError("the oracle needs a proposal for every position of the generation")
    best = [0.0] * (n + 1)  # best[i]: least time from position prompt_len + i to the end
    choice = [0] * (n + 1)
    for i in range(n - 1, -1, -1):
        pos = prompt_len + i
        a = min(agreeing(proposals[i], text, pos), end - pos - 1)
        best_s, best_k = math.inf, 0
        for k in range(a + 1):
            s = costs(k + 1) + k * t_draft + best[i + k + 1]
            if s < best_s:
                best_s, best_k = s, k
        best[i], choice[i] = best_s, best_k
    widths = []
    i = 0
    while i < n:
        widths.append(choice[i] + 1)
        i += choice[i] + 1
    return Oracle(best[0], tuple(widths), n)


NEVER = -1  # a token no text holds: a trace's draft after its first wrong token


@dataclass(frozen=True)
class DraftTrace:
    """A draft model's greedy choice and its confidence (the choice's probability) at every
    position of a text: `choices[i]` follows text[:start + i]."""

    start: int
    choices: tuple[int, ...]
    confidences: tuple[float, ...]

    def draft(self, text: Sequence[int], pos: int, n: int) -> tuple[list[int], list[float]]:
        """The greedy draft of up to n tokens after text[:pos], and the confidences to judge it by."""
        tokens, confs, wrong = [], [], False
        for i in range(pos, min(pos + n, self.start + len(self.choices))):
            choice = self.choices[i - self.start]
            tokens.append(NEVER if wrong else choice)
            confs.append(self.confidences[i - self.start])
            wrong = wrong or i >= len(text) or choice != text[i]
        return tokens, confs


class TraceDrafter(Drafter):
    """A draft model replayed from its trace, with the protocol and the judge's calls of
    drafters.DraftModelDrafter: limit, then keep/last per token when the judge wants the
    draft's confidence. Every token drafted, or looked at and not kept, costs t_draft."""

    name = "draft-model"

    def __init__(self, text: Sequence[int], trace: DraftTrace, t_draft: float):
        self.text, self.trace, self.t_draft = list(text), trace, t_draft
        self.last_draft_s = 0.0

    def begin(self, prompt: Sequence[int], *args) -> None:
        self.last_draft_s = 0.0

    def propose(self, context: Sequence[int], n_max: int, judge: DraftJudge = FIXED) -> Proposal:
        self.last_draft_s = 0.0
        n = judge.limit(self.name, n_max, len(context)) if n_max > 0 else 0
        if n <= 0:
            return Proposal([], source=self.name)
        tokens, confs = self.trace.draft(self.text, len(context), n)
        kept: list[int] = []
        confidences: list[float] | None = [] if judge.wants_confidence else None
        looked = 0
        for token, confidence in zip(tokens, confs):
            looked += 1
            if confidences is not None:
                if not judge.keep(self.name, len(kept), confidence):
                    break
                confidences.append(confidence)
            kept.append(token)
            if confidences is not None and judge.last():
                break
        self.last_draft_s = looked * self.t_draft
        return Proposal(kept, source=self.name, confidences=confidences,
                        token_s=self.t_draft if looked > 1 else None, first_s=self.t_draft)

class ReplayHybrid(Drafter):
    """drafters.HybridDrafter over a lookup drafter and a TraceDrafter: lookup's copy when the
    text so far has a match, else the draft model's."""

    name = "hybrid"

    def __init__(self, lookup, model: TraceDrafter):
        self.lookup, self.model = lookup, model
        self.last_draft_s = 0.0

    def begin(self, prompt: Sequence[int], *args) -> None:
        self.lookup.begin(prompt)
        self.model.begin(prompt)

    def propose(self, context: Sequence[int], n_max: int, judge: DraftJudge = FIXED) -> Proposal:
        proposal = self.lookup.propose(context, n_max, judge)
        self.last_draft_s = 0.0
        if not proposal.tokens:
            proposal = self.model.propose(context, n_max, judge)
            self.last_draft_s = self.model.last_draft_s
        return proposal

    def update(self, n_drafted: int, n_accepted: int) -> None:
        self.lookup.update(n_drafted, n_accepted)
