"""`specli bench`: measure what speculative decoding gets on this machine, pair and prompts.

The models load once; every configuration (target-only, then each N) runs in this process
through SpeculativeDecoder, in the interleaved order of bench.schedule. The measuring loop and
the numbers live in session/bench.py; this module parses the options, shows the progress and
renders the tables.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Optional

import typer

from specli.cli.options import Models, Placement, Quiet, Sampling, Threads, Verbose, flatten, load_models, max_tokens_option, model_choice, require_stdout
from specli.decoding.sampling import sampling_json
from specli.errors import UsageError
from specli.files import check_writable
from specli.llama.native import init_backend
from specli.modes import DraftLength, DraftMode
from specli.session import bench
from specli.session import costs as pass_costs
from specli.session.loading import plan

MATPLOTLIB_MISSING = "--plot needs matplotlib, which is not installed; pip install matplotlib"

commands = typer.Typer()


@commands.command("bench")
@flatten
def bench_command(
    *,
    models: Models,
    ns_text: str = typer.Option(",".join(map(str, bench.DEFAULT_NS)), "--draft-max", "--n", "--spec-draft-n-max", "--num-speculative-tokens",
        help=("Draft lengths N to measure, comma-separated (target-only always runs too).")),
    repeat: int = typer.Option(1, "--repeat", min=1, help="Rounds: each runs every prompt and configuration once, interleaved; the tables show medians."),
    prompts_file: Optional[Path] = typer.Option(None, "--prompts", help="Prompt file: one prompt per line, or JSONL with \"prompt\" and optional \"name\", \"scenario\". Default: the built-in set."),
    max_tokens: int = max_tokens_option("Generated tokens per run (long-form runs twice this, short chat at most 48).", 128),
    placement: Placement,
    threads: Threads = None,
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the raw numbers (one record per run) and the summary to this JSON file."),
    csv_path: Optional[Path] = typer.Option(None, "--csv", help="Write one CSV row per run to this file."),
    plot_path: Optional[Path] = typer.Option(None, "--plot", help="Draw speedup vs N per scenario into this PNG (needs matplotlib)."),
    quiet: Quiet = False,
    verbose: Verbose = False,
    sampling: Sampling = Sampling(temperature=0.0),  # greedy: measures cleanly
    seed: Optional[int] = typer.Option(None, "--seed", help="Base seed when sampling: round r uses seed + r (default 0 + r)."),
) -> int:
    """Measure target-only vs speculative decoding for several N on a prompt set, and say
    whether speculative decoding pays off. Greedy by default (--temperature 0), which measures
    cleanly; --temperature > 0 samples, with a seed per round."""
    require_stdout()  # (the tables)
    ns = bench.parse_ns(ns_text)
    choice = model_choice(models, placement, sampling, threads=threads, seed=seed)
    prompts = bench.parse_prompt_file(prompts_file) if prompts_file else list(bench.BUILTIN_PROMPTS)
    for path, option in ((json_path, "--json"), (csv_path, "--csv"), (plot_path, "--plot")):
        if path is not None:
            check_writable(path, f"the {option} file")
    if plot_path is not None:
        _require_matplotlib()  # before the (slow) measurement, not after it
    init_backend(verbose=verbose)
    the_plan = plan(choice)
    loaded = load_models(the_plan, choice, quiet=quiet, verbose=verbose)
    try:
        costs = _measure_costs(loaded, quiet=quiet or verbose)
        records = _measure(loaded, prompts, ns, repeat, max_tokens, choice.sampling, quiet=quiet or verbose)
    finally:
        loaded.close()

    rows = bench.aggregate(records)
    held_out = bench.held_out_best(records)
    _report(rows, held_out, the_plan, ns, repeat, costs=costs)
    settings = {
        "target": str(the_plan.target_path), "draft": the_plan.draft_label, "ns": [n.json_value for n in ns], "repeat": repeat,
        "max_tokens": max_tokens, "ctx": placement.n_ctx, "threads": threads, "sampling": sampling_json(choice.sampling),
        "seed_base": seed if not choice.sampling.greedy else None,
        "prompts": [dataclasses.asdict(p) for p in prompts],
    }
    if json_path:
        bench.write_json(json_path, settings, records, rows, held_out, costs)
    if csv_path:
        bench.write_csv(csv_path, records)
    if plot_path:
        _plot(plot_path, rows)
    return 0


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError(MATPLOTLIB_MISSING) from None


def _measure_costs(loaded, *, quiet: bool) -> pass_costs.PassCosts:
    """The target's pass costs by width and the draft model's token (session/costs.py; a few
    seconds), with a spinner on a terminal."""
    from specli.cli.render import stderr_console

    if quiet or not sys.stderr.isatty():
        return pass_costs.measure(loaded.model_tgt, loaded.model_dft)
    with stderr_console().status("measuring pass costs"):
        return pass_costs.measure(loaded.model_tgt, loaded.model_dft)


def _measure(loaded, prompts, ns, repeat, max_tokens, sampling, *, quiet: bool) -> list[dict]:
    """session/bench.py's BenchLoop with a progress bar on a terminal; one record (dict) per run."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from specli.cli.render import stderr_console

    loop = bench.BenchLoop(loaded, prompts, ns, repeat, max_tokens, sampling)  # (checks the prompts, warms up)
    records = []
    show = not quiet and sys.stderr.isatty()
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=stderr_console(), transient=True, disable=not show) as progress:
        task = progress.add_task("bench", total=len(loop.jobs))
        for event in loop.runs():
            if isinstance(event, bench.Starting):
                job = event.job
                progress.update(task, description=f"round {job.round + 1}/{repeat} {event.prompt.name} " + ("target-only" if job.n.is_off else f"N={job.n}"))
            else:
                records.append(event.record)
                progress.advance(task)
    return records


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _spread(row: bench.Row) -> str:
    """The row's lowest-highest speedup over rounds, or "-" (one round, or target-only); "x!"
    when the highest is above the row's tokens per pass."""
    if row.speedup_min is None or row.speedup_max is None:
        return "-"
    return f"{row.speedup_min:.2f}-{row.speedup_max:.2f}" + ("x!" if bench.above_bound(row.speedup_max, row.tokens_per_pass) else "x")


def _report(rows: list[bench.Row], held_out: dict[str, float], the_plan, ns: list[DraftLength], repeat: int, *,
            costs: pass_costs.PassCosts | None = None) -> None:
    """The tables, best N and verdicts, on stdout (Rich; plain text when not a terminal).
    held_out: bench.held_out_best's figure per scenario; costs: the measured pass costs, shown
    before the verdicts (which a draft model's run takes them into)."""
    from rich.console import Console
    from rich.table import Table

    out = Console(file=sys.stdout, highlight=False, width=None if sys.stdout.isatty() else 160)
    drafter = "prompt lookup" if the_plan.mode == DraftMode.LOOKUP else f"draft model {the_plan.draft_path.name}"
    if the_plan.mode == DraftMode.HYBRID:
        drafter = f"prompt lookup, else draft model {the_plan.draft_path.name}"
    out.print(f"target {the_plan.target_path.name}, {drafter}; median of {repeat} round(s) per configuration")
    faults = 0  # rows whose speedup is above their tokens per pass
    for scenario in dict.fromkeys(row.scenario for row in rows):
        table = Table(title=scenario, title_justify="left")
        for header in ("N", "tok/s", "speedup", "spread", "acceptance", "drafts/pass", "tokens/pass", "draft ms/tok", "verify ms/tok", "α", "c", "expected"):
            table.add_column(header, justify="right")
        for row in (r for r in rows if r.scenario == scenario):
            impossible = bench.above_bound(row.speedup, row.tokens_per_pass)
            faults += impossible or bench.above_bound(row.speedup_max, row.tokens_per_pass)
            table.add_row(
                str(row.n) if row.n else "target-only", _fmt(row.tokens_per_s, ".1f"),
                _fmt(row.speedup, ".2f", "x!" if impossible else "x"), _spread(row),
                _fmt(row.acceptance, ".0%"), _fmt(row.mean_draft_length, ".1f"), _fmt(row.tokens_per_pass, ".2f"),
                _fmt(row.draft_ms_per_token, ".2f"),
                _fmt(row.verify_ms_per_token, ".2f"), _fmt(row.alpha, ".2f"), _fmt(row.cost_ratio, ".3f"),
                _fmt(row.expected, ".2f", "x"),
            )
        out.print(table)
    if faults:
        out.print("x!: impossible, above tokens/pass (a target pass costs at least a plain one, so speedup <= "
                  "tokens/pass): a measurement fault")
    out.print(
        "spread: the lowest-highest speedup over the rounds (--repeat 2 or more): what noise alone moves. "
        "N auto: the draft length chosen each step (drafts/pass is its mean). "
        "α: per-token acceptance (accepted / (accepted + rejecting steps)); c: draft time per drafted token / "
        "target one-token pass time; expected: Leviathan et al. (1-α^(N+1))/((1-α)(Nc+1)), which ignores "
        "that wider target passes cost more."
    )
    best = bench.best_per_scenario(rows)
    overall = bench.best_overall(rows)
    if overall:
        out.print(f"Best fixed N overall: {overall[0]} ({overall[1]:.2f}x, geometric mean over scenarios)")
    for scenario, (auto, best_fixed) in bench.auto_summary(rows).items():
        against = ""
        if best_fixed is not None and auto.speedup is not None and best_fixed.speedup:
            against = f", {auto.speedup / best_fixed.speedup:.2f} of the best fixed N={best_fixed.n} ({best_fixed.speedup:.2f}x)"
        if auto.speedup is not None and held_out.get(scenario):
            against += f", {auto.speedup / held_out[scenario]:.2f} of an N picked on the other rounds ({held_out[scenario]:.2f}x)"
        noise = ""
        if best_fixed is not None and best_fixed.speedup is not None and bench.within_noise(auto, best_fixed.speedup):
            noise = f"; the best fixed N's {best_fixed.speedup:.2f}x lies within auto's rounds: within noise"
        out.print(f"{scenario}: auto {_fmt(auto.speedup, '.2f', 'x')} target-only{against}, "
                  f"{_fmt(auto.mean_draft_length, '.1f')} drafts per pass{noise}")
    worst = bench.worst_against_best(rows)
    if bench.AUTO in worst and len(worst) > 1:
        fixed = ", ".join(f"N={n} {r:.2f}" for n, r in worst.items() if n != bench.AUTO)
        out.print(f"Worst scenario against the best fixed N: auto {worst[bench.AUTO]:.2f}; {fixed} "
                  "(a fixed N is held against a best that includes itself)")
    autos = [row for row in rows if row.n == bench.AUTO and row.speedup is not None and held_out.get(row.scenario)]
    if autos:
        low = min(autos, key=lambda row: row.speedup / held_out[row.scenario])
        out.print(f"Worst scenario against an N picked on the other rounds: auto {low.speedup / held_out[low.scenario]:.2f} "
                  f"({low.scenario}; a sweep's best figure is the highest of several noisy ones, a pick scored on "
                  "rounds it did not see is not)")
    if repeat < 2:
        out.print("One round: noise unmeasured, so a verdict may flip from one bench to the next; "
                  "--repeat 3 shows each speedup's spread and says when it is within noise")
    if costs is not None:
        for line in _cost_lines(costs):
            out.print(line)
    # (hybrid's lookup steps are not bound by the draft model's ceiling: only a draft model's verdict takes it)
    capped = costs if the_plan.mode == DraftMode.DRAFT_MODEL else None
    for scenario in dict.fromkeys(row.scenario for row in rows):
        word, why = bench.verdict(best.get(scenario), lookup=the_plan.mode == DraftMode.LOOKUP, costs=capped)
        out.print(f"{scenario}: use speculative decoding? {word} — {why}")


def _cost_lines(costs: pass_costs.PassCosts) -> list[str]:
    """The measured pass costs, the ceilings they allow and what that means, in three lines."""
    rel = costs.relative()
    widths = ", ".join(f"{w} tokens {r:.2f}x" for w, r in rel.items() if w != 1)
    draft = f"; a draft-model token {costs.draft_relative:.2f}x" if costs.draft_relative is not None else ""
    ceilings = f"prompt lookup {costs.lookup.speedup:.2f}x (N={costs.lookup.n})"
    if costs.draft is not None:
        ceilings += f", this draft model {costs.draft.speedup:.2f}x (N={costs.draft.n})"
    return [
        f"Pass costs here (target, after {costs.depth} tokens of context, median of {costs.samples}): 1 token "
        f"{costs.target_s[1] * 1e3:.3g} ms = 1; {widths}{draft}",
        f"Ceilings over target-only with every draft accepted: {ceilings}",
        pass_costs.conclusion(costs),
    ]


def _plot(path: Path, rows: list[bench.Row]) -> None:
    """Speedup vs N, one line per scenario, with 1.0 (target-only) marked."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for scenario in dict.fromkeys(row.scenario for row in rows):
        pts = [(r.n, r.speedup) for r in rows if r.scenario == scenario and bench.is_fixed(r.n) and r.speedup is not None]
        if pts:
            (line,) = ax.plot(*zip(*pts), marker="o", label=scenario)
            for auto in (r for r in rows if r.scenario == scenario and r.n == bench.AUTO and r.speedup is not None):
                ax.axhline(auto.speedup, color=line.get_color(), linestyle=":", linewidth=1)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("N (draft tokens per step)")
    ax.set_ylabel("speedup over target-only")
    ax.legend(fontsize="small")
    try:
        fig.savefig(path, dpi=120, bbox_inches="tight")
    except OSError as err:
        raise UsageError(f"cannot write {path}: {err.strerror}") from None
    finally:
        plt.close(fig)
