"""`specli batch`: many prompts, one model load, nothing lost.

Options and what is shown; the run is session/batch_run.py's (the pure parts: session/batch.py,
the feeding of items to the step loop: decoding/parallel.py); a record is `run --json`'s object.

Exit codes: 0 every line done, 1 some line failed (its error record is in the output), 2 bad
usage (nothing generated), 130 interrupted (every finished item is in the output; run again).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Literal, Optional

import typer

from specli.cli.options import (
    Constrain, Drafting, DraftMemory, Models, Placement, Quiet, Sampling, Stop, Threads, Verbose, check_parallel, error_message, flatten,
    load_models, max_tokens_option, model_choice, require_stdout, stop_strings
)
from specli.cli.run import ChatFlag, NoParseSpecial, System, Template
from specli.errors import EXIT_INTERRUPTED, EXIT_RUNTIME, SpecliError, UsageError
from specli.files import ExclusiveLock, LockBusy, check_writable, replace_text
from specli.modes import DraftMode
from specli.session import batch, batch_run

EXIT_SOME_FAILED = EXIT_RUNTIME
commands = typer.Typer()


@commands.command("batch")
@flatten
def batch_command(
    input_path: str = typer.Argument(..., metavar="INPUT", help="JSONL (one {\"prompt\": ...} per line) or text (one prompt per line); '-' reads stdin."),
    *,
    output: str = typer.Option("-", "-o", "--output", help="Output JSONL, one record per input line; '-' = stdout."),
    resume: bool = typer.Option(False, "--resume", help="Skip ids already done in the output file (the default when it exists)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Start over: replace an existing output file."),
    force: bool = typer.Option(False, "--force", help="Resume even when the output's results were made with other settings (model, drafting, sampling)."),
    summary_path: Optional[Path] = typer.Option(None, "--summary", help="Also write the final summary as JSON to this file."),
    parallel: int = typer.Option(1, "--parallel", "-P", help="Sequences sharing each target pass (each with its own drafts and caches)."),
    input_format: Literal[batch.FORMATS] = typer.Option("auto", "--format", help="Input format: auto (by extension, else by the first line), jsonl or text."),
    models: Models,
    drafting: Drafting,
    max_tokens: int = max_tokens_option("Generated tokens at most per item (an item's max_tokens overrides it)."),
    stop: Stop = None,
    constrain: Constrain,
    placement: Placement,
    memory: DraftMemory = "off",
    threads: Threads = None,
    quiet: Quiet = False,
    verbose: Verbose = False,
    sampling: Sampling,
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed for every item (default: a fresh one per item, reported in its record)."),
    chat: ChatFlag = False,
    system: System = None,
    template: Template = None,
    no_parse_special: NoParseSpecial = False,
) -> int:
    """Generate for every prompt of INPUT with the models loaded once; one JSON record per line
    (in input order), a summary on stderr. Re-running with the same output resumes."""
    if output == "-":
        require_stdout("write the records to a file with -o FILE, or run it with stdout open")
    if no_parse_special and (chat or system is not None or template is not None):
        raise UsageError("--no-parse-special is for raw prompts; with --chat every prompt is a message, always tokenized as text: drop one of them")
    choice = model_choice(models, placement, sampling, threads=threads, seed=seed, drafting=drafting, memory=memory)
    stops = stop_strings(stop)
    grammar = constrain.grammar_asked()  # (every item's, unless it has its own; checked before the load)
    check_parallel(parallel, placement.n_ctx, choice.branches)
    out_path = _check_output(output, input_path, resume=resume, overwrite=overwrite)
    if summary_path is not None:
        check_writable(summary_path, "the --summary file")
    lock = _lock_output(out_path) if out_path is not None else None
    try:
        settings = batch_run.BatchSettings(
            input_path, out_path, choice, max_tokens, parallel=parallel, input_format=input_format, overwrite=overwrite,
            force=force, stop=stops, chat=chat, system=system, template=template, parse_special=not no_parse_special, grammar=grammar,
        )
        return _batch(settings, output=output, summary_path=summary_path, quiet=quiet, verbose=verbose)
    finally:
        if lock is not None:
            lock.release()


def _batch(settings: batch_run.BatchSettings, *, output: str, summary_path: Optional[Path], quiet: bool, verbose: bool) -> int:
    """The run itself, with the output (if a file) locked; the summary on stderr (and in
    --summary's file)."""
    job = batch_run.prepare(settings, sys.stdin.buffer, verbose=verbose)
    notice = job.resume_notice()
    if notice and not quiet:
        print(notice, file=sys.stderr)
    loaded = load_models(job.plan, settings.choice, quiet=quiet, verbose=verbose)
    show = not (quiet or verbose) and sys.stderr.isatty()
    try:
        summary = batch_run.generate(
            job, loaded, describe=error_message, progress=lambda n_items, with_drafting: _Progress(n_items, enabled=show, with_drafting=with_drafting),
            notice=(lambda text: None) if quiet else (lambda text: print(text, file=sys.stderr)),
        )
    finally:
        loaded.close()

    if not quiet:
        print(summary.line(with_drafting=job.plan.mode != DraftMode.TARGET_ONLY), file=sys.stderr)
    if summary_path is not None:
        run_settings = {"target": str(job.plan.target_path), "draft": job.plan.draft_label, "n_draft": job.plan.draft_length.json_value,
                        "parallel": settings.parallel, "input": settings.input_path, "output": output}
        try:
            replace_text(summary_path, _json({**summary.to_dict(), **run_settings}))
        except OSError as err:  # (a FIFO whose reader left since the check): say that the records are safe
            where = "on stdout" if output == "-" else f"in {output}"
            raise SpecliError(f"cannot write the --summary file {summary_path}: {err.strerror or err}; "
                              f"the records themselves are written {where}") from None
    if summary.interrupted:
        return EXIT_INTERRUPTED
    return EXIT_SOME_FAILED if summary.failed else 0


def _json(obj) -> str:
    import json

    return json.dumps(obj, ensure_ascii=False)


def _check_output(output: str, input_path: str, *, resume: bool, overwrite: bool) -> Path | None:
    """The output file (None for stdout), checked before anything loads."""
    if resume and overwrite:
        raise UsageError("--resume and --overwrite contradict each other; pick one")
    if output == "-":
        if resume:
            raise UsageError("--resume needs an output file (-o FILE); stdout cannot be read back")
        return None
    path = Path(output)
    if path.is_dir():
        raise UsageError(f"-o {output} is a directory; give a file name for the JSONL output")
    if path.exists() and not path.is_file():
        raise UsageError(f"-o {output} is not a regular file (a FIFO, a device, a socket?); give a file name for the JSONL output, or '-' for stdout")
    if not path.parent.is_dir():
        raise UsageError(f"cannot write {output}: folder {path.parent} does not exist")
    if input_path != "-" and Path(input_path).exists() and path.exists() and path.resolve() == Path(input_path).resolve():
        raise UsageError("the output file is the input file; write the results to another file (-o)")
    # The records are appended to the file, and the lock and the in-order rewrite create files
    # beside it: both must be possible before the models load, not found out after.
    check_writable(path, "-o", folder_too=True)
    return path


def _lock_output(path: Path) -> ExclusiveLock:
    """Hold the output for this run: a second `batch` on it is refused at once (its records would
    interleave with ours). The lock file sits next to the output (the real file, if `path` is a
    link) and goes when the run ends; after a SIGKILL the OS drops the lock and the next run
    takes the file over."""
    real = Path(os.path.realpath(path))
    lock = ExclusiveLock(real.parent / f".{real.name}.lock")
    try:
        lock.acquire()
    except LockBusy as busy:
        holder = f" (PID {busy.pid})" if busy.pid else ""
        raise UsageError(
            f"another specli batch{holder} is writing {path} (it holds {busy.lock_path}); "
            "wait for it to finish, or pick another -o"
        ) from None
    except OSError as err:
        raise UsageError(f"cannot create the lock file {lock.path}: {err.strerror} (batch writes next to its output; check the folder's permissions)") from None
    if not lock.supported:
        print(f"specli: warning: the file system of {path} has no file locks; nothing stops a second batch from writing it", file=sys.stderr)
    return lock


class _Progress:
    """A Rich progress bar on stderr (items, tokens/s, acceptance, ETA); nothing when disabled."""

    def __init__(self, total: int, *, enabled: bool, with_drafting: bool):
        self.enabled = enabled
        self.with_drafting = with_drafting
        self.tokens = self.drafted = self.accepted = 0
        self.t0 = time.perf_counter()
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            from specli.cli.render import stderr_console

            columns = (TextColumn("batch"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[rates]}"), TimeRemainingColumn())
            self._progress = Progress(*columns, console=stderr_console(), transient=True)
            self._task = self._progress.add_task("batch", total=total, rates="")

    def __enter__(self):
        if self.enabled:
            self._progress.__enter__()
        return self

    def __exit__(self, *exc):
        if self.enabled:
            self._progress.__exit__(*exc)

    def step(self, step) -> None:
        self.tokens += len(step.tokens)
        self.drafted += step.n_drafted
        self.accepted += step.n_accepted
        if self.enabled:
            elapsed = time.perf_counter() - self.t0
            rates = f"{self.tokens / elapsed:.1f} tok/s" if elapsed > 0 else ""
            if self.with_drafting and self.drafted:
                rates += f"  accepted {self.accepted / self.drafted:.0%}"
            self._progress.update(self._task, rates=rates)

    def item_done(self) -> None:
        if self.enabled:
            self._progress.advance(self._task)
