"""Commands about models rather than generation (`specli models`, `specli pull`, `specli fit`,
`specli cache`): their options and their output (tables, JSON, messages). The work is done in
session/models.py (listing, pulling), session/fit.py and session/cache.py."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Literal, Optional

import typer

from specli.cli.options import Models, Placement, flatten, require_stdout
from specli.models.fit import KV_TYPES, gb, padded_ctx, size_text
from specli.modes import MAX_DRAFT, DraftMode
from specli.session.cache import cache_rows, clear_cache
from specli.session.fit import FitSettings, LocalFit, RpcFit, check_fit, fit_here, fit_over_rpc, rpc_devices
from specli.session.loading import cache_dir
from specli.session.models import cached_gguf_rows, pull, registry_rows

EXIT_DOES_NOT_FIT = 3  # a result, not an error: `specli fit` says "no"

commands = typer.Typer()

REGISTRY_HELP = "Your own models.toml, extending the shipped one (default: $SPECLI_MODELS, else ~/.config/specli/models.toml if present)."


@commands.command("models")
def models_cmd(
    json_out: bool = typer.Option(False, "--json", help="Print one JSON array instead of a table."),
    registry_file: Optional[str] = typer.Option(None, "--registry", metavar="FILE", help=REGISTRY_HELP),
) -> int:
    """List the models.toml entries and whether their files are on this machine (no network)."""
    require_stdout()
    rows = registry_rows(registry_file)
    if json_out:
        print(json.dumps(rows, ensure_ascii=False))
        return 0
    width = os.get_terminal_size(sys.stdout.fileno()).columns if sys.stdout.isatty() else None
    for line in models_lines(rows + cached_gguf_rows(rows), width):
        print(line)
    return 0


def models_lines(rows: list[dict], width: Optional[int]) -> list[str]:
    """`specli models` for humans: with a terminal `width`, aligned columns that fit it (the
    description is cut first; a name never is: it is what -m takes); piped (width None), plain
    tab-separated lines, as `ollama list`, for cut and awk."""
    table = [("NAME", "DRAFT", "SIZE", "LOCAL", "DESCRIPTION")]
    for row in rows:
        if "target" not in row:  # a cached GGUF (cached_gguf_rows)
            table.append((row["name"], row["draft"], gb(row["size"]), row["local"], row["description"]))
            continue
        t, d = row["target"], row["draft"]
        sources = [s for s in (t, d) if isinstance(s, dict)]
        size = " + ".join(gb(s["size_bytes"]) if s["size_bytes"] else "?" for s in sources)
        local = " / ".join("yes" if s["downloaded"] else "no" for s in sources)
        description = ("(default) " if row["default"] else "") + row["description"]
        table.append((row["name"], DraftMode.LOOKUP if d == DraftMode.LOOKUP else "model", size, local, description))
    if width is None:
        return ["\t".join(cells) for cells in table]
    widths = [max(len(cells[i]) for cells in table) for i in range(4)]
    lines = []
    for cells in table:
        line = "  ".join(cell.ljust(w) for cell, w in zip(cells, widths))
        room = width - len(line) - 2
        description = cells[4] if len(cells[4]) <= room else cells[4][: max(room - 1, 0)] + "…" if room > 1 else ""
        lines.append((line + "  " + description).rstrip() if description else line.rstrip())
    return lines


# --- specli pull ---------------------------------------------------------------------------------


@commands.command("pull")
def pull_cmd(
    name: str = typer.Argument(..., help="A models.toml name (see `specli models`), or a Hugging Face GGUF: user/repo:QUANT or user/repo/file.gguf."),
    draft: Optional[str] = typer.Option(None, "--draft", "-d", "-md", metavar="NAME", help="A draft model to get too (user/repo:QUANT, user/repo/file.gguf or a models.toml name)."),
    registry_file: Optional[str] = typer.Option(None, "--registry", metavar="FILE", help=REGISTRY_HELP),
) -> int:
    """Download GGUFs into the Hugging Face cache: a models.toml entry's target and draft, or
    Hugging Face names as llama.cpp's -hf takes them (user/repo:Q4_K_M picks the file by quant).

    Prints the local paths on stdout, one per line; progress and a summary go to stderr.
    """
    require_stdout()  # (before a download)
    pulled = pull(name, draft, registry_file, say=lambda line: print(line, file=sys.stderr))
    for f in pulled.files:
        print(f.path, flush=True)
    new = pulled.new
    kept = len(pulled.files) - len(new)
    parts = [f"{len(new)} downloaded ({gb(sum(f.size for f in new))})"] if new else []
    if kept:
        parts.append(f"{kept} already present" + (" (offline: HF_HUB_OFFLINE is set)" if pulled.offline else ""))
    print(f"{name}: {len(pulled.files)} file{'s' if len(pulled.files) != 1 else ''}, " + ", ".join(parts)
          + f"; run it: specli run -m {name}" + (f" -d {draft}" if draft else "") + ' "..."', file=sys.stderr)
    return 0


# --- specli fit ----------------------------------------------------------------------------------


def _memory_json(m) -> dict:
    return {"kind": m.kind, "name": m.name, "free": m.free, "total": m.total,
            "ram_free": m.ram_free, "ram_total": m.ram_total, "source": m.source, "other_devices": list(m.others)}


@commands.command("fit")
@flatten
def fit_cmd(
    *,
    models: Models,
    placement: Placement,
    kv_type: Literal[KV_TYPES] = typer.Option("f16", "--kv-type", help="KV cache type."),
    # (Typer's range refuses nan and inf too)
    overhead_gb: float = typer.Option(2.0, "--overhead-gb", min=0, max=1e6, help="Compute buffers and runtime, in GB (the guide's 2)."),
    # run's spellings of the draft length (--n-draft: fit's older one); no -n here: fit generates
    # nothing, so llama.cpp's -n (tokens to generate) would mean nothing either.
    draft_length: int = typer.Option(5, "--draft-max", "--n-draft", "--spec-draft-n-max", "--num-speculative-tokens", min=1, max=MAX_DRAFT, help="Draft tokens per step N (sizes the logits buffer)."),
    device: Optional[str] = typer.Option(None, "--device", help="GPU to fit into, by index or name (default: the one with most free memory)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
    registry_file: Optional[str] = typer.Option(None, "--registry", metavar="FILE", help=REGISTRY_HELP),
) -> int:
    """Will the target, the draft and both KV caches fit in this machine's memory? Exit 0 yes, 3 no."""
    require_stdout()
    placement.check()
    settings = FitSettings(
        model=models.model, draft=models.draft, lookup=models.lookup, n_ctx=placement.n_ctx, ngl=placement.ngl,
        draft_ngl=placement.draft_ngl, kv_type=kv_type, draft_length=draft_length, overhead_gb=overhead_gb, device=device,
        registry_file=registry_file,
    )
    check = check_fit(settings)
    if placement.rpc is not None:
        endpoints = placement.rpc_endpoints()
        devices = rpc_devices(endpoints, placement.rpc_timeout)
        return _print_fit_rpc(fit_over_rpc(check, devices, endpoints, placement.split()), json_out=json_out)
    result = fit_here(check)
    # What `specli run` would say before loading this pair: flagged here, on stderr, one line each.
    for line in result.warnings:
        print(line, file=sys.stderr)
    if json_out:
        out = _fit_json(result)
        out["warnings"] = result.warnings
        print(json.dumps(out))
    else:
        _print_fit(result)
    return 0 if result.ok else EXIT_DOES_NOT_FIT


def _print_fit_rpc(result: RpcFit, *, json_out: bool) -> int:
    """fit --rpc's answer: the target's offloaded layers over the local GPU (if any) and the RPC
    servers' devices (each reports its free memory), the rest on this machine."""
    est, split, room_here, command = result.est, result.split, result.room_here, result.command
    ngl = split.offloaded
    if json_out:
        out = {
            "fits": result.ok, "ngl": ngl, "local_bytes": split.local_bytes, "local_free": room_here,
            "devices": [{"name": d.name, "free": d.free, "layers": d.layers, "output": d.output, "bytes": d.bytes, "fits": d.fits} for d in split.devices],
            "suggested_tensor_split": list(split.suggested) if split.suggested is not None else None, "suggestion": command,
        }
        print(json.dumps(out))
    else:
        print(f"target: {est.target.label}, {ngl} of {est.target.n_layer} layers offloaded over {result.n_devices} device(s):")
        for d in split.devices:
            print(f"  {d.name}: {d.layers} layers{' and the output layer' if d.output else ''}, {gb(d.bytes)} of {gb(d.free)} free{'' if d.fits else '  DOES NOT FIT'}")
        print(f"  this machine (other layers, draft, logits, overhead): {gb(split.local_bytes)} of {gb(room_here)} free"
              + ("" if split.local_bytes <= room_here else "  DOES NOT FIT"))
        print(("fits" if result.ok else "does not fit") + (f"; a split that fits: {command}" if command and not split.fits else ""))
        if split.suggested is None:
            print("no split of these layers fits these devices: lower -ngl, -c or pick a smaller quantization")
    return 0 if result.ok else EXIT_DOES_NOT_FIT


def _model_json(shape) -> dict | None:
    if shape is None:
        return None
    return {"label": shape.label, "origin": shape.origin, "quant": shape.quant, "n_layer": shape.n_layer,
            "n_head_kv": list(shape.n_head_kv), "head_dim_k": shape.head_dim_k, "head_dim_v": shape.head_dim_v,
            "n_vocab": shape.n_vocab, "n_ctx_train": shape.n_ctx_train, "n_swa": shape.n_swa}


def _fit_json(result: LocalFit) -> dict:
    est, memory, placement = result.est, result.machine, result.placement
    return {
        "fits": result.ok,
        "target": _model_json(est.target),
        "draft": _model_json(est.draft),
        "ctx": est.n_ctx,
        "ctx_allocated": padded_ctx(est.n_ctx),
        "kv_type": est.kv_type,
        "n_draft": est.draft_length,
        "bytes": {
            "weights_target": est.weights_target, "weights_draft": est.weights_draft,
            "kv_target": est.kv_target, "kv_draft": est.kv_draft,
            "logits_target": est.logits_target, "logits_draft": est.logits_draft,
            "overhead": est.overhead, "total": est.total, "flat_formula": est.flat,
            "on_gpu": placement.gpu_bytes if memory.kind == "gpu" else 0,
            "in_ram": placement.ram_bytes,
        },
        "memory": _memory_json(memory),
        "suggestions": [{"kind": s.kind, "detail": s.detail, "command": s.command} for s in result.suggestions],
    }


def _print_fit(result: LocalFit) -> None:
    """The human report on stdout: components table, both formulas, the verdict, suggestions."""
    from rich.console import Console  # (rich: only when a table is printed)
    from rich.table import Table
    from rich.text import Text

    est, memory, placement, need = result.est, result.machine, result.placement, result.need
    console = Console(file=sys.stdout, width=None if sys.stdout.isatty() else 120)
    has_draft = est.draft is not None
    # Each model by its own name and size.
    title = f"target {est.target.label} ({size_text(est.target.weight_bytes)})" + (
        f" + draft {est.draft.label} ({size_text(est.draft.weight_bytes)})" if has_draft else ", no draft model")
    table = Table(title=Text(title))  # (Text: a file name is no markup)
    for column in ("component", "target", "draft", "total"):
        table.add_column(column, justify="left" if column == "component" else "right")

    def row(name, t, d):
        table.add_row(name, gb(t), gb(d) if has_draft else "-", gb(t + d))

    row("weights", est.weights_target, est.weights_draft)
    row(f"KV cache ({padded_ctx(est.n_ctx)} tokens, {est.kv_type})", est.kv_target, est.kv_draft)
    row(f"logits (N={est.draft_length})", est.logits_target, est.logits_draft)
    table.add_row("overhead", "", "", gb(est.overhead))
    table.add_row("total", "", "", gb(est.total), style="bold")
    console.print(table)
    origins = f"facts: target from its {est.target.origin}" + (f", draft from its {est.draft.origin}" if has_draft else "")
    console.print(origins, highlight=False)
    console.print(f"guide's flat formula (target + draft + KV + overhead): {gb(est.flat)}; exact: {gb(est.total)}", highlight=False)
    console.print(f"memory: {memory.name} via {memory.source}: {gb(memory.free)} free of {gb(memory.total)}"
                  + (f" (other GPUs: {', '.join(memory.others)}; --device picks)" if memory.others else ""), highlight=False)
    if memory.kind == "gpu":
        console.print(f"on the GPU: {gb(placement.gpu_bytes)}; in RAM: {gb(placement.ram_bytes)} of {gb(memory.ram_free)} available", highlight=False)
    if result.ok:
        console.print(f"[bold green]fits[/]: needs {gb(need)}, {gb(memory.free - need)} to spare")
        return
    if need <= memory.total:
        console.print(f"[bold red]does not fit[/] in free memory: needs {gb(need)}; it would fit in the {gb(memory.total)} total if other programs freed memory")
    else:
        console.print(f"[bold red]does not fit[/]: needs {gb(need)}, more than the {gb(memory.total)} total")
    if not result.suggestions:
        console.print("no smaller context, layer split or quantization makes it fit here", highlight=False)
    for s in result.suggestions:
        console.print(f"- {s.detail}:", highlight=False)
        console.print(f"    {s.command}", highlight=False, markup=False, soft_wrap=True)


# --- specli cache --------------------------------------------------------------------------------


def _ago(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit} ago"
    return "just now"


def _print_ignored(row: dict, what_runs_do: str) -> None:
    print(f"{row['file']}\n  ignored: {row['ignored']} ({what_runs_do}; `specli cache --clear` removes it)")


def _print_cache(rows: list[dict], now: float) -> None:
    memories = [row for row in rows if row.get("kind") == "token-memory"]
    rows = [row for row in rows if row.get("kind") != "token-memory"]
    print(f"{cache_dir()}: {len(rows)} file(s) of --draft-max auto measurements")
    if memories:
        print(f"{len(memories)} token memory file(s) of --memory persist")
    for row in memories:
        print()
        if "ignored" in row:
            _print_ignored(row, "runs neither use nor save it")
            continue
        print(f"token memory of tokenizer {row['fingerprint']}: saved {_ago(row['age_s'])}")
        print(f"  {row['file']}")
        print(f"  {row['bytes']:,} bytes, {row['tokens']:,} tokens in {row['documents']:,} document(s)")
    for row in rows:
        print()
        if "ignored" in row:
            _print_ignored(row, "the next run replaces it")
            continue
        key = row["key"]
        target = os.path.basename(str(key.get("target", "?")))
        drafter = key.get("mode", "?") + (f" {os.path.basename(str(key['draft']))}" if key.get("draft") else "")
        threads = key.get("threads") or "default"
        print(f"{target}, {drafter}, threads {threads}, ngl {key.get('ngl', '?')}: saved {_ago(now - row['saved_at'])}")
        print(f"  {row['file']}")
        if row["pass_ms"]:
            print("  target pass over n tokens, ms at no context (samples, when):")
            print("   " + "  ".join(
                f"{n}: {p['ms']:.2f} ({p['samples']}, {_ago(now - p['measured_at'])})" for n, p in row["pass_ms"].items()
            ))
        ctx = row["context_us_per_token"]
        print(f"  each token of context adds {ctx['one_token_pass']:.3f} us to a one-token pass, "
              f"{ctx['wide_pass']:.3f} us per token to a wider one")
        if row["cpu_per_second"] is not None:
            print(f"  CPU use of an uncontended pass: {row['cpu_per_second']:.2f} s per s (less marks a busy machine)")
        for name, src in row["sources"].items():
            costs = [f"{label} {src[k]:.3f} ms" for label, k in (("a draft token", "draft_token_ms"), ("a start", "draft_start_ms"))
                     if src[k] is not None]
            prior = " ".join(f"{r:.2f}" for r in src["acceptance_prior"][:8])
            print(f"  {name}: {', '.join(costs) or 'no draft cost measured'}; "
                  f"acceptance by position, a weak prior for the next run: {prior or '-'}")


@commands.command("cache")
def cache_cmd(
    clear: bool = typer.Option(False, "--clear", help="Forget every saved measurement and token memory (the next runs start fresh)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON array instead of text."),
) -> int:
    """Show what `--draft-max auto` has learnt per target and drafter (pass costs, acceptance, when and
    from how many samples) and the token memories of `--memory persist`, or forget both with --clear."""
    if clear:  # (says what it did on stderr: no stdout needed)
        folder, removed, memories = clear_cache()
        print(f"specli: removed {removed} file(s) of --draft-max auto measurements and {memories} token memory file(s) from {folder}",
              file=sys.stderr)
        return 0
    require_stdout()
    now = time.time()
    rows = cache_rows(now)
    if json_out:
        print(json.dumps(rows, ensure_ascii=False))
    else:
        _print_cache(rows, now)
    return 0
