"""`specli run`: one prompt, its continuation streamed to stdout, live stats on stderr.

Also what `batch` shares with it: a record is `run --json`'s object (result_json).
"""

from __future__ import annotations

import json
import sys
from typing import Optional

import typer

from specli.errors import EXIT_INTERRUPTED
from specli.cli.options import (
    Drafting, Memory, Models, Quiet, Sampling, ShowAccept, Threads, Verbose, flatten, load_models, max_tokens_option,
    model_choice,
)  # fmt: skip
from specli.decoding.sampling import sampling_json
from specli.errors import UsageError
from specli.files import read_limited, strip_bom
from specli.session.loading import plan

commands = typer.Typer()


@commands.command("run")
@flatten
def run(
    prompt: Optional[str] = typer.Argument(None, help="Text to continue. '-' (or nothing, with piped input) reads stdin."),
    *,
    models: Models,
    drafting: Drafting,
    max_tokens: int = max_tokens_option("Stop after this many generated tokens."),
    memory: Memory,
    threads: Threads = None,
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object (text, token ids, stats) instead of streaming text."),
    quiet: Quiet = False,
    verbose: Verbose = False,
    show_accept: ShowAccept = False,
    sampling: Sampling,
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed for sampling (default: a fresh one, reported in --json)."),
) -> int:
    """Generate a continuation of PROMPT, streamed to stdout, with live stats on stderr."""
    from specli.cli.render import low_acceptance_warning, stream_generation, summary_line
    from specli.llama.native import init_backend

    choice = model_choice(models, memory, sampling, threads=threads, seed=seed, drafting=drafting)
    text = read_prompt(prompt)
    init_backend(verbose=verbose)
    the_plan = plan(choice)
    loaded = load_models(the_plan, choice, quiet=quiet, verbose=verbose)
    try:
        model_tgt = loaded.model_tgt
        prompt_ids = model_tgt.tokenize(text, add_bos=model_tgt.vocab_info().add_bos)
        gen = loaded.decoder.generate(prompt_ids, max_tokens=max_tokens)
        with_drafting = the_plan.mode != "target-only"
        interrupted = stream_generation(
            gen, sys.stdout, sys.stderr, show_text=not json_out, live=not quiet and not verbose,
            show_accept=show_accept, with_drafting=with_drafting,
        )
        if json_out:
            print(json.dumps(result_json(gen, the_plan), ensure_ascii=False))
            sys.stdout.flush()
        if not quiet:
            print(summary_line(gen.stats, stop_reason=gen.stop_reason, with_drafting=with_drafting), file=sys.stderr)
            warning = (
                low_acceptance_warning(gen.stats, lookup=the_plan.mode == "lookup", adaptive=loaded.decoder.adaptive)
                if with_drafting else None
            )  # fmt: skip
            if warning:
                print(warning, file=sys.stderr)
            if seed is not None and not the_plan.sampling.greedy and loaded.decoder.adaptive:
                print("note: with -n auto the draft lengths follow timings and the random draws follow them: "
                      "this seed replays the distribution, not this text; add a fixed -n (e.g. -n 5) to replay "
                      "a sampled run exactly", file=sys.stderr)  # fmt: skip
        return EXIT_INTERRUPTED if interrupted else 0
    finally:
        loaded.close()


def read_prompt(prompt: Optional[str]) -> str:
    """The prompt argument, or stdin for '-' (or when omitted and stdin is piped); UTF-8 only."""
    if prompt is None or prompt == "-":
        if prompt is None and sys.stdin.isatty():
            raise UsageError("no prompt given; pass one (specli run \"...\") or pipe it (echo ... | specli run -)")
        try:
            prompt = strip_bom(read_limited(sys.stdin.buffer, "the prompt on stdin")).decode("utf-8")
        except UnicodeDecodeError as err:
            raise UsageError(f"the prompt on stdin is not UTF-8 text (bad byte at offset {err.start}); convert it first, e.g. with iconv") from None
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError("the prompt is not valid UTF-8 text; check your terminal's encoding") from None
    if not prompt.strip():
        raise UsageError("the prompt is empty; give some text for the model to continue")
    return prompt


def result_json(gen, the_plan) -> dict:
    """`run --json`'s object (and a batch record's fields)."""
    return {
        "text": gen.text,
        "token_ids": gen.token_ids,
        "n_tokens": len(gen.token_ids),
        "stop_reason": gen.stop_reason,
        "target": str(the_plan.target_path),
        "draft": the_plan.draft_label,
        "n_draft": the_plan.n_draft if the_plan.mode != "target-only" else 0,  # a number or "auto"
        "sampling": sampling_json(the_plan.sampling),
        "seed": gen.seed,
        "stats": gen.stats.to_dict(),
    }
