"""`specli fit` as data: from -m/-d/--lookup and the memory options to the estimate, where it
would go on this machine (or over --rpc servers), whether it fits, and what would make it fit.

models/fit.py does the arithmetic on model shapes; this module finds the shapes (GGUF headers,
models.toml), asks llama.cpp for the devices, and puts the pieces together. cli/models.py
parses the options and renders the result.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from specli.errors import UsageError
from specli.llama import rpc
from specli.llama.devices import backend_devices
from specli.models import fit
from specli.models.hub import parse_hf_ref
from specli.models.names import draft_entry, looks_like_path, resolve_model_arg
from specli.models.registry import Registry, RegistryEntry, load_effective_registry


@dataclass(frozen=True, kw_only=True)
class FitSettings:
    """fit's options, as plain values (their defaults are the CLI's)."""

    model: Optional[str] = None  # -m; None: models.toml's default
    draft: Optional[str] = None  # -d
    lookup: bool = False
    n_ctx: int
    ngl: int  # target layers offloaded (-1: all)
    draft_ngl: int
    kv_type: str
    draft_length: int  # draft tokens per step (sizes the logits buffer)
    overhead_gb: float  # compute buffers and runtime
    device: Optional[str] = None  # --device: a GPU by index or name
    registry_file: Optional[str] = None


@dataclass
class FitCheck:
    """What fit knows before placing anything: the shapes, the machine's memory and the estimate."""

    settings: FitSettings
    registry: Registry
    target: fit.ModelShape
    draft: fit.ModelShape | None
    model_arg: str | None  # -m as given (None: the default entry), for the suggested commands
    draft_arg: str | None
    machine: fit.DeviceMemory
    est: fit.Estimate


@dataclass
class LocalFit:
    """The answer on this machine alone."""

    est: fit.Estimate
    machine: fit.DeviceMemory
    placement: fit.Placement
    ok: bool
    need: int  # bytes on the GPU (a GPU machine), else in RAM
    suggestions: list[fit.Suggestion]  # ways to make it fit (none when it does)
    warnings: list[str]  # what `specli run` would say before loading this pair


@dataclass
class RpcFit:
    """The answer with --rpc: the target's offloaded layers over the servers' devices and the
    local GPUs, the rest on this machine."""

    est: fit.Estimate
    split: fit.RpcSplit
    n_devices: int
    ok: bool
    room_here: int  # free bytes on this machine for what stays here
    command: str | None  # the --rpc ... --tensor-split options of a split that fits, if any


def check_fit(settings: FitSettings) -> FitCheck:
    """Resolve the models (offline), check the KV type, find the memory, estimate.
    Raises UsageError (and the registry's and header readers' errors)."""
    s = settings
    registry = load_effective_registry(s.registry_file)
    target, draft_shape, model_arg, draft_arg = _resolve_shapes(s.model, s.draft, s.lookup, registry)
    for shape in (target, draft_shape):
        problem = fit.kv_type_problem(shape, s.kv_type) if shape is not None else None
        if problem:
            raise UsageError(problem)
    machine = fit.detect_memory(s.device, backend_devices)
    overhead = round(s.overhead_gb * fit.GB)
    est = fit.estimate(target, draft_shape, n_ctx=s.n_ctx, kv_type=s.kv_type, draft_length=s.draft_length, overhead=overhead)
    return FitCheck(s, registry, target, draft_shape, model_arg, draft_arg, machine, est)


def fit_here(check: FitCheck) -> LocalFit:
    """Place the estimate on this machine (-ngl, --draft-ngl): does it fit, and if not, what would."""
    s, machine, est = check.settings, check.machine, check.est
    placement = fit.place(est, machine, s.ngl, s.draft_ngl)
    ok = fit.fits(placement, machine)
    need = placement.gpu_bytes if machine.kind == "gpu" else placement.ram_bytes
    suggestions = [] if ok else _suggestions(check)
    problem = fit.vocab_problem(check.target, check.draft) if check.draft is not None else None
    warnings = ([f"warning: {problem} (specli run refuses this pair)"] if problem else []) + fit.pair_warnings(check.target, check.draft, s.n_ctx)
    return LocalFit(est, machine, placement, ok, need, suggestions, warnings)


def rpc_devices(endpoints: tuple[str, ...], timeout: float) -> list[tuple[str, int]]:
    """(label, free bytes) of each device the target's layers can go to, in llama.cpp's order:
    the RPC servers' devices (each server asked), then this machine's GPUs (run --rpc splits so)."""
    remote = rpc.add_servers(endpoints, timeout)
    local = [rpc.device_memory(handle) for handle in rpc.local_accelerators()]
    return [(f"{d.endpoint} ({d.name})", d.free) for d in remote] + [(f"this machine ({name})", free) for name, free, _ in local]


def fit_over_rpc(check: FitCheck, devices: list[tuple[str, int]], endpoints: tuple[str, ...],
                 shares: tuple[float, ...] | None) -> RpcFit:
    """Split the target's offloaded layers (-ngl) over `devices` (rpc_devices) by `shares`
    (--tensor-split; None: by free memory), the rest on this machine. UsageError when the
    shares do not match the devices."""
    ngl = check.settings.ngl
    if shares is not None and len(shares) != len(devices):
        raise UsageError(f"--tensor-split gives {len(shares)} shares for {len(devices)} devices (the servers', then the local GPUs); give one each")
    split = fit.rpc_split(check.est, devices, ngl, shares)
    machine = check.machine
    room_here = machine.ram_free if machine.kind == "gpu" else machine.free
    ok = split.fits and split.local_bytes <= room_here
    command = None
    if split.suggested is not None:
        command = f"--rpc {','.join(endpoints)} -ngl {ngl} --tensor-split {','.join(str(n) for n in split.suggested)}"
    return RpcFit(check.est, split, len(devices), ok, room_here, command)


def _resolve_shapes(model: Optional[str], draft: Optional[str], lookup: bool, registry: Registry):
    """(target shape, draft shape or None, target arg, draft arg) from -m/-d/--lookup, offline.

    Paths are read from their GGUF header; models.toml names from their local file when it is
    present, else from the facts models.toml records.
    """
    if draft and lookup:
        raise UsageError("use either -d/--draft (a draft model) or --lookup (no draft model), not both")

    def one(arg: str) -> tuple[fit.ModelShape, RegistryEntry | None]:
        if looks_like_path(arg):
            return fit.shape_from_file(Path(arg).expanduser()), None
        if parse_hf_ref(arg) is not None:
            # Cached files only: fit is the check made before a download, never a cause of one.
            return fit.shape_from_file(resolve_model_arg(arg, registry, download=False)[0]), None
        entry = registry.get(arg)
        return of(entry.target), entry

    def of(source) -> fit.ModelShape:
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
        pair = draft_entry(draft, registry)  # a pair's name as -d means its draft model, as in run
        draft_shape = of(pair.draft) if pair is not None else one(draft)[0]
        draft_arg = draft
    elif not lookup and entry is not None and entry.draft is not None:
        draft_shape = of(entry.draft)
    return target, draft_shape, model_arg, draft_arg


def run_command(model_arg: str | None, draft_arg: str | None, lookup: bool, *, ctx: int, ngl: int = -1, draft_ngl: int = -1) -> str:
    """The `specli run` command line for a suggestion (arguments quoted for a shell)."""
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


def _suggestions(check: FitCheck) -> list[fit.Suggestion]:
    """Concrete ways to make a non-fitting setup fit: a smaller context, a layer split, a smaller quant."""
    s, target, draft, memory, est = check.settings, check.target, check.draft, check.machine, check.est
    model_arg, draft_arg, lookup = check.model_arg, check.draft_arg, s.lookup
    out = []
    common = dict(kv_type=s.kv_type, draft_length=s.draft_length, overhead=est.overhead)
    best_ctx = fit.max_context(target, draft, memory, ngl=s.ngl, draft_ngl=s.draft_ngl, limit=s.n_ctx, **common)
    if best_ctx:
        out.append(fit.Suggestion("ctx", f"the largest context that fits is {best_ctx} tokens",
                                  run_command(model_arg, draft_arg, lookup, ctx=best_ctx, ngl=s.ngl, draft_ngl=s.draft_ngl)))
    split = fit.layer_split(est, memory, s.draft_ngl)
    if split:
        tn, dn = split
        out.append(fit.Suggestion("ngl", f"{tn} of {target.n_layer} target layers on the GPU, the rest in RAM (slower)",
                                  run_command(model_arg, draft_arg, lookup, ctx=s.n_ctx, ngl=tn, draft_ngl=dn)))
    quant = fit.smaller_quant(target, draft, memory, n_ctx=s.n_ctx, ngl=s.ngl, draft_ngl=s.draft_ngl, **common)
    if quant:
        name, smaller = quant
        command = f"llama-quantize --allow-requantize TARGET.gguf TARGET-{name}.gguf {name}"
        if model_arg and looks_like_path(model_arg):
            command = f"llama-quantize --allow-requantize {shlex.quote(model_arg)} target-{name}.gguf {name}"
        elif model_arg and parse_hf_ref(model_arg):
            command = f"specli pull {parse_hf_ref(model_arg).repo}:{name}   # if the repo has that quant"
        else:
            entry = check.registry.get(model_arg) if model_arg else check.registry.default
            src = entry.target
            if src.hf_repo and src.hf_files and target.quant:
                files = [fit.QUANT_RE.sub(name, f) for f in src.hf_files]
                command = "hf download " + " ".join([src.hf_repo, *files]) + "   # file name guessed: check the repo"
        out.append(fit.Suggestion("quant", f"a {name} target (~{fit.gb(smaller.weight_bytes)}) fits", command))
    return out
