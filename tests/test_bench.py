"""`specli bench`: the pure parts (formula, aggregation, verdicts, schedule, prompt files) and
one real run through a subprocess. No timing thresholds anywhere: only structure and arithmetic."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest

from specli.errors import UsageError
from specli.modes import DraftLength
from specli.session import bench, costs

N, OFF, AUTO = DraftLength.fixed_at, DraftLength.off(), DraftLength.auto()


# --- expected speedup (Leviathan et al. 2023) ---------------------------------------------


@pytest.mark.parametrize(
    "alpha, n, c, hand",
    [
        (0.8, 4, 0.0, (1 - 0.8**5) / 0.2),  # 3.3616 tokens per pass at no draft cost
        (0.8, 4, 0.05, 3.3616 / 1.2),  # = 2.8013
        (0.5, 1, 0.1, 1.5 / 1.1),  # one draft: 1 + α tokens per pass
        (0.0, 5, 0.2, 1 / 2.0),  # nothing accepted: pure loss
        (1.0, 3, 0.1, 4 / 1.3),  # every draft accepted: N + 1 tokens per pass
        (0.9, 0, 0.5, 1.0),  # no drafting: no change
    ],
)
def test_expected_speedup_matches_hand_values(alpha, n, c, hand):
    assert bench.expected_speedup(alpha, n, c) == pytest.approx(hand, rel=1e-9)


def test_expected_speedup_is_continuous_at_full_acceptance():
    assert bench.expected_speedup(1 - 1e-9, 5, 0.1) == pytest.approx(bench.expected_speedup(1.0, 5, 0.1), rel=1e-6)


def test_expected_speedup_rejects_out_of_range_inputs():
    with pytest.raises(ValueError):
        bench.expected_speedup(1.5, 3, 0.1)


def test_alpha_is_accepted_over_judged():
    # 6 accepted drafts, 2 steps that stopped at a rejection: α = 6 / 8.
    assert bench.alpha_estimate(6, 2) == 0.75
    assert bench.alpha_estimate(0, 0) is None


# --- verdicts ------------------------------------------------------------------------------


def row(scenario="s", n=3, speedup=1.0, acceptance=0.8, cost_ratio=0.05, tps=100.0) -> bench.Row:
    return bench.Row(scenario, n, 1, tps, speedup, acceptance, acceptance, 2.0, 0.1, 1.0, cost_ratio, 1.5)


@pytest.mark.parametrize(
    "speedup, word",
    [(2.0, "yes"), (1.2, "yes"), (1.1999, "maybe"), (1.0, "maybe"), (0.9999, "no"), (0.5, "no")],
)
def test_verdict_thresholds(speedup, word):
    got, why = bench.verdict(row(speedup=speedup))
    assert got == word
    assert "N=3" in why


def test_verdict_names_the_likely_cause():
    assert "low acceptance" in bench.verdict(row(speedup=0.8, acceptance=0.3))[1]
    assert "0.60 of a target pass" in bench.verdict(row(speedup=0.8, cost_ratio=0.6))[1]
    assert "nothing for lookup to copy" in bench.verdict(row(speedup=0.95, acceptance=None), lookup=True)[1]
    little = dataclasses.replace(row(speedup=1.1, acceptance=1.0), tokens_per_pass=1.3)
    assert "little to copy: 1.30 tokens per target pass" in bench.verdict(little, lookup=True)[1]
    assert bench.verdict(None) == ("no", "nothing measured")


# --- aggregation, best N -------------------------------------------------------------------


def record(scenario, n, tps, *, tokens=10, drafted=0, accepted=0, rejections=0, passes=10, draft_s=0.0, verify_s=0.1):
    return {
        "scenario": scenario, "n_draft": n, "tokens_per_s": tps, "n_tokens": tokens, "drafted": drafted,
        "accepted": accepted, "rejections": rejections, "target_passes": passes, "draft_s": draft_s,
        "verify_s": verify_s,
    }


def test_aggregate_takes_medians_and_pools_ratios():
    records = [
        record("a", 0, 100.0), record("a", 0, 90.0), record("a", 0, 300.0),  # median 100
        record("a", 2, 150.0, drafted=8, accepted=6, rejections=2, passes=4, draft_s=0.008, verify_s=0.08),
        record("a", 2, 170.0, drafted=8, accepted=2, rejections=4, passes=6, draft_s=0.008, verify_s=0.08),
        record("a", 2, 110.0, drafted=8, accepted=4, rejections=3, passes=5, draft_s=0.008, verify_s=0.08),
    ]
    base, spec = bench.aggregate(records)
    assert (base.n, base.tokens_per_s, base.speedup, base.runs) == (0, 100.0, 1.0, 3)
    assert base.acceptance is None and base.expected is None
    assert spec.tokens_per_s == 150.0 and spec.speedup == pytest.approx(1.5)
    assert spec.acceptance == pytest.approx(12 / 24)
    assert spec.alpha == pytest.approx(12 / (12 + 9))
    assert spec.tokens_per_pass == pytest.approx(30 / 15)
    # Target one-token pass: 0.3 s / 30 passes = 10 ms; draft: 0.024 s / 24 drafted = 1 ms -> c = 0.1.
    assert spec.cost_ratio == pytest.approx(0.1)
    assert spec.expected == pytest.approx(bench.expected_speedup(12 / 21, 2, 0.1))
    assert spec.draft_ms_per_token == pytest.approx(1000 * 0.024 / 30)


def test_a_speedup_compares_each_run_with_its_target_only_twin():
    # Round 1 ran in a slow spell: both configurations lost half their speed. Twin by twin N=2 is
    # 1.2x every time; medians of tokens/s would say 110 / 100 = 1.1x.
    records = [
        {**record("a", 0, 100.0), "prompt": "p", "round": 0}, {**record("a", 2, 120.0), "prompt": "p", "round": 0},
        {**record("a", 0, 50.0), "prompt": "p", "round": 1}, {**record("a", 2, 60.0), "prompt": "p", "round": 1},
        {**record("a", 0, 110.0), "prompt": "q", "round": 0}, {**record("a", 2, 132.0), "prompt": "q", "round": 0},
    ]
    base, spec = bench.aggregate(records)
    assert base.speedup == 1.0 and spec.tokens_per_s == 120.0
    assert spec.speedup == pytest.approx(1.2)
    # A run without a twin (its target-only run is missing): medians of tokens/s again.
    lone = [*records, {**record("a", 2, 200.0), "prompt": "r", "round": 0}]
    assert bench.aggregate(lone)[1].speedup == pytest.approx(126.0 / 100.0)


def test_aggregate_keeps_scenarios_apart_in_first_seen_order():
    records = [record("b", 3, 50.0), record("a", 0, 10.0), record("b", 0, 100.0), record("a", 3, 20.0)]
    rows = bench.aggregate(records)
    assert [(r.scenario, r.n) for r in rows] == [("b", 0), ("b", 3), ("a", 0), ("a", 3)]
    assert [r.speedup for r in rows] == [1.0, 0.5, 1.0, 2.0]


def test_best_n_per_scenario_and_overall():
    rows = [
        row("a", 0, 1.0), row("a", 2, 1.5), row("a", 5, 2.0),
        row("b", 0, 1.0), row("b", 2, 1.2), row("b", 5, 0.8),
    ]
    best = bench.best_per_scenario(rows)
    assert best["a"].n == 5 and best["b"].n == 2
    n, gmean = bench.best_overall(rows)
    assert n == 2 and gmean == pytest.approx(math.sqrt(1.5 * 1.2))  # 1.342 beats sqrt(2 * 0.8) = 1.265


def test_auto_sorts_after_target_only_and_is_compared_with_the_best_fixed_n():
    records = [record("a", 5, 150.0, drafted=20, accepted=10, passes=10), record("a", "auto", 190.0, drafted=30,
               accepted=25, passes=10), record("a", 0, 100.0), record("a", 2, 200.0, drafted=8, passes=10)]
    rows = bench.aggregate(records)
    assert [r.n for r in rows] == [0, "auto", 2, 5]
    auto = rows[1]
    assert auto.mean_draft_length == 3.0 and auto.expected is None  # Leviathan's formula needs a fixed N
    assert bench.best_per_scenario(rows)["a"].n == 2  # only fixed N compete for "best N"
    assert bench.best_overall(rows)[0] == 2
    auto_row, best_fixed = bench.auto_summary(rows)["a"]
    assert auto_row is auto and best_fixed.n == 2 and auto.speedup / best_fixed.speedup == pytest.approx(0.95)


def test_each_configuration_is_held_against_the_best_fixed_n_of_its_worst_scenario():
    rows = [
        row("a", 0, 1.0), row("a", "auto", 1.8), row("a", 2, 1.5), row("a", 5, 2.0),
        row("b", 0, 1.0), row("b", "auto", 1.1), row("b", 2, 1.2), row("b", 5, 0.8),
    ]
    worst = bench.worst_against_best(rows)
    assert worst == pytest.approx({"auto": 0.9, 2: 0.75, 5: 0.8 / 1.2})


def test_the_best_fixed_n_is_also_scored_on_rounds_its_pick_did_not_see():
    # N=2 has one lucky round (2.0x); N=5 makes 1.7x every round. The sweep's best figure is
    # N=5's 1.7x; picking on two rounds and scoring on the third picks N=2 twice (its lucky
    # round is among the two) and scores it 1.5x there, N=5 once (1.7x): median 1.5x.
    records = []
    for r, lucky in enumerate((150.0, 150.0, 200.0)):
        for n, tps in ((0, 100.0), (2, lucky), (5, 170.0), ("auto", 160.0)):
            records.append({**record("a", n, tps), "prompt": "p", "round": r})
    records.append({**record("b", 0, 100.0), "prompt": "p", "round": 0})  # one round: left out
    records.append({**record("b", 2, 120.0), "prompt": "p", "round": 0})
    assert bench.best_per_scenario(bench.aggregate(records))["a"].speedup == pytest.approx(1.7)
    assert bench.held_out_best(records) == pytest.approx({"a": 1.5})


def test_the_report_holds_auto_against_the_held_out_pick(capsys):
    from pathlib import Path
    from types import SimpleNamespace

    from specli.cli import bench as cli_bench

    rows = [row("a", 0, 1.0), row("a", "auto", 1.44), row("a", 2, 1.5), row("a", 5, 1.6)]
    plan = SimpleNamespace(mode="lookup", target_path=Path("t.gguf"))
    cli_bench._report(rows, {"a": 1.5}, plan, [2, 5], 3)
    out = capsys.readouterr().out
    assert "0.90 of the best fixed N=5 (1.60x), 0.96 of an N picked on the other rounds (1.50x)" in out
    assert "Worst scenario against an N picked on the other rounds: auto 0.96 (a;" in out


def test_best_overall_needs_an_n_measured_everywhere():
    assert bench.best_overall([row("a", 0, 1.0)]) is None


# --- noise: the spread over rounds, and speedups no drafting can reach ----------------------------


def paired(scenario, prompt, round_, n, tps, **kw):
    return {**record(scenario, n, tps, **kw), "prompt": prompt, "round": round_}


def rounds_of(ratios_by_prompt: dict[str, list[float]], tokens=20, passes=10) -> list[dict]:
    """Records for N=2 at the given speedups per prompt and round (target-only at 100 tok/s)."""
    records = []
    for prompt, ratios in ratios_by_prompt.items():
        for r, ratio in enumerate(ratios):
            records.append(paired("a", prompt, r, 0, 100.0))
            records.append(paired("a", prompt, r, 2, 100.0 * ratio, tokens=tokens, passes=passes, drafted=12, accepted=10, rejections=2))
    return records


def test_the_spread_is_over_rounds_each_round_the_median_of_its_prompts(tmp_path):
    # Per round: p 0.8 / q 1.0 -> 0.9, then 1.6, then 1.3. Per run the lowest would be 0.8.
    base, spec = bench.aggregate(rounds_of({"p": [0.8, 1.5, 1.2], "q": [1.0, 1.7, 1.4]}))
    assert spec.speedup == pytest.approx(1.3)  # the median over all runs, as before
    assert (spec.speedup_min, spec.speedup_max, spec.rounds) == (pytest.approx(0.9), pytest.approx(1.6), 3)
    assert base.speedup_min is None and not base.impossible  # target-only is the 1.0 everything is held to
    one_round = bench.aggregate(rounds_of({"p": [1.5]}))[1]
    assert one_round.speedup_min is None and one_round.rounds == 0
    # The JSON summary gains the fields and keeps every earlier one.
    out = tmp_path / "out.json"
    bench.write_json(out, {}, [], [base, spec])
    summary = json.loads(out.read_text(encoding="utf-8"))["summary"][1]
    assert {"speedup", "tokens_per_pass", "expected", "mean_draft_length"} <= set(summary)
    assert summary["speedup_min"] == pytest.approx(0.9) and summary["rounds"] == 3 and summary["impossible"] is False


def test_a_best_n_whose_rounds_straddle_target_only_is_within_noise():
    straddling = bench.aggregate(rounds_of({"p": [0.8, 1.5, 1.3]}))[1]  # median 1.3: "yes" on its own
    word, why = bench.verdict(straddling)
    assert word == bench.WITHIN_NOISE == "within noise"
    assert "rounds 0.80-1.50x" in why and "both sides of target-only" in why
    steady = bench.aggregate(rounds_of({"p": [1.25, 1.5, 1.3]}))[1]
    assert bench.verdict(steady)[0] == "yes" and "rounds 1.25-1.50x" in bench.verdict(steady)[1]
    slower = bench.aggregate(rounds_of({"p": [0.6, 0.7, 0.9]}))[1]
    assert bench.verdict(slower)[0] == "no"
    assert bench.verdict(bench.aggregate(rounds_of({"p": [1.5]}))[1])[0] == "yes"  # one round: no spread to judge by


def test_a_speedup_above_tokens_per_pass_is_flagged_impossible(capsys):
    from pathlib import Path
    from types import SimpleNamespace

    from specli.cli import bench as cli_bench

    # 11 tokens in 10 target passes: 1.10 tokens per pass, so at most 1.10x; it "measured" 2.37x.
    base, spec = bench.aggregate(rounds_of({"p": [2.37]}, tokens=11, passes=10))
    assert spec.tokens_per_pass == pytest.approx(1.1) and spec.speedup == pytest.approx(2.37)
    assert spec.impossible and bench.above_bound(spec.speedup, spec.tokens_per_pass)
    assert not bench.above_bound(1.1, 1.1)  # at the bound is possible (free drafts, equal passes)
    word, why = bench.verdict(spec)
    assert word == "within noise" and "impossible above its 1.10 tokens per target pass" in why
    plan = SimpleNamespace(mode="lookup", target_path=Path("t.gguf"))
    cli_bench._report([base, spec], {}, plan, [2], 1)
    out = capsys.readouterr().out
    assert "2.37x!" in out and "1.00x!" not in out
    (footnote,) = [line for line in out.splitlines() if line.startswith("x!:")]
    assert "speedup <= tokens/pass" in footnote and "measurement fault" in footnote
    assert "a: use speculative decoding? within noise — best N=2: 2.37x" in out
    assert "One round: noise unmeasured" in out  # --repeat 1: said once, before the verdicts


# --- pass costs: what the machine allows drafting at best ------------------------------------

# The llama-bench figures for Qwen2.5-Coder 1.5B Q4_K_M on 2 cores (T(1) = 34.8 ms, then
# T(k)/T(1) at k = 2/4/8/16) and its 0.5B draft at 0.58 of a target token.
QWEN_T = {1: 34.8e-3, 2: 34.8e-3 * 1.52, 4: 34.8e-3 * 2.34, 8: 34.8e-3 * 4.93, 16: 34.8e-3 * 5.80}
QWEN_TD = 0.58 * 34.8e-3


def test_lookup_ceiling_is_tokens_per_pass_over_the_pass_cost():
    c = costs.lookup_ceiling(QWEN_T)
    assert (c.speedup, c.n, c.width) == (pytest.approx(16 / 5.80), 15, 16)  # 2.76x
    narrow = costs.lookup_ceiling({k: v for k, v in QWEN_T.items() if k <= 4})
    assert (narrow.speedup, narrow.n) == (pytest.approx(4 / 2.34), 3)  # 1.71x
    assert costs.lookup_ceiling({1: 0.01, 2: 0.03}).speedup == 1.0  # wide passes dearer than narrow ones: N=0


def test_draft_ceiling_charges_each_draft_token():
    # N = 1, 3, 7: (N+1) / (T(N+1)/T(1) + 0.58 N) = 0.952, 0.980, 0.891: below 1 even with every draft accepted.
    upto8 = {k: v for k, v in QWEN_T.items() if k <= 8}
    c = costs.draft_ceiling(upto8, QWEN_TD)
    assert (c.speedup, c.n, c.width) == (pytest.approx(4 / (2.34 + 3 * 0.58)), 3, 4) and c.speedup < 1
    assert costs.draft_ceiling({1: 1.0, 2: 1.52}, 0.58).speedup == pytest.approx(2 / 2.10)  # 0.95x at N=1
    assert costs.break_even_alpha(upto8, QWEN_TD) is None  # no acceptance rate pays
    # With width 16 measured, N = 15 reaches 16 / (5.80 + 15 * 0.58) = 1.10x, and only near α = 0.99.
    wide = costs.draft_ceiling(QWEN_T, QWEN_TD)
    assert (wide.speedup, wide.n) == (pytest.approx(16 / 14.5), 15)
    assert costs.break_even_alpha(QWEN_T, QWEN_TD) == pytest.approx(0.987, abs=1e-3)
    # Flat passes and a cheap draft (a GPU): (1 - α^2)/(1 - α) = 1 + α = 1.1 breaks even at α = 0.1.
    assert costs.break_even_alpha({1: 1.0, 2: 1.0}, 0.1) == pytest.approx(0.1)
    assert (costs.alpha_text(0.987), costs.alpha_text(0.998)) == ("0.99", "0.998")  # not "1.00": that reads impossible


def test_the_conclusion_says_whether_drafting_can_pay():
    cpu = costs.PassCosts({k: v for k, v in QWEN_T.items() if k <= 8}, QWEN_TD)
    text = costs.conclusion(cpu)
    assert text.startswith("With this draft model drafting cannot pay on this machine, even if every draft were accepted (at most 0.98x, at N=3)")
    assert "prompt lookup can gain up to 1.71x (N=3) where the text repeats its input (--lookup)" in text
    gpu = costs.conclusion(costs.PassCosts({1: 0.010, 4: 0.0102, 16: 0.011}, 0.001))
    assert gpu.startswith("Wide passes are nearly free here (16 tokens cost 1.10x one): with this draft model drafting can gain at most")
    assert "cannot" not in costs.conclusion(costs.PassCosts(QWEN_T, None))  # lookup only: no draft model to judge
    assert ("can gain at most 1.10x (N=15) if every draft is accepted, and breaks even from a per-token acceptance of "
            "0.99, which a draft model rarely keeps up") in costs.conclusion(costs.PassCosts(QWEN_T, QWEN_TD))


def test_the_costs_json_object():
    doc = costs.PassCosts(QWEN_T, QWEN_TD, depth=128, samples=5).to_json()
    assert doc["relative"]["4"] == pytest.approx(2.34) and doc["draft_relative"] == pytest.approx(0.58)
    assert doc["lookup_ceiling"] == {"speedup": pytest.approx(16 / 5.80), "n": 15, "width": 16}
    assert doc["draft_ceiling"]["n"] == 15 and doc["draft_break_even_alpha"] == pytest.approx(0.987, abs=1e-3)
    json.dumps(doc)
    lookup_only = costs.PassCosts(QWEN_T).to_json()
    assert lookup_only["draft_s"] is None and lookup_only["draft_ceiling"] is None


def test_a_draft_ceiling_below_one_makes_the_verdict_no():
    capped = costs.PassCosts({k: v for k, v in QWEN_T.items() if k <= 8}, QWEN_TD)
    for speedup in (0.7, 1.1):  # "no" and "maybe" alike: the measured prices allow no gain
        word, why = bench.verdict(row(speedup=speedup), costs=capped)
        assert word == "no"
        assert "drafting with this draft model cannot pay on this machine" in why and "at most 0.98x (N=3)" in why
        assert "use --target-only, or --lookup for copy-heavy work" in why
    # 1.5x above a 0.98x ceiling: one of the two measurements is wrong.
    word, why = bench.verdict(row(speedup=1.5), costs=capped)
    assert word == bench.WITHIN_NOISE and "measurement fault" in why
    # Lookup is not bound by the draft model's ceiling.
    assert bench.verdict(row(speedup=1.5), lookup=True, costs=capped)[0] == "yes"
    # A ceiling above 1 that needs near-perfect acceptance: the reason names it.
    word, why = bench.verdict(row(speedup=0.8, acceptance=0.8), costs=costs.PassCosts(QWEN_T, QWEN_TD))
    assert word == "no" and "per-token probability 0.99 to break even, measured α 0.80: use --target-only" in why
    # Cheap wide passes (a GPU): break-even at α 0.1, so a draft below it is the draft's fault.
    gpu = costs.PassCosts({1: 1.0, 2: 1.0}, 0.1)
    assert "break even, measured α 0.05: try a better-matched draft" in bench.verdict(row(speedup=0.8, acceptance=0.05), costs=gpu)[1]


def test_the_report_shows_the_pass_costs_before_the_verdicts(capsys):
    from pathlib import Path
    from types import SimpleNamespace

    from specli.cli import bench as cli_bench
    from specli.modes import DraftMode

    capped = costs.PassCosts({k: v for k, v in QWEN_T.items() if k <= 8}, QWEN_TD)
    plan = SimpleNamespace(mode=DraftMode.DRAFT_MODEL, target_path=Path("t.gguf"), draft_path=Path("d.gguf"))
    cli_bench._report([row("a", 0, 1.0), row("a", 3, 0.8)], {}, plan, [3], 1, costs=capped)
    out = " ".join(capsys.readouterr().out.split())  # (Rich wraps long lines off a terminal)
    assert "1 token 34.8 ms = 1; 2 tokens 1.52x, 4 tokens 2.34x, 8 tokens 4.93x; a draft-model token 0.58x" in out
    assert "prompt lookup 1.71x (N=3), this draft model 0.98x (N=3)" in out
    assert out.index("drafting cannot pay on this machine") < out.index("a: use speculative decoding? no")
    assert out.endswith("use --target-only, or --lookup for copy-heavy work")


def test_measured_costs_have_every_width_and_leave_the_caches_empty(pair_perturbed):
    from conftest import load

    target, draft = (load(p) for p in pair_perturbed)
    try:
        measured = costs.measure(target, draft, samples=2)
        assert set(measured.target_s) == set(costs.WIDTHS) and all(t > 0 for t in measured.target_s.values())
        assert measured.relative()[1] == 1.0 and all(r > 0 for r in measured.relative().values())
        assert measured.draft_s > 0 and measured.draft is not None and measured.lookup.speedup >= 1.0
        assert target.cached == [] and draft.cached == []
        assert costs.measure(target, None, samples=1).draft_s is None
    finally:
        target.close()
        draft.close()


@pytest.mark.real_pair
@pytest.mark.slow
def test_measured_costs_on_the_real_pair(qwen_pair):
    from specli.llama.model import LlamaModel
    from specli.llama.native import init_backend

    init_backend()
    target, draft = (LlamaModel(p, n_ctx=512, n_threads=1) for p in qwen_pair)
    try:
        measured = costs.measure(target, draft, samples=3)
    finally:
        target.close()
        draft.close()
    rel = measured.relative()
    assert set(rel) == set(costs.WIDTHS) and all(r > 0 for r in rel.values()) and 0 < measured.draft_relative
    assert measured.draft is not None and measured.lookup.speedup >= 1.0
    assert costs.conclusion(measured).endswith("(--lookup).")


# --- schedule ------------------------------------------------------------------------------


def test_schedule_runs_everything_once_per_round_interleaved():
    jobs = bench.schedule(2, [N(1), N(3)], repeat=3)
    assert len(jobs) == 3 * 2 * 3 and len(set(jobs)) == len(jobs)
    first_round = [(j.prompt, j.n) for j in jobs if j.round == 0]
    # Within a round a prompt runs every configuration back to back, target-only included.
    assert first_round == [(0, OFF), (0, N(1)), (0, N(3)), (1, OFF), (1, N(1)), (1, N(3))]
    # The order of configurations rotates each round, so no configuration is always first.
    firsts = [next(j.n for j in jobs if j.round == r) for r in range(3)]
    assert firsts == [OFF, N(1), N(3)]
    # Rounds do not overlap: all of round r comes before round r + 1.
    assert [j.round for j in jobs] == sorted(j.round for j in jobs)


def test_seeds_change_per_round_not_per_configuration():
    assert [bench.run_seed(None, r) for r in range(3)] == [0, 1, 2]
    assert bench.run_seed(40, 2) == 42


def test_parse_ns():
    assert bench.parse_ns("8, 2,4,2") == [N(2), N(4), N(8)]
    assert bench.parse_ns("8,AUTO,2") == [AUTO, N(2), N(8)]
    for bad, fragment in (("2,x", "'x' is not a number"), ("0", "between 1 and 64"), ("65", "got 65"), ("", "not a number")):
        with pytest.raises(UsageError, match=fragment):
            bench.parse_ns(bad)


# --- built-in prompts and prompt files -----------------------------------------------------


def test_builtin_prompts_cover_the_scenarios():
    scenarios = {p.scenario for p in bench.BUILTIN_PROMPTS}
    assert scenarios == {
        "long-form", "short-chat", "code-generation", "code-editing", "summarization", "creative-writing", "non-english",
    }
    assert len({p.name for p in bench.BUILTIN_PROMPTS}) == len(bench.BUILTIN_PROMPTS)
    long_form = next(p for p in bench.BUILTIN_PROMPTS if p.scenario == "long-form")
    chat = next(p for p in bench.BUILTIN_PROMPTS if p.scenario == "short-chat")
    assert bench.token_budget(long_form, 128) > 200 and bench.token_budget(chat, 128) < 50
    assert bench.token_budget(chat, 8) == 8


def test_plain_prompt_file_is_one_prompt_per_line(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("first prompt\n\n  \nsecond {not json}\n", encoding="utf-8")
    prompts = bench.parse_prompt_file(path)
    assert [(p.name, p.scenario, p.text) for p in prompts] == [
        ("line-1", "custom", "first prompt"), ("line-4", "custom", "second {not json}"),
    ]


def test_jsonl_prompt_file(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a\\nb", "name": "x", "scenario": "code"}\n\n{"prompt": "c"}\n', encoding="utf-8")
    prompts = bench.parse_prompt_file(path)
    assert [(p.name, p.scenario, p.text) for p in prompts] == [("x", "code", "a\nb"), ("line-3", "custom", "c")]


@pytest.mark.parametrize(
    "content, fragment",
    [
        ('{"prompt": "ok"}\n{"prompt": broken\n', "line 2: not valid JSON"),
        ('{"prompt": "ok"}\n\n["a list"]\n', "line 3: expected an object"),
        ('{"name": "no prompt"}\n', "line 1: \"prompt\" must be a non-empty string"),
        ('{"prompt": "ok", "scenario": 3}\n', "line 1: \"scenario\" must be a non-empty string"),
        ("\n  \n", "has no prompts"),
    ],
)
def test_prompt_file_errors_name_the_line(tmp_path, content, fragment):
    path = tmp_path / "p.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(UsageError) as err:
        bench.parse_prompt_file(path)
    message = str(err.value)
    assert fragment in message and "\n" not in message


def test_prompt_file_not_utf8_names_the_line(tmp_path):
    path = tmp_path / "p.txt"
    path.write_bytes(b"fine\nbad \xff byte\n")
    with pytest.raises(UsageError, match="line 2: not UTF-8"):
        bench.parse_prompt_file(path)


# --- the command, for real -----------------------------------------------------------------


def specli(*args: str, cwd=None):
    return subprocess.run([sys.executable, "-m", "specli", *args], capture_output=True, text=True, timeout=300, cwd=cwd, env=dict(os.environ))


def test_bench_command_runs_every_configuration(pair_perturbed, tmp_path):
    target, draft = map(str, pair_perturbed)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        '{"prompt": "Once upon a time", "name": "story", "scenario": "creative"}\n'
        '{"prompt": "def main():", "name": "code"}\n', encoding="utf-8",
    )
    out_json, out_csv = tmp_path / "out.json", tmp_path / "out.csv"
    result = specli(
        "bench", "-m", target, "-d", draft, "--draft-max", "1,3", "--max-tokens", "8", "--repeat", "1",
        "--prompts", str(prompts), "--json", str(out_json), "--csv", str(out_csv),
    )
    assert result.returncode == 0, result.stderr
    doc = json.loads(out_json.read_text(encoding="utf-8"))
    assert set(doc) == {"settings", "runs", "summary", "held_out_best", "costs"}
    # The pass costs measured on the pair: no timing thresholds, only their shape.
    assert set(doc["costs"]["relative"]) == {"1", "2", "4", "8", "16"} and doc["costs"]["relative"]["1"] == 1.0
    assert all(r > 0 for r in doc["costs"]["relative"].values()) and doc["costs"]["draft_relative"] > 0
    assert doc["costs"]["draft_ceiling"]["n"] >= 1 and doc["costs"]["lookup_ceiling"]["speedup"] >= 1.0
    assert doc["held_out_best"] == {}  # one round: nothing to pick N on and score it elsewhere
    assert doc["settings"]["ns"] == [1, 3] and doc["settings"]["sampling"]["greedy"] is True
    runs = doc["runs"]
    assert sorted((r["prompt"], r["n_draft"]) for r in runs) == [
        ("code", 0), ("code", 1), ("code", 3), ("story", 0), ("story", 1), ("story", 3),
    ]
    for r in runs:
        assert set(bench.RECORD_FIELDS) <= set(r)
        assert 1 <= r["n_tokens"] <= 8 and r["stop_reason"] in {"eos", "max_tokens"}
        assert (r["drafted"] == 0) == (r["n_draft"] == 0)
        assert r["drafter"] == (None if r["n_draft"] == 0 else "draft-model")
    assert sorted((s["scenario"], s["n"]) for s in doc["summary"]) == [
        ("creative", 0), ("creative", 1), ("creative", 3), ("custom", 0), ("custom", 1), ("custom", 3),
    ]
    with out_csv.open(encoding="utf-8", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == len(runs) and tuple(rows[0]) == bench.RECORD_FIELDS
    # The report: a table per scenario and a verdict each, nothing from the progress bar.
    assert "use speculative decoding?" in result.stdout
    assert result.stdout.count("use speculative decoding?") == 2 and "Best fixed N overall" in result.stdout
    assert "Pass costs here (target, after 128 tokens of context" in result.stdout
    assert "Ceilings over target-only with every draft accepted: prompt lookup" in result.stdout
    assert "measuring pass costs" not in result.stderr  # (the spinner: a terminal's only)


def test_bench_usage_errors_are_one_line(tmp_path):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "x"}\nnot json\n', encoding="utf-8")
    for args, fragment in (
        (("--prompts", str(bad)), "line 2"),
        (("--n", "1,zero"), "'zero' is not a number"),  # --n: the older spelling of --draft-max
        (("--repeat", "0"), "Invalid value for '--repeat'"),
        (("--json", str(tmp_path / "missing" / "o.json")), "does not exist"),
    ):
        result = specli("bench", *args)
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("specli: error: ") and fragment in lines[0]


def test_plot_without_matplotlib_names_the_install(monkeypatch):
    from specli.cli import bench as cli_bench

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import now fails, installed or not
    with pytest.raises(UsageError, match="pip install matplotlib"):
        cli_bench._require_matplotlib()
