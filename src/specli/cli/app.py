"""The `specli` command line: parses options and wires the pieces together.

Exit codes: 0 success, 1 runtime failure, 2 bad usage or input, 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import sys

EXIT_INTERRUPTED = 130


def _exit_interrupted() -> None:
    """Ctrl-C: one line, exit 130; a second Ctrl-C while leaving cannot print a traceback."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        print("specli: interrupted", file=sys.stderr)
    except OSError:
        pass
    raise SystemExit(EXIT_INTERRUPTED)


# Importing what follows takes a while (llama.cpp's library among it): a Ctrl-C meanwhile is
# still one line and exit 130, whether specli runs as `specli` or `python -m specli`.
try:
    import dataclasses
    import json
    import os
    import traceback
    from typing import Annotated, Optional

    import typer

    from specli import __version__
    from specli.errors import EXIT_RUNTIME, EXIT_USAGE, SpecliError, UsageError
    from specli.decoding.engine import MAX_DRAFT, parse_draft_length
    from specli.files import read_limited, strip_bom
    from specli.llama.model import validate_ctx
    from specli.session.loading import ModelChoice, load, plan
    from specli.decoding.sampling import SamplingParams
except KeyboardInterrupt:
    _exit_interrupted()

# --threads above this many per logical CPU is a typo, not a setting (llama.cpp would start them all).
MAX_THREADS_PER_CPU = 4
# --ngl / --draft-ngl: -1 (all layers) or a count up to this. llama.cpp keeps the count in 32 bits
# (a larger number would wrap around silently); GGUF models have at most 512 layers.
MAX_NGL = 10_000

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    help="Speculative decoding for local GGUF models: the target model's output (greedy, or its sampling distribution), sooner.",
)


def _version(value: bool) -> None:
    if value:
        print(f"specli {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Show the version and exit."),
) -> None:
    """Speculative decoding for local GGUF models."""


# Options shared by the generating commands (run, chat), declared once.
ModelOpt = Annotated[Optional[str], typer.Option("-m", "--model", help="Target model: a GGUF path or a models.toml name. Default: the embedded Gemma 3 270M.")]
DraftOpt = Annotated[Optional[str], typer.Option("-d", "--draft", help="Draft model: a GGUF path or a models.toml name (same tokenizer as the target).")]
LookupOpt = Annotated[bool, typer.Option("--lookup", help="Draft by prompt lookup (copying from the text so far); no draft model.")]
TargetOnlyOpt = Annotated[bool, typer.Option("--target-only", help="Plain decoding with the target alone: the baseline.")]
NDraftOpt = Annotated[Optional[str], typer.Option("-n", "--num-speculative-tokens", metavar="auto|N", help="Draft tokens per step: 'auto' (default: chosen each step from measured costs and acceptance) or a fixed number 1-64.")]
CtxOpt = Annotated[int, typer.Option("-c", "--ctx", help="Context size in tokens (prompt + output).")]
NglOpt = Annotated[int, typer.Option("--ngl", help="Target layers to offload to the GPU (-1 = all).")]
DraftNglOpt = Annotated[int, typer.Option("--draft-ngl", help="Draft model layers to offload to the GPU (-1 = all).")]
ThreadsOpt = Annotated[Optional[int], typer.Option("--threads", help="CPU threads (default: physical cores).")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="Nothing on stderr except errors.")]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="Show llama.cpp's log and tracebacks.")]
ShowAcceptOpt = Annotated[bool, typer.Option("--show-accept", help="On a terminal, colour text that came from accepted drafts.")]
TemperatureOpt = Annotated[float, typer.Option("--temperature", "--temp", help="Sampling temperature; 0 = greedy (deterministic).")]
TopKOpt = Annotated[int, typer.Option("--top-k", help="Keep the k most likely tokens (0 = off).")]
TopPOpt = Annotated[float, typer.Option("--top-p", help="Keep the smallest set of tokens with this much probability (1 = off).")]
MinPOpt = Annotated[float, typer.Option("--min-p", help="Drop tokens below this fraction of the best token's probability (0 = off).")]
RepeatPenaltyOpt = Annotated[float, typer.Option("--repeat-penalty", help="Penalise recently seen tokens (1 = off).")]
RepeatLastNOpt = Annotated[int, typer.Option("--repeat-last-n", help="How many recent tokens the repeat penalty looks at.")]


def _model_choice(
    model, draft, lookup, target_only, n_draft, max_tokens, ctx, ngl, draft_ngl, threads,
    temperature, top_k, top_p, min_p, repeat_penalty, repeat_last_n, seed,
) -> ModelChoice:  # fmt: skip
    """Check the shared options (before any model loads) and bundle them."""
    if threads is not None and threads < 1:
        raise UsageError(f"--threads must be at least 1, got {threads}")
    cpus = os.cpu_count()
    if threads is not None and cpus and threads > MAX_THREADS_PER_CPU * cpus:
        raise UsageError(
            f"--threads {threads} is more than {MAX_THREADS_PER_CPU} per CPU of this machine ({cpus} CPUs); "
            f"use at most {MAX_THREADS_PER_CPU * cpus}, or leave it out for one per physical core"
        )
    validate_ctx(ctx)
    check_ngl(ngl, draft_ngl)
    if max_tokens < 1:
        raise UsageError(f"--max-tokens must be at least 1, got {max_tokens}")
    sampling = SamplingParams(temperature, top_k, top_p, min_p, repeat_penalty, repeat_last_n, seed).validate()
    return ModelChoice(model, draft, lookup, target_only, parse_n_draft(n_draft), ctx, ngl, draft_ngl, threads, sampling)


def check_ngl(ngl: int, draft_ngl: int) -> None:
    """UsageError unless --ngl and --draft-ngl are -1 (all layers) or 0..MAX_NGL."""
    for option, value in (("--ngl", ngl), ("--draft-ngl", draft_ngl)):
        if not -1 <= value <= MAX_NGL:
            raise UsageError(f"{option} must be -1 (all layers) or a layer count from 0 to {MAX_NGL:,}, got {value}")


def parse_n_draft(text: str | None) -> int | str | None:
    """-n's value: "auto", a number of drafts, or None (not given)."""
    if text is None:
        return None
    try:
        return parse_draft_length(text)
    except ValueError as err:
        raise UsageError(f"-n must be 'auto' or between 1 and {MAX_DRAFT} draft tokens per step; {err}") from None


def _load(the_plan, choice: ModelChoice, *, quiet: bool, verbose: bool = False):
    """Load the plan's models, with a spinner on a terminal; say so when saved measurements
    were ignored (--verbose: why)."""
    from specli.cli.render import stderr_console

    if quiet or not sys.stderr.isatty():
        loaded = load(the_plan, choice)
    else:
        names = the_plan.target_path.name + (f" and {the_plan.draft_path.name}" if the_plan.draft_path else "")
        with stderr_console().status(f"loading {names}"):
            loaded = load(the_plan, choice)
    if loaded.policy_notice and not quiet:
        print(loaded.policy_notice + (f": {loaded.policy_problem}" if verbose else ""), file=sys.stderr)
    return loaded


def _read_prompt(prompt: Optional[str]) -> str:
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


@app.command()
def run(
    prompt: Optional[str] = typer.Argument(None, help="Text to continue. '-' (or nothing, with piped input) reads stdin."),
    model: ModelOpt = None,
    draft: DraftOpt = None,
    lookup: LookupOpt = False,
    target_only: TargetOnlyOpt = False,
    n_draft: NDraftOpt = None,
    max_tokens: int = typer.Option(256, "--max-tokens", help="Stop after this many generated tokens."),
    ctx: CtxOpt = 4096,
    ngl: NglOpt = -1,
    draft_ngl: DraftNglOpt = -1,
    threads: ThreadsOpt = None,
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object (text, token ids, stats) instead of streaming text."),
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
    show_accept: ShowAcceptOpt = False,
    temperature: TemperatureOpt = 0.8,
    top_k: TopKOpt = 40,
    top_p: TopPOpt = 0.95,
    min_p: MinPOpt = 0.05,
    repeat_penalty: RepeatPenaltyOpt = 1.0,
    repeat_last_n: RepeatLastNOpt = 64,
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed for sampling (default: a fresh one, reported in --json)."),
) -> int:
    """Generate a continuation of PROMPT, streamed to stdout, with live stats on stderr."""
    from specli.llama.model import init_backend
    from specli.cli.render import low_acceptance_warning, stream_generation, summary_line

    choice = _model_choice(
        model, draft, lookup, target_only, n_draft, max_tokens, ctx, ngl, draft_ngl, threads,
        temperature, top_k, top_p, min_p, repeat_penalty, repeat_last_n, seed,
    )  # fmt: skip
    text = _read_prompt(prompt)
    init_backend(verbose=verbose)
    the_plan = plan(choice)
    loaded = _load(the_plan, choice, quiet=quiet, verbose=verbose)
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
            print(json.dumps(_result_json(gen, the_plan), ensure_ascii=False))
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


def _result_json(gen, the_plan) -> dict:
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


def sampling_json(sampling: SamplingParams) -> dict:
    """The sampling settings as run (greedy runs report temperature 0 and nothing random)."""
    fields = dataclasses.asdict(sampling)
    fields.pop("seed")
    fields["greedy"] = sampling.greedy
    return fields


@app.command()
def chat(
    model: ModelOpt = None,
    draft: DraftOpt = None,
    lookup: LookupOpt = False,
    target_only: TargetOnlyOpt = False,
    n_draft: NDraftOpt = None,
    max_tokens: int = typer.Option(256, "--max-tokens", help="Generated tokens at most per reply."),
    ctx: CtxOpt = 4096,
    ngl: NglOpt = -1,
    draft_ngl: DraftNglOpt = -1,
    threads: ThreadsOpt = None,
    system: Optional[str] = typer.Option(None, "--system", help="System prompt for the conversation."),
    template: Optional[str] = typer.Option(None, "--template", help="A llama.cpp built-in chat template (chatml, gemma, llama3, ...) instead of the model's own."),
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
    show_accept: ShowAcceptOpt = False,
    temperature: TemperatureOpt = 0.8,
    top_k: TopKOpt = 40,
    top_p: TopPOpt = 0.95,
    min_p: MinPOpt = 0.05,
    repeat_penalty: RepeatPenaltyOpt = 1.0,
    repeat_last_n: RepeatLastNOpt = 64,
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed for sampling (default: a fresh one per reply)."),
) -> int:
    """Chat with a model: replies streamed to stdout, per-turn stats on stderr; /help lists the commands."""
    from specli.session.chat import ChatOptions, ChatSession, LineReader, check_template_name, choose_formatter
    from specli.llama.model import init_backend

    choice = _model_choice(
        model, draft, lookup, target_only, n_draft, max_tokens, ctx, ngl, draft_ngl, threads,
        temperature, top_k, top_p, min_p, repeat_penalty, repeat_last_n, seed,
    )  # fmt: skip
    reader = LineReader(sys.stdin, sys.stdout, sys.stderr)  # a bad SPECLI_MAX_INPUT_BYTES: before the load
    init_backend(verbose=verbose)
    if template is not None:
        check_template_name(template)  # before the (slow) load
    the_plan = plan(choice)
    loaded = _load(the_plan, choice, quiet=quiet, verbose=verbose)
    try:
        formatter, notice = choose_formatter(loaded.model_tgt, template)
        if notice and not quiet:
            print(notice, file=sys.stderr)
        options = ChatOptions(max_tokens=max_tokens, system=system, template=template, quiet=quiet, verbose=verbose, show_accept=show_accept)
        session = ChatSession(loaded, formatter, options)
        return session.loop(reader)
    finally:
        loaded.close()


def main(argv: list[str] | None = None) -> int:
    """Entry point: runs the app, turns every failure into one line on stderr and an exit code.

    (Typer itself turns Ctrl-C inside a command into exit 130, silently, and a closed stdout
    pipe into exit 1.)
    """
    try:
        code = _main(argv)
    except KeyboardInterrupt:  # outside a command, or while reporting an error
        _exit_interrupted()
    sys.exit(code)


def _main(argv: list[str] | None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        args = ["--help"]  # `specli` alone: the help, not an error
    verbose = "--verbose" in args or "-v" in args
    try:
        code = app(args=args, standalone_mode=False, prog_name="specli")
        code = code if isinstance(code, int) else 0
    except SpecliError as err:
        if verbose:
            traceback.print_exc()
        print(f"specli: error: {err}", file=sys.stderr)
        code = err.exit_code
    except KeyboardInterrupt:
        _exit_interrupted()
    except OSError as err:  # e.g. stdout on a full disk (-o /dev/full, > /dev/full)
        if verbose:
            traceback.print_exc()
        _quiet_stdout()
        where = f": {err.filename}" if err.filename else ""
        print(f"specli: error: {err.strerror or err}{where} (run with --verbose for details)", file=sys.stderr)
        code = EXIT_RUNTIME
    except Exception as err:
        if _is_click_error(err):
            print(f"specli: error: {_click_message(err)}", file=sys.stderr)
            code = err.exit_code
            sys.exit(code)
        if type(err).__name__ == "Abort":  # click's wrapper of Ctrl-C / EOF at a prompt
            print("specli: interrupted", file=sys.stderr)
            sys.exit(EXIT_INTERRUPTED)
        # A bug or an unexpected failure: still one line unless --verbose.
        if verbose:
            traceback.print_exc()
        print(f"specli: error: {type(err).__name__}: {err} (run with --verbose for details)", file=sys.stderr)
        code = EXIT_RUNTIME
    return code


def _quiet_stdout() -> None:
    """After a failed write to stdout, point it at /dev/null: the text still buffered would
    fail again when Python flushes it on exit, and print a traceback of its own."""
    try:
        sys.stdout.flush()
    except OSError:
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        except (OSError, ValueError):
            pass


def _is_click_error(err: Exception) -> bool:
    # Typer vendors its own copy of click, so match click's exceptions by shape, not class.
    return hasattr(err, "format_message") and isinstance(getattr(err, "exit_code", None), int)


def _click_message(err) -> str:
    ctx = getattr(err, "ctx", None)
    command = f"specli {ctx.info_name}" if ctx is not None and ctx.parent is not None else "specli"
    return f"{err.format_message()} (see '{command} --help')"


# Commands kept in their own modules register themselves on `app` when imported.
try:
    from specli.cli import models as cli_models  # noqa: E402,F401
    from specli.cli import bench as cli_bench  # noqa: E402,F401
    from specli.cli import batch as cli_batch  # noqa: E402,F401
except KeyboardInterrupt:
    _exit_interrupted()
