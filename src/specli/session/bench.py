"""`specli bench` without its rendering: prompts, the run schedule, the loop that measures it
(BenchLoop, on models the caller loaded), aggregation and the verdicts.

Nothing here loads a model, and only BenchLoop runs one; cli/bench.py loads the pair, shows the
progress and renders the tables.
Vocabulary:
- a *configuration* is a draft length N (a modes.DraftLength); N = 0 (DraftLength.off(),
  BASELINE) stands for target-only decoding (the baseline);
- a *record* is one measured run: one prompt, one configuration, one round (a dict of numbers,
  the configuration as JSON spells it: 0, "auto" or N);
- a *row* aggregates a scenario's records for one configuration (medians, pooled ratios), which
  it names as the records do.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Sequence

from specli.decoding.generation import Request
from specli.decoding.loop import generate
from specli.decoding.step import SpeculativeDecoder
from specli.errors import UsageError
from specli.files import read_limited, replace_text, strip_bom
from specli.modes import MAX_DRAFT, DraftLength
from specli.session.costs import RARE_ALPHA, PassCosts, alpha_text, break_even_alpha

if TYPE_CHECKING:
    from specli.decoding.sampling import SamplingParams
    from specli.session.loading import Loaded

DEFAULT_NS = (DraftLength.auto(), *map(DraftLength.fixed_at, (1, 2, 3, 5, 8, 12)))
BASELINE = DraftLength.off()  # the configuration "N = 0": no drafting
# The configurations as records and rows spell them (DraftLength.json_value).
NO_DRAFTING = BASELINE.json_value
AUTO = DraftLength.auto().json_value

# Verdict thresholds on the best measured speedup (the guide's terms).
YES_AT = 1.2
MAYBE_AT = 1.0
WITHIN_NOISE = "within noise"  # the verdict when the rounds disagree, or the figure is impossible

LONG_FORM = "long-form"
SHORT_CHAT = "short-chat"
SHORT_CHAT_CAP = 48  # a chat reply under 50 tokens
CUSTOM = "custom"


@dataclass(frozen=True)
class BenchPrompt:
    """One prompt of the set: a unique-ish name, the scenario it stands for, the text."""

    name: str
    scenario: str
    text: str


# The embedded Gemma 270M is a base model: every prompt is text to continue, not an order.
_CODE_SNIPPET = '''\
def parse_config(path):
    settings = {}
    with open(path) as handle:
        for line in handle:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, value = line.split("=", 1)
            settings[key.strip()] = value.strip()
    return settings


def get_int(settings, key, default=0):
    value = settings.get(key)
    if value is None:
        return default
    return int(value)
'''

_ARTICLE = (
    "The town of Millbrook sits where two rivers meet, and for most of its history the rivers "
    "decided its fortunes. In the nineteenth century a flour mill on the faster river ground the "
    "grain of the whole valley. The railway arrived in 1871 and warehouses lined the riverbank, "
    "until the flood of 1903 destroyed half of them and the mill with them. The council moved the "
    "town centre uphill and turned the flood plain into a park, which still hosts the summer "
    "market. A textile factory employed a third of the town until it closed in 1988; since then "
    "Millbrook has drawn walkers and anglers, and the old railway line has become a cycling path "
    "along the river. The population, which fell sharply after the factory closed, has slowly "
    "recovered as families from the city moved in for the quiet streets and the good schools."
)

BUILTIN_PROMPTS: tuple[BenchPrompt, ...] = (
    BenchPrompt("essay", LONG_FORM,
                "A short history of the printing press\n\nChapter 1. Before Gutenberg\n\n"
                "Long before the first book was printed in Europe, "),
    BenchPrompt("chat", SHORT_CHAT,
                "User: Hi! What is the capital of France?\nAssistant: The capital of France is Paris.\n"
                "User: And how many people live there?\nAssistant:"),
    BenchPrompt("code-gen", "code-generation",
                'def is_prime(n: int) -> bool:\n    """Return True when n is a prime number."""\n'),
    BenchPrompt("code-edit", "code-editing",
                "# Original version:\n" + _CODE_SNIPPET
                + "\n\n# The same code with type hints and docstrings:\n"
                "def parse_config(path: str) -> dict[str, str]:\n"),
    BenchPrompt("summary", "summarization", _ARTICLE + "\n\nSummary: Millbrook"),
    BenchPrompt("story", "creative-writing",
                "Once upon a time, in a village at the edge of a great forest, there lived a girl "
                "named Elena who could hear the trees whispering to each other. One autumn morning,"),
    BenchPrompt("french", "non-english",
                "Il était une fois, dans un petit village au bord de la mer, un vieux pêcheur qui"),
)


def token_budget(prompt: BenchPrompt, max_tokens: int) -> int:
    """The generated-token budget of one run: --max-tokens, except that long-form gets twice it
    (256 by default: past 200 tokens) and short chat at most 48 (a reply under 50 tokens)."""
    if prompt.scenario == LONG_FORM:
        return 2 * max_tokens
    if prompt.scenario == SHORT_CHAT:
        return min(max_tokens, SHORT_CHAT_CAP)
    return max_tokens


# ------------------------------------------------------------------------------------------
# Options


def parse_ns(text: str) -> list[DraftLength]:
    """`--draft-max auto,8,2,4` -> auto, 2, 4, 8 (auto first, then sorted, no duplicates). Raises
    UsageError naming the bad item."""
    ns: set[DraftLength] = set()
    for item in text.split(","):
        try:
            ns.add(DraftLength.parse(item))
        except ValueError as err:
            raise UsageError(f"--draft-max takes 'auto' or draft lengths between 1 and {MAX_DRAFT}, separated by commas, like auto,2,4,8; {err}") from None
    return sorted(ns, key=lambda n: (not n.is_auto, n.maximum))


def config_order(n: int | str) -> tuple[int, int]:
    """Sort key of configurations as records spell them: target-only, auto, then fixed N ascending."""
    return (0, 0) if n == NO_DRAFTING else (1, 0) if n == AUTO else (2, int(n))


def is_fixed(n: int | str) -> bool:
    """A fixed draft length as records spell it (not target-only, not auto)."""
    return isinstance(n, int) and n != NO_DRAFTING


def parse_prompt_file(path: Path) -> list[BenchPrompt]:
    """Read a prompt file: JSONL when its first non-blank line starts with '{' (each line an
    object with "prompt" and optional "name", "scenario"), else one prompt per non-blank line.

    Raises UsageError with one line naming the file and line number of the first problem.
    """
    try:
        with Path(path).open("rb") as handle:
            raw = strip_bom(read_limited(handle, f"the prompt file {path}"))
    except OSError as err:
        raise UsageError(f"cannot read the prompt file {path}: {err.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise UsageError(f"{path} line {line}: not UTF-8 text; convert the file first, e.g. with iconv") from None
    numbered = [(i, line) for i, line in enumerate(text.splitlines(), start=1) if line.strip()]
    if not numbered:
        raise UsageError(f"{path} has no prompts; write one prompt per line (or JSONL with \"prompt\")")
    if numbered[0][1].lstrip().startswith("{"):
        return [_jsonl_prompt(path, i, line) for i, line in numbered]
    return [BenchPrompt(f"line-{i}", CUSTOM, line) for i, line in numbered]


def _jsonl_prompt(path: Path, lineno: int, line: str) -> BenchPrompt:
    """One JSONL line -> a prompt (name defaults to line-N, scenario to 'custom')."""
    where = f"{path} line {lineno}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as err:
        raise UsageError(f"{where}: not valid JSON ({err.msg}); each line must be an object like {{\"prompt\": \"...\"}}") from None
    if not isinstance(obj, dict):
        raise UsageError(f"{where}: expected an object like {{\"prompt\": \"...\"}}, got {type(obj).__name__}")
    prompt = obj.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise UsageError(f"{where}: \"prompt\" must be a non-empty string")
    fields = {}
    for key, default in (("name", f"line-{lineno}"), ("scenario", CUSTOM)):
        value = obj.get(key, default)
        if not isinstance(value, str) or not value.strip():
            raise UsageError(f"{where}: \"{key}\" must be a non-empty string when given")
        fields[key] = value.strip()
    return BenchPrompt(fields["name"], fields["scenario"], prompt)


# ------------------------------------------------------------------------------------------
# Schedule


@dataclass(frozen=True)
class BenchJob:
    """One run to do: round r (0-based), prompt index, configuration N (BASELINE = target-only)."""

    round: int
    prompt: int
    n: DraftLength


def schedule(n_prompts: int, ns: list[DraftLength], repeat: int) -> list[BenchJob]:
    """Every (round, prompt, configuration) once, interleaved: within a round each prompt runs
    all configurations back to back, and the order of the configurations rotates by one each
    round, so slow spells of the machine (and warm-up) hit every configuration alike."""
    configs = [BASELINE, *ns]
    jobs = []
    for r in range(repeat):
        shift = r % len(configs)
        order = configs[shift:] + configs[:shift]
        for p in range(n_prompts):
            jobs.extend(BenchJob(r, p, n) for n in order)
    return jobs


def run_seed(base: int | None, round_: int) -> int:
    """The seed of every run in a round when sampling: base (--seed, default 0) + round, the same
    for all configurations of that round so they face comparable draws."""
    return (base or 0) + round_


# ------------------------------------------------------------------------------------------
# Measuring


@dataclass(frozen=True)
class Starting:
    """BenchLoop is about to run `job` (on `prompt`)."""

    job: BenchJob
    prompt: BenchPrompt


@dataclass(frozen=True)
class Measured:
    """BenchLoop ran `job`: its record (see RECORD_FIELDS)."""

    job: BenchJob
    record: dict


class BenchLoop:
    """The schedule run on loaded models, in this process, through SpeculativeDecoder.

    Needs `loaded` from loading.load (a drafting plan). The target-only decoder shares the
    target model; the speculative one is the loaded decoder with its draft length set per
    run. Making one tokenizes the prompts (UsageError when one does not fit the context) and
    warms both decoders up; runs() then runs `jobs` in order.
    """

    def __init__(self, loaded: "Loaded", prompts: Sequence[BenchPrompt], ns: list[DraftLength], repeat: int,
                 max_tokens: int, sampling: "SamplingParams"):
        model_tgt = loaded.model_tgt
        self._ids = [model_tgt.tokenize_prompt(p.text) for p in prompts]  # (as `run` makes a raw prompt's)
        for prompt, prompt_ids in zip(prompts, self._ids):
            if len(prompt_ids) + 1 >= model_tgt.n_ctx:
                raise UsageError(f"prompt '{prompt.name}' is {len(prompt_ids)} tokens but the context holds {model_tgt.n_ctx}; raise -c")
        self._prompts, self._max_tokens, self._sampling = list(prompts), max_tokens, sampling
        self._mode = loaded.plan.mode
        self._plain = SpeculativeDecoder(model_tgt, None, BASELINE, sampling)
        self._spec = loaded.decoder
        self._warm_up(self._ids[0], ns[0])
        self.jobs = schedule(len(prompts), ns, repeat)

    def _warm_up(self, prompt_ids: list[int], n: DraftLength) -> None:
        """A few untimed tokens through both decoders: the first runs of a process are slower
        (allocations, caches), and that must not count against whichever configuration is first."""
        self._spec.set_draft_length(n)
        for decoder in (self._plain, self._spec):
            generate(decoder, Request(prompt_ids, max_tokens=8)).run()

    def runs(self) -> Iterator[Starting | Measured]:
        """Each job: Starting, then (once generated) Measured with its record. When sampling,
        every run of round r draws from run_seed(the sampling's seed, r)."""
        for job in self.jobs:
            prompt = self._prompts[job.prompt]
            yield Starting(job, prompt)
            decoder = self._plain if job.n.is_off else self._spec
            if not job.n.is_off:
                decoder.set_draft_length(job.n)
            seed = None if self._sampling.greedy else run_seed(self._sampling.seed, job.round)
            yield Measured(job, self._one_run(decoder, job, prompt, seed))

    def _one_run(self, decoder: SpeculativeDecoder, job: BenchJob, prompt: BenchPrompt, seed: int | None) -> dict:
        """Generate once and return its record (see RECORD_FIELDS)."""
        budget = token_budget(prompt, self._max_tokens)
        gen = generate(decoder, Request(self._ids[job.prompt], max_tokens=budget, seed=seed))
        rejections = 0  # steps that ended at a rejected draft: for the estimate of α
        for step in gen:
            if step.n_drafted and step.n_accepted < step.n_drafted:
                rejections += 1
        st = gen.stats
        return {
            "round": job.round, "prompt": prompt.name, "scenario": prompt.scenario, "n_draft": job.n.json_value,
            "drafter": None if job.n.is_off else self._mode, "seed": gen.seed, "max_tokens": budget,
            "n_tokens": st.n_tokens, "stop_reason": gen.stop_reason, "tokens_per_s": st.tokens_per_s,
            "generation_s": st.generation_s, "prompt_tokens": st.prompt_tokens, "prompt_s": st.prompt_s,
            "drafted": st.drafted, "accepted": st.accepted, "rejections": rejections,
            "acceptance_rate": st.acceptance_rate, "target_passes": st.target_passes,
            "mean_tokens_per_pass": st.mean_tokens_per_pass, "draft_s": st.draft_s, "verify_s": st.verify_s,
            "mean_draft_length": st.mean_draft_length,
        }


# ------------------------------------------------------------------------------------------
# Formula, aggregation, verdicts


def expected_speedup(alpha: float, n: int, c: float) -> float:
    """Leviathan et al. 2023: expected walltime gain (1 - α^(N+1)) / ((1 - α)(N c + 1)) for
    per-token acceptance α, N drafts per step and draft cost c (per token, relative to a target
    pass). It assumes a target pass costs the same for 1 and N+1 tokens."""
    if not 0 <= alpha <= 1 or n < 0 or c < 0:
        raise ValueError("need 0 <= alpha <= 1, n >= 0, c >= 0")
    tokens_per_pass = n + 1 if alpha == 1 else (1 - alpha ** (n + 1)) / (1 - alpha)
    return tokens_per_pass / (n * c + 1)


def alpha_estimate(accepted: int, rejections: int) -> float | None:
    """Per-token acceptance α, the maximum-likelihood estimate under Leviathan's model (each draft
    kept independently with probability α until the first rejection): accepted tokens over
    accepted tokens + steps that ended in a rejection. None when nothing was judged."""
    judged = accepted + rejections
    return accepted / judged if judged else None


@dataclass
class Row:
    """One configuration of one scenario, aggregated over its prompts and rounds."""

    scenario: str
    n: int | str  # as the records spell it: 0 = target-only, "auto" = the adaptive policy
    runs: int
    tokens_per_s: float | None  # median over runs
    speedup: float | None  # over target-only: median of each run's ratio to its twin (aggregate)
    acceptance: float | None  # accepted / drafted, pooled
    alpha: float | None  # see alpha_estimate
    tokens_per_pass: float | None  # generated tokens / target passes, pooled
    draft_ms_per_token: float | None  # draft time per generated token
    verify_ms_per_token: float | None  # target pass + verification time per generated token
    cost_ratio: float | None  # c: draft time per drafted token / target one-token pass time
    expected: float | None  # expected_speedup(alpha, n, c) (fixed N only)
    mean_draft_length: float | None = None  # drafted / target passes (auto: what it chose)
    # The spread over repeats: the lowest and highest of the per-round speedups (each round's
    # median over its prompts, each run over its twin); None with fewer than two paired rounds.
    speedup_min: float | None = None
    speedup_max: float | None = None
    rounds: int = 0  # rounds behind speedup_min/max
    # The speedup is above tokens_per_pass, which no drafting can beat (see above_bound).
    impossible: bool = False


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def _pooled(records: list[dict], key: str) -> float:
    return sum(r[key] for r in records)


def aggregate(records: list[dict]) -> list[Row]:
    """Rows per (scenario, configuration), scenarios in first-seen order, target-only first.

    Needs records with: scenario, n_draft, tokens_per_s, n_tokens, drafted, accepted,
    rejections, target_passes, draft_s, verify_s. A speedup is the median over runs of each
    run's tokens/s over its target-only twin's (same prompt and round: `prompt` and `round`
    keys; the schedule runs them back to back, so a slow spell of the machine slows both); a
    configuration with a run that has no twin compares medians of tokens/s instead. The
    target's one-token pass time (for c) is verify time / passes pooled over its target-only
    runs.
    """
    groups: dict[str, dict[int, list[dict]]] = {}
    for rec in records:
        groups.setdefault(rec["scenario"], {}).setdefault(rec["n_draft"], []).append(rec)
    twins = _twins(records)
    rows = []
    for scenario, by_n in groups.items():
        base = by_n.get(NO_DRAFTING, [])
        base_tps = _median([r["tokens_per_s"] for r in base])
        pass_s = _ratio(_pooled(base, "verify_s"), _pooled(base, "target_passes")) if base else None
        for n in sorted(by_n, key=config_order):
            rows.append(_row(scenario, n, by_n[n], base_tps, pass_s, twins))
    return rows


def _twins(records: list[dict]) -> dict[tuple, float]:
    """Target-only tokens/s by twin key (scenario, prompt, round)."""
    twins = {}
    for rec in records:
        key = _twin_key(rec)
        if rec["n_draft"] == NO_DRAFTING and key is not None:
            twins[key] = rec["tokens_per_s"]
    return twins


def _twin_key(rec: dict) -> tuple | None:
    """What pairs a run with its target-only twin (None for records that do not say)."""
    if "prompt" not in rec or "round" not in rec:
        return None
    return rec["scenario"], rec["prompt"], rec["round"]


def _paired_speedup(recs: list[dict], twins: dict[tuple, float]) -> float | None:
    """Median of tokens/s over the twin's, when every run has a twin that measured something."""
    ratios = []
    for rec in recs:
        twin = twins.get(_twin_key(rec))  # (records without prompt/round: key None, no twin)
        if not twin or rec["tokens_per_s"] is None:
            return None
        ratios.append(rec["tokens_per_s"] / twin)
    return statistics.median(ratios) if ratios else None


def round_speedups(recs: list[dict], twins: dict[tuple, float]) -> list[float]:
    """Per round (in order), the median over its runs of each run's tokens/s over its twin's:
    what one repeat of the bench would have reported. Runs without a twin are left out."""
    by_round: dict[int, list[float]] = {}
    for rec in recs:
        twin = twins.get(_twin_key(rec))
        if twin and rec["tokens_per_s"] is not None:
            by_round.setdefault(rec["round"], []).append(rec["tokens_per_s"] / twin)
    return [statistics.median(by_round[r]) for r in sorted(by_round)]


def above_bound(speedup: float | None, tokens_per_pass: float | None) -> bool:
    """Whether a measured speedup beats tokens per target pass, which drafting cannot: every
    target pass costs at least a plain one-token pass, so speedup <= tokens per pass. Above
    it the measurement is at fault (timing noise, a slow spell during target-only runs)."""
    return speedup is not None and tokens_per_pass is not None and speedup > tokens_per_pass


def within_noise(row: Row, level: float = 1.0) -> bool | None:
    """Whether `level` (1.0: target-only's speed) lies within the row's spread over repeats,
    so that the rounds disagree on which side of it the row is. None: no spread measured."""
    if row.speedup_min is None or row.speedup_max is None:
        return None
    return row.speedup_min <= level <= row.speedup_max


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _row(scenario: str, n: int, recs: list[dict], base_tps: float | None, pass_s: float | None,
         twins: dict[tuple, float] | None = None) -> Row:
    """Aggregate one configuration's records (see aggregate)."""
    tps = _median([r["tokens_per_s"] for r in recs])
    speedup = 1.0 if n == NO_DRAFTING and tps else _paired_speedup(recs, twins or {})
    if speedup is None:
        speedup = tps / base_tps if tps is not None and base_tps else None
    tokens, drafted = _pooled(recs, "n_tokens"), _pooled(recs, "drafted")
    accepted, passes = _pooled(recs, "accepted"), _pooled(recs, "target_passes")
    alpha = alpha_estimate(accepted, _pooled(recs, "rejections")) if n else None
    draft_per_token = _ratio(_pooled(recs, "draft_s"), drafted) if n else None
    c = draft_per_token / pass_s if draft_per_token is not None and pass_s else None
    ms = lambda key: 1000 * _pooled(recs, key) / tokens if tokens else None  # noqa: E731
    per_round = round_speedups(recs, twins or {}) if n != NO_DRAFTING else []
    spread = (min(per_round), max(per_round)) if len(per_round) >= 2 else (None, None)
    return Row(
        scenario=scenario, n=n, runs=len(recs), tokens_per_s=tps,
        speedup=speedup,
        acceptance=_ratio(accepted, drafted) if n else None, alpha=alpha,
        tokens_per_pass=_ratio(tokens, passes), draft_ms_per_token=ms("draft_s"),
        verify_ms_per_token=ms("verify_s"), cost_ratio=c,
        expected=expected_speedup(alpha, n, c) if is_fixed(n) and alpha is not None and c is not None else None,
        mean_draft_length=_ratio(drafted, passes) if n else None,
        speedup_min=spread[0], speedup_max=spread[1], rounds=len(per_round) if spread[0] is not None else 0,
        impossible=above_bound(speedup, _ratio(tokens, passes)),
    )


def best_per_scenario(rows: list[Row]) -> dict[str, Row]:
    """The fixed-N row with the highest measured speedup, per scenario (scenarios whose
    fixed-N rows have no speedup are left out)."""
    best: dict[str, Row] = {}
    for row in rows:
        if not is_fixed(row.n) or row.speedup is None:
            continue
        if row.scenario not in best or row.speedup > best[row.scenario].speedup:
            best[row.scenario] = row
    return best


def best_overall(rows: list[Row]) -> tuple[int, float] | None:
    """(N, geometric-mean speedup over scenarios) for the fixed N that is best across all
    scenarios; only N measured in every scenario count. None when there is nothing to compare."""
    by_n: dict[int, list[float]] = {}
    scenarios = {row.scenario for row in rows}
    for row in rows:
        if is_fixed(row.n) and row.speedup is not None and row.speedup > 0:
            by_n.setdefault(row.n, []).append(row.speedup)
    means = {n: math.exp(statistics.fmean(map(math.log, s))) for n, s in by_n.items() if len(s) == len(scenarios)}
    if not means:
        return None
    n = max(means, key=lambda k: (means[k], -k))  # ties: the shorter draft
    return n, means[n]


def auto_summary(rows: list[Row]) -> dict[str, tuple[Row, Row | None]]:
    """Per scenario with an auto row: (auto's row, the best fixed-N row or None)."""
    best = best_per_scenario(rows)
    return {row.scenario: (row, best.get(row.scenario)) for row in rows if row.n == AUTO}


def worst_against_best(rows: list[Row]) -> dict[int | str, float]:
    """Per configuration (auto and each fixed N measured in every scenario): its lowest
    speedup / the best fixed N's speedup over the scenarios. A fixed N's best includes itself,
    so it reads 1.0 where it is the best; its figure shows how far one set of settings falls
    behind a best picked after the fact, from a maximum of noisy figures, in its worst scenario,
    which is what auto is held against."""
    best = best_per_scenario(rows)
    ratios: dict[int | str, list[float]] = {}
    for row in rows:
        if row.n and row.scenario in best and row.speedup is not None:
            ratios.setdefault(row.n, []).append(row.speedup / best[row.scenario].speedup)
    return {n: min(r) for n, r in ratios.items() if len(r) == len(best)}


def held_out_best(records: list[dict]) -> dict[str, float]:
    """Per scenario: the speedup of a fixed N picked from a sweep, measured on runs the pick did
    not see. For each round, the fixed N with the best paired speedup over the other rounds
    (ties: the shorter) is scored on that round's runs (each over its target-only twin); the
    median of those ratios over all rounds.

    The best of the sweep's figures is a maximum of noisy figures, favoured by chance (Gemma
    with lookup at temperature 0.8, code-editing: the best fixed N read 1.20x, the held-out pick
    made 1.09x); this is what running with the N a sweep picked gives. Scenarios with fewer
    than two rounds of fixed N, or runs without a twin, are left out."""
    twins = _twins(records)
    ratios: dict[str, dict[tuple, list[float]]] = {}  # scenario -> (n, round) -> ratios
    for rec in records:
        twin = twins.get(_twin_key(rec))
        if is_fixed(rec["n_draft"]) and twin and rec["tokens_per_s"] is not None:
            runs = ratios.setdefault(rec["scenario"], {}).setdefault((rec["n_draft"], rec["round"]), [])
            runs.append(rec["tokens_per_s"] / twin)
    out = {}
    for scenario, by_run in ratios.items():
        rounds = sorted({r for _, r in by_run})
        if len(rounds) < 2:
            continue
        scored: list[float] = []
        for held in rounds:
            seen: dict[int, list[float]] = {}  # the other rounds' ratios, per N
            for (n, r), runs in by_run.items():
                if r != held:
                    seen.setdefault(n, []).extend(runs)
            pick = max(seen, key=lambda n: (statistics.median(seen[n]), -n))
            scored.extend(by_run.get((pick, held), []))
        if scored:
            out[scenario] = statistics.median(scored)
    return out


def verdict(best: Row | None, *, lookup: bool = False, costs: PassCosts | None = None) -> tuple[str, str]:
    """("yes" | "maybe" | "no" | "within noise", why) for a scenario, from its best speculative
    row: within noise when its rounds straddle target-only's speed (1.0x) or its speedup is
    above its tokens per pass (impossible: a measurement fault); else yes at a best speedup
    >= 1.2, maybe from 1.0 up to 1.2, no below 1.0. `lookup` words the likely cause for prompt
    lookup rather than a draft model.

    `costs` (the measured pass costs; a draft model's run only): when they cap drafting below
    1.0x even with every draft accepted, the answer is no, with that as the reason, whatever the
    rounds say (a speedup of 1.2x or more above such a cap is a measurement fault: within noise)."""
    if best is None or best.speedup is None:
        return "no", "nothing measured"
    gain = f"best N={best.n}: {best.speedup:.2f}x target-only"
    if best.speedup_min is not None and best.speedup_max is not None:
        gain += f" (rounds {best.speedup_min:.2f}-{best.speedup_max:.2f}x)"
    if best.acceptance is not None:
        gain += f", {best.acceptance:.0%} of drafts accepted"
    if above_bound(best.speedup, best.tokens_per_pass):
        return WITHIN_NOISE, (f"{gain}; impossible above its {best.tokens_per_pass:.2f} tokens per target pass "
                              "(a target pass costs at least a plain one): a measurement fault, rerun on an idle machine")
    cap = costs.draft if costs is not None and not lookup else None
    if cap is not None and cap.speedup < MAYBE_AT:
        if best.speedup >= YES_AT:
            return WITHIN_NOISE, (f"{gain}; above the {cap.speedup:.2f}x the measured pass costs allow even with every "
                                  "draft accepted: a measurement fault, rerun on an idle machine")
        return "no", (f"{gain}; drafting with this draft model cannot pay on this machine: even with every draft "
                      f"accepted the measured pass costs allow at most {cap.speedup:.2f}x (N={cap.n}); use "
                      "--target-only, or --lookup for copy-heavy work")
    if within_noise(best):
        return WITHIN_NOISE, f"{gain}; its rounds fall on both sides of target-only's speed"
    if best.speedup >= YES_AT:
        return "yes", gain
    reason = _why_slow(best, lookup, None if lookup else costs)
    if best.speedup >= MAYBE_AT:
        return "maybe", f"{gain}; a small gain that machine noise can hide{reason}"
    return "no", f"{gain}; drafting costs more than it saves{reason}"


def _why_slow(best: Row, lookup: bool, costs: PassCosts | None = None) -> str:
    """The likeliest cause of a weak result, as a clause. `costs`: a draft model's measured pass
    costs, which tell the acceptance it needs to break even."""
    need = break_even_alpha(costs.target_s, costs.draft_s) if costs is not None and costs.draft is not None else None
    if need is not None and best.alpha is not None and best.alpha < need:
        # (a break-even no draft model keeps up is the machine's doing, not the draft's)
        fix = "use --target-only, or --lookup for copy-heavy work" if need >= RARE_ALPHA else "try a better-matched draft"
        return (f" (at the measured pass costs a draft must be accepted with per-token probability {alpha_text(need)} to break "
                f"even, measured α {best.alpha:.2f}: {fix})")
    if best.acceptance is None:
        return " (nothing was drafted: the text has nothing for lookup to copy)" if lookup else " (nothing was drafted)"
    if lookup and best.tokens_per_pass is not None and best.tokens_per_pass < 1.5:
        return f" (lookup found little to copy: {best.tokens_per_pass:.2f} tokens per target pass)"
    if best.acceptance < 0.5:
        fix = "lookup suits text that repeats its input" if lookup else "try a better-matched draft or a smaller N"
        return f" (low acceptance: {fix})"
    if best.cost_ratio is not None and best.cost_ratio > 0.3:
        return f" (drafting costs {best.cost_ratio:.2f} of a target pass per drafted token)"
    return " (wider target passes cost more than they save here)"


# ------------------------------------------------------------------------------------------
# Output files

RECORD_FIELDS = (
    "round", "prompt", "scenario", "n_draft", "drafter", "seed", "max_tokens", "n_tokens",
    "stop_reason", "tokens_per_s", "generation_s", "prompt_tokens", "prompt_s", "drafted",
    "accepted", "rejections", "acceptance_rate", "target_passes", "mean_tokens_per_pass",
    "draft_s", "verify_s", "mean_draft_length",
)


def write_json(path: Path, settings: dict, records: list[dict], rows: list[Row],
               held_out: dict[str, float] | None = None, costs: PassCosts | None = None) -> None:
    """{"settings", "runs" (one record per run), "summary" (the aggregated rows),
    "held_out_best" (per scenario, held_out_best's speedup), "costs" (PassCosts.to_json, or
    null when not measured)} as JSON."""
    doc = {"settings": settings, "runs": records, "summary": [asdict(row) for row in rows],
           "held_out_best": held_out or {}, "costs": costs.to_json() if costs is not None else None}
    _write(path, json.dumps(doc, indent=2, ensure_ascii=False) + "\n")


def write_csv(path: Path, records: list[dict]) -> None:
    """One row per run, columns RECORD_FIELDS."""
    import io

    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=RECORD_FIELDS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(records)
    _write(path, buf.getvalue())


def _write(path: Path, text: str) -> None:
    try:
        replace_text(path, text)  # (a kill or a full disk keeps the earlier file whole)
    except OSError as err:
        raise UsageError(f"cannot write {path}: {err.strerror}") from None
