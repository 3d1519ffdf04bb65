"""From command-line choices to a ready decoder: resolve names, load models, pick the drafter.

Shared by every command that generates (run, chat, batch and bench).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from specli import __version__
from specli.decoding.generation import Generation
from specli.decoding.memory import TokenMemory
from specli.decoding.memory_drafter import drafter_with_memory
from specli.decoding.policy import store as policy_store
from specli.decoding.sampling import GREEDY, SamplingParams
from specli.decoding.step import SpeculativeDecoder, draft_length_for
from specli.errors import IncompatibleDraftError, SpecliError, UsageError
from specli.files import write_atomically
from specli.gguf import check_model_path
from specli.llama.compat import check_compatible
from specli.llama.context import validate_ctx
from specli.llama.model import LlamaModel
from specli.llama.rpc import RPC_TIMEOUT_S
from specli.models import fit
from specli.models.names import resolve_draft_arg, resolve_model_arg, resolve_source
from specli.models.registry import load_effective_registry
from specli.modes import DraftLength, DraftMode
from specli.session.memory_store import MemoryFile, tokenizer_fingerprint

MEMORY_OFF, MEMORY_PROCESS, MEMORY_PERSIST = "off", "process", "persist"
MEMORY_MODES = (MEMORY_OFF, MEMORY_PROCESS, MEMORY_PERSIST)
MEMORY_BOUND = 1_000_000  # tokens --memory process keeps at most (the oldest generations go first)
MEMORY_SAVE_EVERY_S = 30.0  # serve --memory persist: the most often an idle server saves (a save re-reads and writes the file)


@dataclass
class ModelChoice:
    """What the user asked for (None = not given)."""

    model: str | None = None
    draft: str | None = None
    lookup: bool = False
    target_only: bool = False
    draft_length: DraftLength | None = None  # None: auto
    n_ctx: int = 4096
    ngl: int = -1
    draft_ngl: int = -1
    threads: int | None = None
    sampling: SamplingParams = GREEDY
    # The target's layers on llama.cpp RPC servers (llama/rpc.py): their HOST:PORTs, each
    # device's share of the offloaded layers (None: by free memory), and whether the draft
    # model goes there too (else it stays on this machine).
    rpc: tuple[str, ...] = ()
    tensor_split: tuple[float, ...] | None = None
    draft_rpc: bool = False
    rpc_timeout: float = RPC_TIMEOUT_S  # seconds a server gets to answer the handshake, and a pass
    # Drafting from memory (MEMORY_MODES): "off", or "process": one TokenMemory for the process
    # (Loaded.memory), every finished generation's prompt and output in it; lookup drafting only;
    # or "persist": that memory loaded from, and saved to, a file per tokenizer in cache_dir()
    # (memory_store.py; Loaded.memory_file): run and chat after each generation, serve when
    # idle and at exit, batch at the end (Loaded.save_memory).
    memory: str = MEMORY_OFF
    # Candidate continuations from memory verified together in one target pass (branches.py):
    # at most this many (1: the draft alone); the target's context then holds that many sequences.
    branches: int = 1


@dataclass
class Plan:
    """Resolved files and drafting mode, before anything is loaded."""

    target_path: Path
    draft_path: Path | None  # a draft model file, or None
    mode: DraftMode
    draft_length: DraftLength  # a fixed length or auto; off for target-only
    sampling: SamplingParams = GREEDY
    memory: str = MEMORY_OFF  # ModelChoice.memory, checked against the mode
    # One line each for stderr, found in the GGUF headers before loading (see check_headers).
    warnings: list[str] = field(default_factory=list)

    @property
    def draft_label(self) -> str | None:
        """`draft` in --json: the draft file, "lookup", or None for target-only."""
        if self.mode == DraftMode.DRAFT_MODEL:
            return str(self.draft_path)
        if self.mode == DraftMode.HYBRID:
            return f"{DraftMode.LOOKUP}+{self.draft_path}"
        return DraftMode.LOOKUP if self.mode == DraftMode.LOOKUP else None


@dataclass
class Loaded:
    plan: Plan
    model_tgt: LlamaModel
    model_dft: LlamaModel | None
    decoder: SpeculativeDecoder
    policy_path: Path | None = None  # where `--draft-max auto`'s measurements are kept between runs
    policy_key: dict | None = None  # what they are for (shown by `specli cache`)
    # A saved file that was ignored: one line for stderr, and why (for --verbose).
    policy_notice: str | None = None
    policy_problem: str | None = None
    # With --memory process: the process's TokenMemory, shared by every drafter made for it
    # (the decoder's, and each slot's of batch/serve --parallel: drafter_with_memory).
    memory: TokenMemory | None = None
    # With --memory persist: its file (memory_store.MemoryFile; its `notice`: the file was ignored).
    memory_file: MemoryFile | None = None
    _memory_saved_at: float = float("-inf")

    def remember(self, gen: Generation) -> str | None:
        """run and chat: a finished generation's prompt and output (Generation.document: not an
        interrupted one) into the memory, and with --memory persist saved to its file; a line
        for stderr when that save failed."""
        document = gen.document()
        if document is None or self.memory is None:
            return None
        problem = None
        if self.memory_file is not None:
            problem = self.memory_file.remember(document)  # (its memory is self.memory)
        else:
            self.memory.add(document)
        self.memory.index()  # (now, while no generation is timed, as MemoryDrafter.remember does)
        return problem

    def save_memory(self, *, every_s: float = 0.0) -> str | None:
        """serve and batch with --memory persist: save the documents their drafters added to the
        memory since the last save, if any (at most once every `every_s` seconds); a line for
        stderr when that failed (they stay for the next save)."""
        if self.memory_file is None or not self.memory_file.has_pending:
            return None
        now = time.monotonic()
        if now - self._memory_saved_at < every_s:
            return None
        self._memory_saved_at = now
        return self.memory_file.save()

    def memory_save_due(self, every_s: float) -> float | None:
        """Seconds until save_memory(every_s=every_s) would save (0: now), None with nothing to save."""
        if self.memory_file is None or not self.memory_file.has_pending:
            return None
        return max(0.0, self._memory_saved_at + every_s - time.monotonic())

    def close(self) -> None:
        if self.decoder.policy is not None and self.policy_path is not None:
            saved = self.decoder.policy.saved(time.time(), self.policy_key)
            if saved is not None:
                save_policy_state(self.policy_path, saved)
        for model in (self.model_dft, self.model_tgt):
            if model is not None:
                model.close()


def cache_dir() -> Path:
    """$SPECLI_CACHE_DIR, else $XDG_CACHE_HOME/specli, else ~/.cache/specli."""
    return Path(os.environ.get("SPECLI_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specli")


def policy_key(p: Plan, choice: ModelChoice) -> dict:
    """What a policy file is for: its costs depend on the files, the drafter and the
    thread/offload setting."""
    return {
        "target": str(p.target_path.resolve()), "target_size": p.target_path.stat().st_size,
        "draft": str(p.draft_path.resolve()) if p.draft_path else None,
        "draft_size": p.draft_path.stat().st_size if p.draft_path else None,
        "mode": p.mode, "threads": choice.threads, "ngl": choice.ngl, "draft_ngl": choice.draft_ngl, "specli": __version__,
        # (a pass over the network costs otherwise: measurements for --rpc are kept apart)
        **({"rpc": list(choice.rpc), "tensor_split": choice.tensor_split, "draft_rpc": choice.draft_rpc} if choice.rpc else {}),
    }


def policy_state_path(key: dict) -> Path:
    """Where `--draft-max auto` keeps what it measured for this pair on this machine: one file per
    policy_key (target, drafter and thread/offload setting) and file format, in cache_dir()."""
    facts = {name: value for name, value in key.items() if name != "specli"}  # (a new specli keeps them)
    digest = hashlib.sha1(json.dumps([policy_store.VERSION, facts], sort_keys=True).encode()).hexdigest()
    return cache_dir() / f"policy-{digest[:16]}.json"


def read_policy_file(path: Path) -> policy_store.Saved | None:
    """A saved file, checked whole (None: there is none). Raises policy_store.Rejected saying
    why it cannot be used. Only a regular file is read, and at most MAX_BYTES of it."""
    try:
        if not path.is_file():
            return None
        with path.open("rb") as handle:
            data = handle.read(policy_store.MAX_BYTES + 1)
    except OSError as err:
        raise policy_store.Rejected(f"it cannot be read ({err.strerror})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise policy_store.Rejected("it is not UTF-8 text") from None
    return policy_store.parse(text)


def save_policy_state(path: Path, saved: policy_store.Saved) -> None:
    """Write atomically (concurrent runs never see half a file); a cache that cannot be written
    only costs the next run its head start."""
    try:
        if path.exists() and not path.is_file():
            return  # a FIFO or a device in its place would be written in place, and a FIFO blocks
        text = policy_store.dumps(saved)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, [text])
    except (OSError, ValueError):
        pass


def plan(choice: ModelChoice) -> Plan:
    """Resolve -m/-d/--lookup/--target-only into files and a mode. Raises UsageError."""
    if choice.target_only and (choice.draft or choice.lookup):
        raise UsageError("--target-only cannot be combined with -d/--draft or --lookup; pick one")
    if choice.memory not in MEMORY_MODES:
        raise UsageError(f"--memory must be one of {', '.join(MEMORY_MODES)}, got {choice.memory!r}")
    if choice.memory != MEMORY_OFF and (choice.target_only or choice.draft):  # (before any file is resolved, or downloaded)
        _refuse_memory(choice, "--target-only" if choice.target_only else "-d/--draft")
    if choice.branches > 1 and choice.memory == MEMORY_OFF:
        raise UsageError(f"--branches {choice.branches} verifies the memory's other candidates: it needs --memory (process or persist)")
    # (library callers reach this without the CLI's check: an n_ctx of 0 would give the model's
    # whole training context, and one past MAX_CTX would wrap around inside llama.cpp)
    validate_ctx(choice.n_ctx)

    # The shipped models.toml plus the user's own (SPECLI_MODELS or the config dir's).
    registry = load_effective_registry()
    if choice.model is None:
        entry = registry.default
        target_path = resolve_source(entry.target)
    else:
        target_path, entry = resolve_model_arg(choice.model, registry)

    draft_path: Path | None = None
    if choice.target_only:
        mode = DraftMode.TARGET_ONLY
    elif choice.lookup and choice.draft:
        draft_path, _ = resolve_draft_arg(choice.draft, registry)
        mode = DraftMode.HYBRID
    elif choice.lookup:
        mode = DraftMode.LOOKUP
    elif choice.draft:
        # A pair's name as -d means that pair's draft model (resolve_draft_arg).
        draft_path, _ = resolve_draft_arg(choice.draft, registry)
        mode = DraftMode.DRAFT_MODEL
    elif entry is not None and entry.draft is not None:
        draft_path = resolve_source(entry.draft)
        mode = DraftMode.DRAFT_MODEL
    else:
        # No draft model named: prompt lookup costs nothing and never changes the output.
        mode = DraftMode.LOOKUP

    # A library caller's "auto" or number is taken too, and a bad one refused (SettingError);
    # the CLI refuses it earlier. Target-only drafts nothing, whatever was asked.
    asked = DraftLength.auto() if choice.draft_length is None else choice.draft_length
    draft_length = draft_length_for(mode != DraftMode.TARGET_ONLY, asked)
    if choice.memory != MEMORY_OFF and mode != DraftMode.LOOKUP:  # (a pair's own draft model)
        _refuse_memory(choice, "a draft model (the model's pair drafts with one)")
    # A FIFO or a device named as a model: refused here, before anything reads it (check_headers
    # leaves a header it cannot read to the load, which would come after the target's load).
    for path in (target_path, draft_path):
        if path is not None:
            check_model_path(path)
    p = Plan(target_path, draft_path, mode, draft_length, choice.sampling, memory=choice.memory)
    p.warnings = check_headers(p, choice.n_ctx)
    return p


def _refuse_memory(choice: ModelChoice, drafting: str) -> None:
    raise UsageError(
        f"--memory {choice.memory} drafts with prompt lookup only, not with {drafting}: "
        "pass --lookup and no -d/--draft or --target-only, or --memory off"
    )


def check_headers(p: Plan, n_ctx: int) -> list[str]:
    """What the GGUF headers tell before the (slow) load: raises IncompatibleDraftError for a
    draft whose tokenizer differs from the target's as far as they show (load() checks the loaded
    vocabularies in full), and returns warnings: -c above a model's training context, a draft
    larger than its target. A header that cannot be read is left to load(), which reports it."""
    try:
        target = fit.shape_from_file(p.target_path)
        draft = fit.shape_from_file(p.draft_path) if p.draft_path is not None else None
    except SpecliError:
        return []
    if draft is not None and p.draft_path.resolve() == p.target_path.resolve():
        draft = None  # the target drafting for itself: nothing to compare
    if draft is not None:
        problem = fit.vocab_problem(target, draft)
        if problem:
            raise IncompatibleDraftError(problem)
    return fit.pair_warnings(target, draft, n_ctx)


def rpc_devices(choice: ModelChoice) -> tuple[list[int] | None, list[int] | None]:
    """The devices for the target and the draft model (None: llama.cpp's own choice). With
    --rpc the servers are registered first, and llama.cpp's choice for the target is then the
    servers' devices, then the local GPUs (servers first: the output layer, and so the logits,
    stay on this machine when it has a GPU); the draft gets the local GPUs alone unless
    --draft-rpc."""
    if not choice.rpc:
        return None, None
    from specli.llama import rpc

    remote = rpc.add_servers(choice.rpc, choice.rpc_timeout)
    local = rpc.local_accelerators()
    if choice.tensor_split is not None and len(choice.tensor_split) != len(remote) + len(local):
        raise UsageError(
            f"--tensor-split gives {len(choice.tensor_split)} shares but the target has {len(remote) + len(local)} devices to split over "
            f"({len(remote)} from --rpc, then {len(local)} local GPU(s)); give one share each, in that order"
        )
    return None, None if choice.draft_rpc else local


def load(p: Plan, choice: ModelChoice) -> Loaded:
    """Load the models of a plan and build the decoder. Raises SpecliError subclasses."""
    devices_tgt, devices_dft = rpc_devices(choice)
    model_tgt = LlamaModel(
        p.target_path, n_ctx=choice.n_ctx, n_gpu_layers=choice.ngl, n_threads=choice.threads,
        devices=devices_tgt, tensor_split=choice.tensor_split, branches=choice.branches,
    )
    model_dft = None
    try:
        if model_tgt.is_recurrent_or_hybrid:
            raise UsageError(
                f"{p.target_path.name} is a recurrent or hybrid model: its state cannot drop rejected "
                "tokens, so speculative decoding cannot verify drafts with it; use a transformer target"
            )
        if DraftMode(p.mode).needs_draft_model:
            assert p.draft_path is not None
            model_dft = LlamaModel(p.draft_path, n_ctx=choice.n_ctx, n_gpu_layers=choice.draft_ngl, n_threads=choice.threads, devices=devices_dft)
            if model_dft.is_recurrent_or_hybrid:
                raise UsageError(f"{p.draft_path.name} is a recurrent or hybrid model; use a transformer draft model")
            if p.draft_path.resolve() != p.target_path.resolve():
                check_compatible(model_tgt.vocab_info(), model_dft.vocab_info(), model_tgt.token_text, model_dft.token_text)
        memory = TokenMemory(max_tokens=MEMORY_BOUND) if p.memory == MEMORY_PROCESS else None
        memory_file = None
        if p.memory == MEMORY_PERSIST:
            memory_file = MemoryFile.open(cache_dir(), tokenizer_fingerprint(model_tgt), model_tgt.n_vocab)
            memory = memory_file.memory
            memory.index()  # (now, before any generation is timed)
        decoder = SpeculativeDecoder(model_tgt, drafter_with_memory(p.mode, model_dft, memory), p.draft_length, p.sampling)
        loaded = Loaded(p, model_tgt, model_dft, decoder, memory=memory, memory_file=memory_file)
        if decoder.adaptive:
            loaded.policy_key = policy_key(p, choice)
            loaded.policy_path = policy_state_path(loaded.policy_key)
            try:
                saved = read_policy_file(loaded.policy_path)
            except policy_store.Rejected as err:
                # Never a reason to fail or slow a run: start fresh; the run's own measurements
                # replace the file when it ends.
                loaded.policy_problem = str(err)
                loaded.policy_notice = (
                    f"specli: ignored the saved --draft-max auto measurements in {loaded.policy_path} (damaged); "
                    "this run starts fresh and replaces them"
                )
            else:
                if saved is not None:
                    decoder.policy.seed(saved)
    except BaseException:
        if model_dft is not None:
            model_dft.close()
        model_tgt.close()
        raise
    return loaded
