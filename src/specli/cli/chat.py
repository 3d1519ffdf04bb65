"""`specli chat`: a conversation on models loaded once (the session itself is session/chat.py)."""

from __future__ import annotations

import functools
import sys
from typing import Optional

import typer

from specli.cli.options import (
    ChatMemory, Constrain, Drafting, Models, Placement, Quiet, Sampling, ShowAccept, Stop, Threads, Verbose, flatten, load_models,
    max_tokens_option, model_choice, require_stdout, stop_strings
)
from specli.constraints import Constraint
from specli.session.loading import plan

commands = typer.Typer()


@commands.command("chat")
@flatten
def chat(
    *,
    models: Models,
    drafting: Drafting,
    max_tokens: int = max_tokens_option("Generated tokens at most per reply."),
    stop: Stop = None,
    constrain: Constrain,
    memory: ChatMemory = "off",
    placement: Placement,
    threads: Threads = None,
    system: Optional[str] = typer.Option(None, "--system", help="System prompt for the conversation."),
    template: Optional[str] = typer.Option(None, "--template", help="A llama.cpp built-in chat template (chatml, gemma, llama3, ...) instead of the model's own."),
    quiet: Quiet = False,
    verbose: Verbose = False,
    show_accept: ShowAccept = False,
    sampling: Sampling,
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed for sampling (default: a fresh one per reply)."),
) -> int:
    """Chat with a model: replies streamed to stdout, per-turn stats on stderr; /help lists the commands."""
    from specli.cli.render import stream_generation, summary_line, terminal_width
    from specli.llama.native import init_backend
    from specli.session.chat import ChatOptions, ChatSession, LineReader, check_template_name, choose_formatter

    require_stdout()  # (the replies)
    choice = model_choice(models, placement, sampling, threads=threads, seed=seed, drafting=drafting, memory=memory)
    stops = stop_strings(stop)
    grammar = constrain.grammar_asked()  # (every reply's; checked before the load)
    reader = LineReader(sys.stdin, sys.stdout, sys.stderr)  # a bad SPECLI_MAX_INPUT_BYTES: before the load
    init_backend(verbose=verbose)
    if template is not None:
        check_template_name(template)  # before the (slow) load
    the_plan = plan(choice)
    loaded = load_models(the_plan, choice, quiet=quiet, verbose=verbose)
    try:
        formatter, notice = choose_formatter(loaded.model_tgt, template)
        if notice and not quiet:
            print(notice, file=sys.stderr)
        constraint = None if grammar is None else Constraint(grammar, loaded.model_tgt)
        options = ChatOptions(max_tokens=max_tokens, system=system, quiet=quiet, verbose=verbose, show_accept=show_accept, stop=stops,
                              constraint=constraint)
        # The terminal's width is read per reply: it may be resized during a chat.
        summary = lambda stats, **kw: summary_line(stats, verbose=verbose, width=terminal_width(sys.stderr), **kw)  # noqa: E731
        stream = functools.partial(stream_generation, trace=sys.stderr) if verbose else stream_generation  # (--verbose: tree passes)
        session = ChatSession(loaded, formatter, options, stream_generation=stream, summary_line=summary)
        return session.loop(reader)
    finally:
        loaded.close()
