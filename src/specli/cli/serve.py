"""`specli serve`: an OpenAI-compatible HTTP server with speculative decoding (server/).

The HTTP stack is the `server` extra; without it the command says how to install it, and
the rest of specli never imports it.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from specli.cli.options import Drafting, DraftMemory, Models, Placement, Quiet, Sampling, Threads, Verbose, check_parallel, error_message, flatten, load_models, model_choice
from specli.errors import UsageError
from specli.modes import DraftMode
from specli.session.loading import MEMORY_SAVE_EVERY_S

commands = typer.Typer()

DEFAULT_QUEUE = 64


@commands.command("serve")
@flatten
def serve_command(
    *,
    models: Models,
    drafting: Drafting,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface; then set --api-key); several, comma-separated."),
    port: int = typer.Option(8080, "--port", min=0, max=65535, help="Port to listen on (0: any free one, printed when ready)."),
    parallel: int = typer.Option(1, "--parallel", "-np", "-P", help="Requests decoded together, their drafts verified in one target pass each step."),
    queue: int = typer.Option(DEFAULT_QUEUE, "--queue", min=0, help="Requests that may wait for a free slot; beyond them, 503."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="SPECLI_API_KEY", help="Require 'Authorization: Bearer KEY' on every endpoint but /health (or set SPECLI_API_KEY)."),
    max_tokens: Optional[int] = typer.Option(None, "-n", "--n-predict", "--max-tokens", min=1, help="Generated tokens per request when it sets no max_tokens (default: until the context is full)."),
    placement: Placement,
    memory: DraftMemory = "off",
    threads: Threads = None,
    quiet: Quiet = False,
    verbose: Verbose = False,
    sampling: Sampling,
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed for requests that set none (default: a fresh one per request, reported in its stats)."),
    template: Optional[str] = typer.Option(None, "--template", help="A llama.cpp built-in chat template (chatml, gemma, llama3, ...) for chat requests, instead of the model's own."),
    cache_reuse: int = typer.Option(0, "--cache-reuse", min=0, help=("Also reuse runs of at least N cached tokens that a new prompt holds after the common prefix, moved to their "
        "new positions (llama-server's --cache-reuse; 0: off).")),
    metrics: bool = typer.Option(False, "--metrics", help="Serve Prometheus metrics at /metrics (llama-server's names, plus specli's drafting figures)."),
    slots: bool = typer.Option(False, "--slots", help="Serve each slot's state at /slots (it shows every request's generated text to whoever has the key)."),
    alias: Optional[str] = typer.Option(None, "--alias", "-a", help="The model's names, comma-separated (its id: the first in sorted order, as llama-server's)."),
    tags: Optional[str] = typer.Option(None, "--tags", help="Tags listed with the model in /v1/models, comma-separated (llama-server's)."),
    chat_template_file: Optional[str] = typer.Option(None, "--chat-template-file", help="A Jinja chat template file for chat requests, instead of the model's own (llama-server's)."),
    reasoning: str = typer.Option("auto", "--reasoning", "-rea", help="off: the template's enable_thinking is false (on, auto: true), as llama-server's."),
    strict_model_names: bool = typer.Option(False, "--strict-model-names", help="Answer 404 to a request that names another model (default: any name is this server's model, as llama-server)."),
    cors_origins: str = typer.Option("*", "--cors-origins", help="Origins browsers may call from, comma-separated ('*': any; 'localhost': only this machine's)."),
    cors_methods: str = typer.Option("GET, POST, DELETE, OPTIONS", "--cors-methods", help="Methods a CORS preflight allows."),
    cors_headers: str = typer.Option("*", "--cors-headers", help="Headers a CORS preflight allows."),
    cors_credentials: bool = typer.Option(True, "--cors-credentials/--no-cors-credentials", help="Allow credentials in CORS requests (with origins '*', the request's Origin is echoed)."),
) -> int:
    """Serve the models over an OpenAI-compatible API (/v1/chat/completions, /v1/completions,
    /v1/models, /health) and llama-server's /infill, /tokenize, /detokenize, /apply-template and
    /props, drafting as `run` does. Ctrl-C or SIGTERM stops it cleanly."""
    choice = model_choice(models, placement, sampling, threads=threads, seed=seed, drafting=drafting, memory=memory)
    check_parallel(parallel, placement.n_ctx, choice.branches)
    if api_key is None and os.environ.get("SPECLI_API_KEY") is not None:
        api_key = os.environ["SPECLI_API_KEY"]  # (set but empty: the option parser drops it as unset)
    if api_key is not None and not api_key.strip():
        raise UsageError("--api-key (or SPECLI_API_KEY) is empty: every request would be let in; give a key, or unset it")
    try:
        from specli.server import app as server_app
    except ImportError as err:
        # (not 'specli[server]': another project is called specli on PyPI)
        raise UsageError(f"specli serve needs the server extra ({err.name} is missing): pip install '.[server]' in specli's folder, or pip install starlette uvicorn") from None
    from specli.llama.native import init_backend
    from specli.server.scheduler import Scheduler
    from specli.session.loading import plan

    if reasoning not in ("on", "off", "auto"):
        raise UsageError(f"--reasoning {reasoning!r}: give on, off or auto")
    if chat_template_file is not None and template is not None:
        raise UsageError("--template and --chat-template-file both choose the chat template; give one of them")
    from specli.cli.options import _read_text_file

    template_source = _read_text_file(chat_template_file, "--chat-template-file") if chat_template_file is not None else None
    names = [name.strip() for name in alias.split(",") if name.strip()] if alias is not None else []
    if alias is not None and not names:
        raise UsageError("--alias is empty; give the model's name (or several, comma-separated), or leave it out")
    if not cors_origins.strip():
        raise UsageError("--cors-origins is empty; give '*', 'localhost' or the origins allowed, comma-separated")
    from specli.server.handling import Cors

    if template is not None:
        from specli.session.chat import check_template_name

        check_template_name(template)
    socks = server_app.bind_all(host, port)  # a busy port fails before the slow load
    try:
        init_backend(verbose=verbose)
        the_plan = plan(choice)
        loaded = load_models(the_plan, choice, quiet=quiet, verbose=verbose)
        try:
            settings = _settings(loaded, the_plan, models, choice, api_key, max_tokens, template, quiet, aliases=names,
                                 template_file=(chat_template_file, template_source) if template_source is not None else None)
            if settings.formatter is not None:
                # the inputs llama-server gives every template (common_chat_extra_context):
                # enable_thinking (true unless --reasoning off), today as date_string and datetime
                today = datetime.date.today()
                settings.formatter.variables.update(enable_thinking=reasoning != "off", date_string=today.strftime("%d %b %Y"),
                                                    datetime=today.strftime("%b %d %Y"))
            settings.strict_models, settings.verbose = strict_model_names, verbose
            settings.tags = sorted({t.strip() for t in (tags or "").split(",") if t.strip()})
            settings.cors = Cors(cors_origins.strip(), cors_methods, cors_headers, cors_credentials)
            def save_memory(every_s: float = 0.0) -> float | None:  # (--memory persist; when idle: the scheduler's on_idle)
                problem = loaded.save_memory(every_s=every_s)
                if problem and not quiet:
                    server_app.stderr_line(problem)
                return loaded.memory_save_due(every_s)

            scheduler = Scheduler(
                loaded, n_seq=parallel, queue_limit=queue, n_threads=threads, describe=error_message, release_models=True,
                on_idle=(lambda: save_memory(MEMORY_SAVE_EVERY_S)) if loaded.memory_file is not None else None,
                cache_reuse=cache_reuse,
            )
            settings.metrics, settings.slots, settings.model_path = metrics, slots, str(the_plan.target_path)
            if cache_reuse and not scheduler.can_reuse and not quiet:
                server_app.stderr_line(f"specli: warning: --cache-reuse {cache_reuse} is off: {the_plan.target_path.name}'s cache cannot move entries "
                                       "(M-RoPE positions, or a sliding-window cache smaller than the context); only a common prefix is reused")
            service = server_app.Service(scheduler, loaded.model_tgt, settings)
            if choice.rpc:  # a stalled server: /health and the waiting requests get 503 before the exit
                from specli.llama import rpc

                rpc.on_stall(scheduler.stalled)
                service.on_stop.append(rpc.stop_asked)  # (a signal then does not wait for a stalled pass)
            bound_host, bound_port = server_app.address_of(socks[0])
            also = [server_app.address_of(s)[0] for s in socks[1:]]

            def ready() -> None:
                if quiet:
                    return
                shown = f"[{bound_host}]" if ":" in bound_host else bound_host
                drafting_text = "target only" if the_plan.mode == DraftMode.TARGET_ONLY else f"{the_plan.draft_label}, --draft-max {the_plan.draft_length}"
                if the_plan.memory != "off":
                    drafting_text += f", --memory {the_plan.memory}"
                server_app.stderr_line(
                    f"specli serve: listening on http://{shown}:{bound_port} (OpenAI base URL http://{shown}:{bound_port}/v1; "
                    f"model '{settings.model_id}', {drafting_text}, --parallel {parallel}); Ctrl-C stops"
                    + (f"; also on {', '.join(also)}" if also else "")
                )
                for listening in [bound_host, *also]:
                    if api_key is None and not _is_loopback(listening):
                        server_app.stderr_line(f"specli: warning: listening on {listening} without --api-key: anyone who can reach this port can use the models")

            try:
                server_app.serve(service, socks, on_ready=ready, verbose=verbose)
            finally:
                scheduler.close()
                save_memory()
        finally:
            if parallel == 1:
                loaded.close()  # (saves -n auto's measurements, as chat does)
            else:
                loaded.policy_path = None  # shared passes cost otherwise than one sequence's: not saved
                loaded.close()
    finally:
        for sock in socks:
            sock.close()
    if not quiet:
        print("specli serve: stopped", file=sys.stderr)
    return 0


def _settings(loaded, the_plan, models: Models, choice, api_key, max_tokens, template, quiet, aliases: list[str], template_file=None):
    from specli.server.app import Settings
    from specli.session.chat import choose_formatter

    formatter, problem = None, None
    try:
        formatter, notice = choose_formatter(loaded.model_tgt, template, source=template_file)
        if notice and not quiet:
            print(notice, file=sys.stderr)
    except UsageError as err:  # completions still work; chat requests get this reason
        problem = str(err)
        if not quiet:
            print(f"specli: warning: chat requests will be refused: {problem}", file=sys.stderr)
    path = Path(the_plan.target_path)
    alias_list = sorted(set(aliases))  # (llama-server's id: the first alias in sorted order)
    model_id = alias_list[0] if alias_list else models.model if models.model and not _looks_like_file(models.model) else path.stem
    names = {path.name, path.stem, str(path), *aliases} | ({models.model} if models.model else set())
    log = None if quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    return Settings(
        model_id=model_id, aliases=names, alias_list=alias_list, defaults=choice.sampling, api_key=api_key, default_max_tokens=max_tokens,
        formatter=formatter, chat_problem=problem, log=log,
    )


def _looks_like_file(name: str) -> bool:
    from specli.models.names import looks_like_path

    return looks_like_path(name)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
