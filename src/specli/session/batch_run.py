"""`specli batch`'s run, without the command line: the input read and checked against the output
an earlier run left (`prepare`), then every item not yet done generated on the step loop, each
record written as it completes (`generate`). session/batch.py holds the parts that need no
model (lines, records, resume, summary); decoding/parallel.py feeds the items to the loop.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ContextManager, Iterator, Optional, Protocol

from specli.constraints import Grammar
from specli.decoding.generation import Step
from specli.decoding.loop import DecoderPool
from specli.decoding.parallel import Describe, ItemDone, ParallelRunner, run_sequential
from specli.decoding.sampling import sampling_json
from specli.errors import SpecliError, UsageError
from specli.files import write_atomically
from specli.llama.conversation import encode_conversation
from specli.llama.native import init_backend
from specli.modes import DraftMode
from specli.session import batch
from specli.session.chat import check_template_name, choose_formatter
from specli.session.loading import Loaded, ModelChoice, Plan, plan


@dataclass(frozen=True)
class BatchSettings:
    """What `specli batch` was asked to do (options as plain values)."""

    input_path: str  # a file, or "-" for stdin
    out_path: Optional[Path]  # None: stdout
    choice: ModelChoice
    max_tokens: int
    parallel: int = 1
    input_format: str = "auto"
    overwrite: bool = False
    force: bool = False  # resume although the output was made with other settings
    stop: tuple[str, ...] = ()
    chat: bool = False  # every prompt is a user turn for the chat template
    system: Optional[str] = None
    template: Optional[str] = None
    parse_special: bool = True  # raw prompts' control text becomes control tokens (off: --no-parse-special)
    grammar: Optional[Grammar] = None  # every item's constraint (an item's json_schema or grammar replaces it)


@dataclass
class PreparedBatch:
    """The input's entries, what an earlier run left in the output (None: nothing), the plan."""

    settings: BatchSettings
    entries: list[batch.Entry]
    previous: Optional[batch.Previous]
    plan: Plan

    def resume_notice(self) -> Optional[str]:
        """The line that says what resuming skips (None when nothing is resumed)."""
        if self.previous is None:
            return None
        keys = {batch.id_key(e.id) for e in self.entries}
        done = len(self.previous.done & keys)
        text = f"resuming {self.settings.out_path}: {done} of {len(self.entries)} items already done"
        if self.previous.n_errors:
            text += f"; {self.previous.n_errors} error record(s) from the earlier run are retried"
        if self.previous.n_partial:
            text += "; an incomplete last line was dropped"
        return text + " (--overwrite starts over)"


class Progress(Protocol):
    """What the front end shows while items run (a progress bar, or nothing)."""

    def step(self, step: Step) -> None: ...

    def item_done(self) -> None: ...


def prepare(settings: BatchSettings, stdin, *, verbose: bool = False) -> PreparedBatch:
    """Read and parse the input, read what the output holds, start llama.cpp (`verbose`: its
    log on stderr), plan the models; UsageError when the output's results were made with other
    settings (unless `force`). Nothing is loaded."""
    lines = batch.read_input(settings.input_path, stdin)
    fmt = batch.detect_format(settings.input_path, lines, settings.input_format)
    use_chat = settings.chat or settings.system is not None or settings.template is not None
    if settings.template is not None:
        check_template_name(settings.template)  # before the (slow) load
    entries = batch.parse_lines(
        lines, fmt, settings.choice.sampling, settings.max_tokens, chat=use_chat, system=settings.system, stop=settings.stop, grammar=settings.grammar,
    )
    for entry in entries:
        if isinstance(entry, batch.Item):
            entry.parse_special = settings.parse_special  # (chat items' messages are text whatever it says)
    out_path = settings.out_path
    previous = batch.read_previous(out_path) if out_path is not None and out_path.exists() and not settings.overwrite else None
    init_backend(verbose=verbose)
    the_plan = plan(settings.choice)
    if previous is not None and not settings.force:
        _refuse_other_settings(out_path, previous, entries, the_plan)
    return PreparedBatch(settings, entries, previous, the_plan)


def generate(
    job: PreparedBatch, loaded: Loaded, *, describe: Describe, progress: Callable[[int, bool], ContextManager[Progress]],
    notice: Callable[[str], None] = lambda text: None, stdout=None,
) -> batch.Summary:
    """Generate every item not yet done, writing each record as it completes (to the output
    file, else `stdout` in input order); at the end the file is rewritten in input order. A
    Ctrl-C ends the run with what is done (Summary.interrupted). describe: an error's words in
    a record; progress(n_items, with_drafting): what is shown while items run; notice: a line
    for the user (the chat template's choice)."""
    settings, entries, previous, the_plan = job.settings, job.entries, job.previous, job.plan
    prepare_item = _chat_renderer(loaded.model_tgt, settings.template, entries, notice)
    done_before = previous.done if previous is not None else set()
    summary = batch.Summary(items=len(entries))
    todo = []
    for entry in entries:
        if batch.is_done(entry, done_before):
            summary.skipped += 1
        else:
            todo.append(entry)

    out_path = settings.out_path
    if out_path is None:
        stream = stdout if stdout is not None else sys.stdout
        writer = batch.RecordWriter(stream, entries, in_order=True, skip=done_before)
    else:
        if previous is not None and previous.needs_rewrite:
            write_atomically(out_path, previous.kept)  # drop what is retried, then append
        stream = out_path.open("a" if previous is not None else "w", encoding="utf-8")
        writer = batch.RecordWriter(stream, entries, in_order=False, skip=done_before)

    runner = None
    items = _items_writing_errors(todo, writer, summary, describe, prepare_item)
    if settings.parallel > 1:
        runner = ParallelRunner(
            loaded.model_tgt, the_plan.mode, loaded.decoder.draft_length, settings.parallel, n_threads=settings.choice.threads,
            model_dft=loaded.model_dft, describe=describe, release_models=True, memory=loaded.memory,
        )
        events: Iterator = runner.run(items)
    else:
        pool = DecoderPool(loaded.model_tgt, loaded.decoder.drafter, loaded.decoder.draft_length)
        events = run_sequential(pool, items, describe=describe)

    n_items = sum(isinstance(entry, batch.Item) for entry in todo)
    t0 = time.perf_counter()
    try:
        with progress(n_items, the_plan.mode != DraftMode.TARGET_ONLY) as shown:
            for event in events:
                if isinstance(event, ItemDone):
                    if event.error is not None:
                        writer.write(batch.LineError(event.item.line, event.item.id, event.error).record())
                        summary.failed += 1
                    else:
                        gen = event.generation
                        writer.write(batch.result_record(event.item, batch.generation_json(gen, _plan_for(the_plan, event.item))))
                        summary.done += 1
                        summary.stats.add(gen.stats)
                    shown.item_done()
                else:
                    shown.step(event)
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
        problem = loaded.save_memory()  # (--memory persist: the finished items' texts, Ctrl-C too)
        if problem:
            notice(problem)
    return summary


def _refuse_other_settings(path: Path, previous: batch.Previous, entries: list[batch.Entry], the_plan: Plan) -> None:
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


def _chat_renderer(model_tgt, template, entries, notice: Callable[[str], None]):
    """What readies a chat item (its conversation rendered with the chat template `chat` and
    `run --chat` pick, and tokenized), or None when no item is one. A model template that
    cannot be used at all is a UsageError here, before any item runs."""
    if not any(isinstance(e, batch.Item) and e.messages is not None for e in entries):
        return None
    formatter, text = choose_formatter(model_tgt, template)
    if text:
        notice(text)

    def prepare_item(item: batch.Item) -> None:
        if item.messages is not None:
            item.prompt_ids = encode_conversation(model_tgt, formatter, None, item.messages)
            item.stop = (*formatter.stop, *item.stop)  # plain turns end at the next "User:" line, as in chat

    return prepare_item


def _items_writing_errors(entries, writer, summary, describe: Describe, prepare_item=None):
    """The items to generate, in order; bad lines, and chat items whose conversation the
    template refuses, are written as error records on the way."""
    for entry in entries:
        if prepare_item is not None and isinstance(entry, batch.Item):
            try:
                prepare_item(entry)
            except SpecliError as err:
                entry = batch.LineError(entry.line, entry.id, describe(err))
        if isinstance(entry, batch.LineError):
            writer.write(entry.record())
            summary.failed += 1
        else:
            yield entry


def _plan_for(the_plan: Plan, item: batch.Item) -> Plan:
    """The plan as this item ran it (its sampling may override the command line's)."""
    return the_plan if item.sampling == the_plan.sampling else dataclasses.replace(the_plan, sampling=item.sampling)
