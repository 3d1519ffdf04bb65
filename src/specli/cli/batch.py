"""`specli batch`: many prompts, one model load, nothing lost.

The pure parts (input lines, records, resume, summary) live in session/batch.py, the generation
loops in decoding/parallel.py; a record is `run --json`'s object (cli/run.py).

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

from specli.errors import EXIT_INTERRUPTED
from specli.cli.options import (
    Drafting, Memory, Models, Quiet, Sampling, Stop, Threads, Verbose, error_message, flatten, load_models, max_tokens_option,
    check_parallel, model_choice, stop_strings,
)  # fmt: skip
from specli.cli.run import ChatFlag, System, Template, result_json
from specli.decoding.sampling import sampling_json
from specli.errors import EXIT_RUNTIME, SpecliError, UsageError
from specli.files import ExclusiveLock, LockBusy, check_writable, replace_text, write_atomically
from specli.session import batch
from specli.modes import DraftMode

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
    memory: Memory,
    threads: Threads = None,
    quiet: Quiet = False,
    verbose: Verbose = False,
    sampling: Sampling,
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed for every item (default: a fresh one per item, reported in its record)."),
    chat: ChatFlag = False,
    system: System = None,
    template: Template = None,
) -> int:
    """Generate for every prompt of INPUT with the models loaded once; one JSON record per line
    (in input order), a summary on stderr. Re-running with the same output resumes."""
    choice = model_choice(models, memory, sampling, threads=threads, seed=seed, drafting=drafting)
    stops = stop_strings(stop)
    check_parallel(parallel, memory.n_ctx)
    out_path = _check_output(output, input_path, resume=resume, overwrite=overwrite)
    if summary_path is not None:
        check_writable(summary_path, "the --summary file")
    lock = _lock_output(out_path) if out_path is not None else None
    try:
        return _batch(
            input_path, output, out_path, overwrite, summary_path, parallel, input_format, choice, max_tokens,
            quiet=quiet, verbose=verbose, force=force, stop=stops, chat=(chat or system is not None or template is not None, system, template),
        )  # fmt: skip
    finally:
        if lock is not None:
            lock.release()


def _batch(input_path, output, out_path, overwrite, summary_path, parallel, input_format, choice, max_tokens, *, quiet, verbose, force=False, stop=(),
           chat=(False, None, None)) -> int:
    """The run itself, with the output (if a file) locked."""
    from specli.llama.native import init_backend
    from specli.session.loading import plan

    lines = batch.read_input(input_path, sys.stdin.buffer)
    fmt = batch.detect_format(input_path, lines, input_format)
    use_chat, system, template = chat
    if template is not None:
        from specli.session.chat import check_template_name

        check_template_name(template)  # before the (slow) load
    entries = batch.parse_lines(lines, fmt, choice.sampling, max_tokens, chat=use_chat, system=system, stop=stop)
    previous = batch.read_previous(out_path) if out_path is not None and out_path.exists() and not overwrite else None

    init_backend(verbose=verbose)
    the_plan = plan(choice)
    if previous is not None and not force:
        _refuse_other_settings(out_path, previous, entries, the_plan)
    if previous is not None and not quiet:
        print(_resume_notice(out_path, previous, entries), file=sys.stderr)
    loaded = load_models(the_plan, choice, quiet=quiet, verbose=verbose)
    try:
        prepare = _chat_renderer(loaded.model_tgt, template, entries, quiet=quiet)
        summary = _run(loaded, the_plan, choice, entries, previous, out_path, parallel, quiet=quiet or verbose, prepare=prepare)
    finally:
        loaded.close()

    with_drafting = the_plan.mode != DraftMode.TARGET_ONLY
    if not quiet:
        print(summary.line(with_drafting=with_drafting), file=sys.stderr)
    if summary_path is not None:
        settings = {"target": str(the_plan.target_path), "draft": the_plan.draft_label, "n_draft": the_plan.draft_length.json_value,
                    "parallel": parallel, "input": input_path, "output": output}  # fmt: skip
        replace_text(summary_path, _json({**summary.to_dict(), **settings}))
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


def _refuse_other_settings(path: Path, previous: batch.Previous, entries: list[batch.Entry], the_plan) -> None:
    """UsageError when the results already in the output were made with other settings than
    this run's (target, drafter, draft length, sampling): resuming would mix them silently."""
    run_settings = {"target": str(the_plan.target_path), "draft": the_plan.draft_label, "n_draft": the_plan.draft_length.json_value}
    differences = batch.settings_differences(previous, entries, run_settings, lambda item: sampling_json(item.sampling))
    if differences:
        shown = "; ".join(differences[:6]) + (f"; and {len(differences) - 6} more" if len(differences) > 6 else "")
        raise UsageError(
            f"{path} holds results made with other settings: {shown}; resuming would mix them in one file: "
            "pass --force to resume anyway, --overwrite to start over, or pick another -o"
        )


def _resume_notice(path: Path, previous: batch.Previous, entries: list[batch.Entry]) -> str:
    keys = {batch.id_key(e.id) for e in entries}
    done = len(previous.done & keys)
    text = f"resuming {path}: {done} of {len(entries)} items already done"
    if previous.n_errors:
        text += f"; {previous.n_errors} error record(s) from the earlier run are retried"
    if previous.n_partial:
        text += "; an incomplete last line was dropped"
    return text + " (--overwrite starts over)"


def _run(loaded, the_plan, choice, entries, previous, out_path, parallel, *, quiet: bool, prepare=None) -> batch.Summary:
    """Generate every item not yet done, writing each record as it completes."""
    from specli.decoding.engine import DecoderPool
    from specli.decoding.parallel import ItemDone, ParallelRunner, run_sequential

    done_before = previous.done if previous is not None else set()
    summary = batch.Summary(items=len(entries))
    todo = []
    for entry in entries:
        if batch.is_done(entry, done_before):
            summary.skipped += 1
        else:
            todo.append(entry)

    if out_path is None:
        stream = sys.stdout
        writer = batch.RecordWriter(stream, entries, in_order=True, skip=done_before)
    else:
        if previous is not None and previous.needs_rewrite:
            write_atomically(out_path, previous.kept)  # drop what is retried, then append
        stream = out_path.open("a" if previous is not None else "w", encoding="utf-8")
        writer = batch.RecordWriter(stream, entries, in_order=False, skip=done_before)

    runner = None
    if parallel > 1:
        runner = ParallelRunner(
            loaded.model_tgt, the_plan.mode, loaded.decoder.draft_length, parallel, n_threads=choice.threads,
            model_dft=loaded.model_dft, describe=error_message, release_models=True,
        )  # fmt: skip
        events = runner.run(_items_writing_errors(todo, writer, summary, prepare))
    else:
        pool = DecoderPool(loaded.model_tgt, loaded.decoder.drafter, loaded.decoder.draft_length)
        events = run_sequential(pool, _items_writing_errors(todo, writer, summary, prepare), describe=error_message)

    n_items = sum(isinstance(entry, batch.Item) for entry in todo)
    progress = _Progress(n_items, enabled=not quiet and sys.stderr.isatty(), with_drafting=the_plan.mode != DraftMode.TARGET_ONLY)
    t0 = time.perf_counter()
    try:
        with progress:
            for event in events:
                if isinstance(event, ItemDone):
                    if event.error is not None:
                        writer.write(batch.LineError(event.item.line, event.item.id, event.error).record())
                        summary.failed += 1
                    else:
                        gen = event.generation
                        item_plan = _plan_for(the_plan, event.item)
                        writer.write(batch.result_record(event.item, result_json(gen, item_plan)))
                        summary.done += 1
                        summary.stats.add(gen.stats)
                    progress.item_done()
                else:
                    progress.step(event)
    except KeyboardInterrupt:
        summary.interrupted = True  # the item(s) in progress are not written: a re-run does them
    finally:
        summary.wall_s = time.perf_counter() - t0
        writer.release_held()
        if runner is not None:
            runner.close()
        if out_path is not None:
            stream.close()
            batch.sort_output(out_path, entries)
    return summary


def _chat_renderer(model_tgt, template, entries, *, quiet: bool):
    """What readies a chat item (its conversation rendered with the chat template `chat` and
    `run --chat` pick, and tokenized), or None when no item is one. A model template that
    cannot be used at all is a UsageError here, before any item runs."""
    if not any(isinstance(e, batch.Item) and e.messages is not None for e in entries):
        return None
    from specli.session.chat import choose_formatter, encode_conversation

    formatter, notice = choose_formatter(model_tgt, template)
    if notice and not quiet:
        print(notice, file=sys.stderr)

    def prepare(item: batch.Item) -> None:
        if item.messages is not None:
            item.prompt_ids = encode_conversation(model_tgt, formatter, None, item.messages)
            item.stop = (*formatter.stop, *item.stop)  # plain turns end at the next "User:" line, as in chat

    return prepare


def _items_writing_errors(entries, writer, summary, prepare=None):
    """The items to generate, in order; bad lines, and chat items whose conversation the
    template refuses, are written as error records on the way."""
    for entry in entries:
        if prepare is not None and isinstance(entry, batch.Item):
            try:
                prepare(entry)
            except SpecliError as err:
                entry = batch.LineError(entry.line, entry.id, error_message(err))
        if isinstance(entry, batch.LineError):
            writer.write(entry.record())
            summary.failed += 1
        else:
            yield entry


def _plan_for(the_plan, item):
    """The plan as this item ran it (its sampling may override the command line's)."""
    import dataclasses

    return the_plan if item.sampling == the_plan.sampling else dataclasses.replace(the_plan, sampling=item.sampling)


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
