"""The `specli` command line: the Typer app, --version, and main(), which turns every failure
into one line on stderr and an exit code.

Exit codes: 0 success, 1 runtime failure, 2 bad usage or input, 130 interrupted (Ctrl-C, or SIGTERM
once llama.cpp is loaded).
Each command group has its own module (run, chat, batch, bench, models: models, pull, fit,
cache) with its own Typer object, added to `app` here; none of them imports this module.
"""

from __future__ import annotations

import logging
import os
import sys

from specli.errors import EXIT_INTERRUPTED


def _exit_interrupted() -> None:
    """Ctrl-C: one line, exit 130; a second Ctrl-C while leaving cannot print a traceback."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        print("specli: interrupted", file=sys.stderr)
    except OSError:
        pass
    raise SystemExit(EXIT_INTERRUPTED)


def _plug_closed_descriptors() -> None:
    """Open /dev/null on whichever of fds 0-2 was closed when specli started (`>&-`): else the
    next file opened (a model, an output, a lock) would get that number, and anything written to
    "stdout" (llama.cpp's own prints) would land in it. sys.stdout stays None, so the commands
    that write results there still refuse to run (options.require_stdout)."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            try:
                devnull = os.open(os.devnull, os.O_RDWR)
                if devnull != fd:  # (the lowest free number: fd itself, when the ones below are open)
                    os.dup2(devnull, fd)
                    os.close(devnull)
            except OSError:
                pass


_plug_closed_descriptors()  # first: the imports below open files of their own

# Importing what follows takes a while (llama.cpp's library among it): a Ctrl-C meanwhile is
# still one line and exit 130, whether specli runs as `specli` or `python -m specli`.
try:
    import traceback

    import typer

    from specli import __version__
    from specli.cli import batch, bench, chat, models, run, serve
    from specli.cli.options import error_message
    from specli.errors import EXIT_RUNTIME, SpecliError
except KeyboardInterrupt:
    _exit_interrupted()

app = typer.Typer(
    add_completion=True,  # --install-completion / --show-completion (bash, zsh, fish, PowerShell)
    # -h as well as --help, as llama.cpp's tools take it; subcommands inherit it from this context.
    context_settings={"help_option_names": ["-h", "--help"]},
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    help="Speculative decoding for local GGUF models: the target model's output (greedy, or its sampling distribution), sooner.",
)

# The commands, in the order `specli --help` lists them.
for _commands in (run.commands, chat.commands, serve.commands, models.commands, bench.commands, batch.commands):
    app.add_typer(_commands)


def _version(value: bool) -> None:
    if value:
        print(f"specli {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Show the version and exit."),
) -> None:
    """Speculative decoding for local GGUF models."""


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


def _verbose_hint(args: list[str]) -> str:
    """" (run with --verbose for details)" when the command run has --verbose, else nothing:
    `specli models` has none, and a hint to an option that is refused helps nobody."""
    try:
        group = typer.main.get_command(app)
        name = next((arg for arg in args if not arg.startswith("-")), None)
        command = group.commands.get(name) if name else None
        has_verbose = command is not None and any("--verbose" in getattr(p, "opts", ()) for p in command.params)
    except Exception:  # (only the wording of an error depends on it)
        has_verbose = False
    return " (run with --verbose for details)" if has_verbose else ""


def _main(argv: list[str] | None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        args = ["--help"]  # `specli` alone: the help, not an error
    verbose = "--verbose" in args or "-v" in args
    if not verbose:  # the hub client's retry lines; specli says what failed in one line
        logging.getLogger("huggingface_hub").setLevel(logging.ERROR)
    try:
        code = app(args=args, standalone_mode=False, prog_name="specli")
        code = code if isinstance(code, int) else 0
    except SpecliError as err:
        if verbose:
            traceback.print_exc()
        print(f"specli: error: {error_message(err)}", file=sys.stderr)
        code = err.exit_code
    except KeyboardInterrupt:
        _exit_interrupted()
    except OSError as err:  # e.g. stdout on a full disk (-o /dev/full, > /dev/full)
        if verbose:
            traceback.print_exc()
        _quiet_stdout()
        where = f": {err.filename}" if err.filename else ""
        print(f"specli: error: {err.strerror or err}{where}{_verbose_hint(args)}", file=sys.stderr)
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
        print(f"specli: error: {type(err).__name__}: {err}{_verbose_hint(args)}", file=sys.stderr)
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
    # Typer words a refused choice "Value error, 'x' is not one of ...": the prefix says nothing.
    message = err.format_message().replace(": Value error, ", ": ")
    # -n was the draft length until it became llama.cpp's tokens to generate: `-n auto` (or
    # bench's `-n 2,4`) from an older script is told where the draft length went.
    param = getattr(err, "param", None)
    if param is not None and "--n-predict" in getattr(param, "opts", ()) and "integer" in message:
        message += "; -n is now the number of tokens to generate, as in llama.cpp: the draft length is --draft-max"
    return f"{message} (see '{command} --help')"
