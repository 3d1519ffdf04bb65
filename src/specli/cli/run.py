"""`specli run`: one prompt, its continuation streamed to stdout, live stats on stderr.

Also what `batch` shares with it: a record is `run --json`'s object (session.batch.generation_json).
"""

from __future__ import annotations

import json
import sys
from typing import Annotated, Optional

import typer

from specli.cli.options import (
    Constrain, Drafting, Models, Placement, Quiet, RunMemory, Sampling, ShowAccept, Stop, Threads, Verbose, flatten, load_models,
    max_tokens_option, model_choice, require_stdout, stop_strings
)
from specli.constraints import Constraint
from specli.decoding.generation import Request
from specli.decoding.loop import generate
from specli.errors import EXIT_INTERRUPTED, UsageError
from specli.files import read_limited, strip_bom
from specli.modes import DraftMode
from specli.session import batch
from specli.session.loading import plan

commands = typer.Typer()

# --chat and its companions (run and batch): instruct models expect their chat template.
ChatFlag = Annotated[bool, typer.Option("--chat", help="Send the prompt as a user message in the model's chat template, ending with the assistant's turn (for instruct models).")]
System = Annotated[Optional[str], typer.Option("--system", help="System prompt (implies --chat).")]
Template = Annotated[Optional[str], typer.Option("--template", help="A llama.cpp built-in chat template (chatml, gemma, llama3, ...) instead of the model's own (implies --chat).")]
# A raw prompt's control text (`<|im_start|>`) becomes control tokens, as in llama.cpp's CLI and
# server; llama-tokenize's --no-parse-special keeps it text. (Chat messages are always text.)
NoParseSpecial = Annotated[bool, typer.Option("--no-parse-special", help=("Tokenize the prompt's special-token text (<|im_start|>, <start_of_turn>, ...) as plain text, not as the "
    "control tokens llama.cpp makes of it."))]


@commands.command("run")
@flatten
def run(
    prompt: Optional[str] = typer.Argument(None, help="Text to continue. '-' (or nothing, with piped input) reads stdin."),
    *,
    prompt_option: Optional[str] = typer.Option(None, "-p", "--prompt", help="The prompt as an option (llama.cpp's -p), instead of the PROMPT argument."),
    models: Models,
    drafting: Drafting,
    max_tokens: int = max_tokens_option("Stop after this many generated tokens."),
    stop: Stop = None,
    constrain: Constrain,
    memory: RunMemory = "off",
    placement: Placement,
    threads: Threads = None,
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object (text, token ids, stats) instead of streaming text."),
    quiet: Quiet = False,
    verbose: Verbose = False,
    show_accept: ShowAccept = False,
    sampling: Sampling,
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed for sampling (default: a fresh one, reported in --json)."),
    chat: ChatFlag = False,
    system: System = None,
    template: Template = None,
    no_parse_special: NoParseSpecial = False,
) -> int:
    """Generate a continuation of PROMPT, streamed to stdout, with live stats on stderr."""
    from specli.cli.render import low_acceptance_warning, stream_generation, summary_line, terminal_width
    from specli.llama.native import init_backend

    require_stdout()
    if prompt_option is not None and prompt is not None:
        raise UsageError("the prompt is given twice (PROMPT and -p/--prompt); give one of them")
    choice = model_choice(models, placement, sampling, threads=threads, seed=seed, drafting=drafting, memory=memory)
    stops = stop_strings(stop)
    grammar = constrain.grammar_asked()  # (a grammar that does not compile: exit 2 before the load)
    text = read_prompt(prompt_option if prompt_option is not None else prompt)
    init_backend(verbose=verbose)
    chat = chat or system is not None or template is not None
    if chat and no_parse_special:
        raise UsageError("--no-parse-special is for raw prompts; with --chat the prompt is a message, always tokenized as text: drop one of them")
    if template is not None:
        from specli.session.chat import check_template_name

        check_template_name(template)  # before the (slow) load
    the_plan = plan(choice)
    loaded = load_models(the_plan, choice, quiet=quiet, verbose=verbose)
    try:
        model_tgt = loaded.model_tgt
        if chat:
            prompt_ids, format_stop = chat_prompt_ids(model_tgt, template, system, text, quiet=quiet)
            stops = (*format_stop, *stops)
        else:
            prompt_ids = model_tgt.tokenize_prompt(text, parse_special=not no_parse_special)
        constraint = None if grammar is None else Constraint(grammar, model_tgt)
        gen = generate(loaded.decoder, Request(prompt_ids, max_tokens=max_tokens, stop=stops, constraint=constraint))
        with_drafting = the_plan.mode != DraftMode.TARGET_ONLY
        interrupted = stream_generation(
            gen, sys.stdout, sys.stderr, show_text=not json_out, live=not quiet and not verbose,
            show_accept=show_accept, with_drafting=with_drafting, trace=sys.stderr if verbose else None,
        )
        if not interrupted:  # (a generation stopped by Ctrl-C is not remembered)
            notice = loaded.remember(gen)
            if notice and not quiet:
                print(notice, file=sys.stderr)
        if json_out:
            print(json.dumps(batch.generation_json(gen, the_plan), ensure_ascii=False))
            sys.stdout.flush()
        if not quiet:
            print(summary_line(gen.stats, stop_reason=gen.stop_reason, with_drafting=with_drafting, verbose=verbose,
                               width=terminal_width(sys.stderr)), file=sys.stderr)
            warning = (
                low_acceptance_warning(gen.stats, lookup=the_plan.mode == DraftMode.LOOKUP, adaptive=loaded.decoder.adaptive)
                if with_drafting else None
            )
            if warning:
                print(warning, file=sys.stderr)
            if seed is not None and not the_plan.sampling.greedy and loaded.decoder.adaptive:
                # Only here does a seed not replay the text: auto's draft lengths follow timings,
                # and the random draws follow the draft lengths. One short line, not a lecture.
                print("note: to replay this exact text, add a fixed --draft-max (auto follows timings)", file=sys.stderr)
        return EXIT_INTERRUPTED if interrupted else 0
    finally:
        loaded.close()


def chat_prompt_ids(model, template: Optional[str], system: Optional[str], text: str, *,
                    quiet: bool) -> tuple[list[int], tuple[str, ...]]:
    """The tokens of `text` as one user message (after `system`) in the chat template that
    `specli chat` would pick, with the assistant's turn opened; and the format's own stop
    strings (plain turns end where the model starts the next "User:" line, as in chat)."""
    from specli.llama.conversation import encode_conversation
    from specli.session.chat import choose_formatter

    formatter, notice = choose_formatter(model, template)
    if notice and not quiet:
        print(notice, file=sys.stderr)
    return encode_conversation(model, formatter, system, [{"role": "user", "content": text}]), tuple(formatter.stop)


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
