"""The options the generating commands share, declared once, and what they become.

Each group below is a dataclass of Annotated fields (Typer's own option declarations).
`flatten` lays a group's fields out as the command's own options, in the group's place, so
Typer sees a flat signature while the command receives one object per group (uv flattens its
shared argument structs the same way). `model_choice` turns the groups into the ModelChoice the
core plans and loads from.

Ranges: Typer checks the plain ones (-c, --threads at least 1, -n/--max-tokens) as it parses; the
sampling ranges are SamplingParams.validate's, and --draft-max is parsed by DraftLength.parse
(modes.py).

Spellings follow llama.cpp's where the meaning is the same (-n tokens to generate, --draft-max,
-md, -ngl, -ngld, -c, -p), so a llama-cli habit does what it says. Click takes a declared
"-ngl" (one dash, several letters) as a long option, so `-ngl 99` is not `-n gl`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import os
import sys
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Optional

import typer

from specli.constraints import Grammar
from specli.decoding.branches import MAX_BRANCHES
from specli.decoding.sampling import SamplingParams, with_bias
from specli.decoding.stopping import check_stop
from specli.errors import SettingError, SpecliError, UsageError
from specli.files import NotRegularFile, open_regular, read_limited
from specli.llama.context import MAX_CTX, MIN_CTX
from specli.modes import MAX_DRAFT, DraftLength
from specli.session.loading import MEMORY_BOUND, MEMORY_OFF, MEMORY_PERSIST, MEMORY_PROCESS, MEMORY_SAVE_EVERY_S, Loaded, ModelChoice, Plan, load
from specli.session.memory_store import MAX_BYTES

# The defaults are the core's: ModelChoice's (context, offload) and SamplingParams' (llama.cpp's).
_CHOICE = ModelChoice()
_SAMPLING = SamplingParams()
DEFAULT_MAX_TOKENS = 256
# --threads above this many per logical CPU is a typo, not a setting (llama.cpp would start them all).
MAX_THREADS_PER_CPU = 4
# --ngl / --draft-ngl: -1 (all layers) or a count up to this. llama.cpp keeps the count in 32 bits
# (a larger number would wrap around silently); GGUF models have at most 512 layers.
MAX_NGL = 10_000
# --tensor-split: llama.cpp's LLAMA_MAX_DEVICES (its tensor_split array has this many entries).
MAX_DEVICES = 16
# --parallel at most: llama.cpp's LLAMA_MAX_SEQ (sequence ids 0..255; it keeps the count in 32
# bits, so a larger number would wrap around silently).
MAX_PARALLEL = 256

# The core names a setting it refuses by its field (SettingError); the CLI says its option.
OPTION_NAMES = {
    "temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p", "min_p": "--min-p",
    "repeat_penalty": "--repeat-penalty", "repeat_last_n": "--repeat-last-n", "seed": "--seed",
    "presence_penalty": "--presence-penalty", "frequency_penalty": "--frequency-penalty", "logit_bias": "--logit-bias",
    "draft_length": "--draft-max", "n_ctx": "-c", "max_tokens": "--max-tokens",
    "stop": "--stop",
}


def error_message(err: SpecliError) -> str:
    """An error's one line as the CLI says it: a refused setting named by its option (--top-k)."""
    if isinstance(err, SettingError):
        return err.worded(OPTION_NAMES.get(err.setting, err.setting))
    return str(err)


def require_stdout(fix: str = "run it with stdout open (> FILE, or > /dev/null to discard it)") -> None:
    """SpecliError (exit 1) when stdout is closed (`>&-`), before the command does any work: Python
    then has no sys.stdout, and the output would be found to have nowhere to go only after a
    whole run, as an AttributeError. `fix`: what to do instead (batch: -o FILE)."""
    if sys.stdout is None:
        raise SpecliError(f"stdout is closed, so the output would go nowhere; {fix}")


def parse_draft_length(text: str) -> DraftLength:
    """--draft-max's value as Typer parses it: "auto" or a number of drafts."""
    try:
        return DraftLength.parse(text)
    except ValueError as err:
        raise UsageError(f"--draft-max must be 'auto' or between 1 and {MAX_DRAFT} draft tokens per step; {err}") from None


# --- the option groups ----------------------------------------------------------------------------
@dataclass
class Models:
    """The target, and the draft model or prompt lookup (run, chat, batch, bench, fit)."""

    model: Annotated[Optional[str], typer.Option("-m", "--model", help=("Target model: a GGUF path, a Hugging Face GGUF (user/repo:QUANT or user/repo/file.gguf: from the HF cache, "
        "else downloaded once) or a models.toml name (a pair's name: its target, drafted by its draft). Default: "
        "models.toml's default (shipped: the embedded Gemma 3 270M)."))] = None
    draft: Annotated[Optional[str], typer.Option("-d", "-md", "--draft", "--model-draft",
        help=("Draft model: a GGUF path, user/repo:QUANT, user/repo/file.gguf or a models.toml name (a pair's name: the "
        "pair's draft model). Same tokenizer as the target."))] = None
    lookup: Annotated[bool, typer.Option("--lookup", help="Draft by prompt lookup (copying from the text so far); no draft model.")] = False


@dataclass
class Drafting:
    """Whether to draft, and how many tokens (run, chat, batch; bench sweeps its own --draft-max)."""

    target_only: Annotated[bool, typer.Option("--target-only", help="Plain decoding with the target alone: the baseline.")] = False
    # Parsed as Typer reads it: "auto" or a number of drafts (a DraftLength), None when not given.
    draft_length: Annotated[Optional[DraftLength], typer.Option(
        # llama.cpp's names; --num-speculative-tokens is specli's older one (-n was, before it
        # became llama.cpp's tokens to generate).
        "--draft-max", "--spec-draft-n-max", "--num-speculative-tokens", metavar="auto|N", parser=parse_draft_length,
        help=f"Draft tokens per step: 'auto' (default: chosen each step from measured costs and acceptance) or a fixed number 1-{MAX_DRAFT}.",
    )] = None
    branches: Annotated[int, typer.Option(
        "--branches", metavar="N", min=1, max=MAX_BRANCHES,
        help=("With --memory, greedy (--temp 0), one sequence at a time: verify up to N of the memory's candidate continuations "
              "in one target pass (a token tree) where earlier texts went different ways; 1 (default): the draft alone. "
              "With --draft-max auto a branch is sent only where the measured pass costs say the wider pass pays (on a GPU it may; "
              "on a CPU rarely); with a fixed --draft-max every candidate up to N. --verbose shows each tree pass."),
    )] = 1


@dataclass
class Placement:
    """Placement: the context and where the layers go (run, chat, batch, bench, fit); `--memory`
    is drafting memory, a different thing."""

    n_ctx: Annotated[int, typer.Option("-c", "--ctx", min=MIN_CTX, max=MAX_CTX, help="Context size in tokens (prompt + output).")] = _CHOICE.n_ctx
    ngl: Annotated[int, typer.Option("-ngl", "--ngl", "--n-gpu-layers", help="Target layers to offload to the GPU (-1 = all).")] = _CHOICE.ngl
    draft_ngl: Annotated[int, typer.Option("-ngld", "--draft-ngl", "--n-gpu-layers-draft", help="Draft model layers to offload to the GPU (-1 = all).")] = _CHOICE.draft_ngl
    rpc: Annotated[Optional[str], typer.Option("--rpc", metavar="HOST:PORT,...", help=("Split the target's offloaded layers (-ngl) over these llama.cpp rpc-server machines too (before the local "
        "GPUs, as llama.cpp orders them). Unauthenticated: trusted networks only."))] = None
    tensor_split: Annotated[Optional[str], typer.Option("-ts", "--tensor-split", metavar="N,N,...",
        help=("With --rpc: each device's share of the offloaded layers (the servers in order, then the local GPUs), e.g. 3,1."))] = None
    draft_rpc: Annotated[bool, typer.Option("--draft-rpc", help="With --rpc: put the draft model's offloaded layers on the same devices (default: it stays on this machine).")] = False
    rpc_timeout: Annotated[float, typer.Option("--rpc-timeout", metavar="SECONDS", min=0.1, max=86400,
        help=("With --rpc: how long to wait for a server to connect, to answer the handshake, and to answer a pass before "
        "giving up with one line (raise it for slow links or long prompts)."))] = _CHOICE.rpc_timeout

    def check(self) -> None:
        """UsageError unless --ngl and --draft-ngl are -1 (all layers) or 0..MAX_NGL, and the
        RPC options are well formed."""
        for option, value in (("--ngl", self.ngl), ("--draft-ngl", self.draft_ngl)):
            if not -1 <= value <= MAX_NGL:
                raise UsageError(f"{option} must be -1 (all layers) or a layer count from 0 to {MAX_NGL:,}, got {value}")
        if self.rpc is None and (self.tensor_split is not None or self.draft_rpc):
            raise UsageError(f"{'--tensor-split' if self.tensor_split is not None else '--draft-rpc'} only applies with --rpc HOST:PORT")

    def rpc_endpoints(self) -> tuple[str, ...]:
        from specli.llama.rpc import parse_endpoints  # (imports llama_cpp: only when asked)

        return parse_endpoints(self.rpc) if self.rpc is not None else ()

    def split(self) -> tuple[float, ...] | None:
        """--tensor-split as numbers; UsageError for anything but non-negative shares."""
        if self.tensor_split is None:
            return None
        try:
            shares = tuple(float(x) for x in self.tensor_split.replace("/", ",").split(","))
        except ValueError:
            shares = ()
        if not shares or any(not (x >= 0) or x == float("inf") for x in shares) or not sum(shares) > 0 or len(shares) > MAX_DEVICES:
            raise UsageError(f"--tensor-split takes up to {MAX_DEVICES} non-negative shares, not all 0, separated by commas (e.g. 3,1), got '{self.tensor_split}'")
        return shares


@dataclass
class Sampling:
    """How tokens are drawn (run, chat, batch, bench); --seed is each command's own (its help
    differs). The ranges are SamplingParams.validate's."""

    temperature: Annotated[float, typer.Option("--temperature", "--temp", help="Sampling temperature; 0 = greedy (deterministic).")] = _SAMPLING.temperature
    top_k: Annotated[int, typer.Option("--top-k", help="Keep the k most likely tokens (0 = off).")] = _SAMPLING.top_k
    top_p: Annotated[float, typer.Option("--top-p", help="Keep the smallest set of tokens with this much probability (1 = off).")] = _SAMPLING.top_p
    min_p: Annotated[float, typer.Option("--min-p", help="Drop tokens below this fraction of the best token's probability (0 = off).")] = _SAMPLING.min_p
    repeat_penalty: Annotated[float, typer.Option("--repeat-penalty", help="Penalise recently seen tokens (1 = off).")] = _SAMPLING.repeat_penalty
    repeat_last_n: Annotated[int, typer.Option("--repeat-last-n", help="How many recent tokens the penalties look at.")] = _SAMPLING.repeat_last_n
    presence_penalty: Annotated[float, typer.Option("--presence-penalty", help="Subtract this from the logit of each recently seen token (0 = off).")] = _SAMPLING.presence_penalty
    frequency_penalty: Annotated[float, typer.Option("--frequency-penalty", help="Subtract this times its recent count from each token's logit (0 = off).")] = _SAMPLING.frequency_penalty
    logit_bias: Annotated[Optional[list[str]], typer.Option("--logit-bias", "-l", help="TOKEN_ID+BIAS or TOKEN_ID-BIAS (-inf: never), added to that token's logit; repeatable.")] = None

    def params(self, seed: int | None) -> SamplingParams:
        """The checked SamplingParams (SettingError names the first bad field)."""
        fields = dataclasses.asdict(self)
        fields["logit_bias"] = with_bias(parse_logit_bias(self.logit_bias or []))
        return SamplingParams(**fields, seed=seed).validate()


def parse_logit_bias(values: list[str]) -> dict[int, float]:
    """llama.cpp's --logit-bias spellings (15043+1, 15043-0.5, 15043-inf) as {token: bias}; a
    token given twice: the biases add up."""
    out: dict[int, float] = {}
    for value in values:
        token, sign, bias = value.partition("+") if "+" in value else value.partition("-")
        try:
            if not sign or not token.strip().isdigit():
                raise ValueError
            amount = float(bias)
            if math.isnan(amount) or (amount == math.inf and sign == "+") or amount == -math.inf:
                raise ValueError
        except ValueError:
            raise UsageError(f"--logit-bias {value!r}: give TOKEN_ID+BIAS or TOKEN_ID-BIAS, e.g. 15043+1 or 15043-inf") from None
        out[int(token)] = out.get(int(token), 0.0) + (amount if sign == "+" else -amount)
    return out


# Single options several commands share.
Threads = Annotated[Optional[int], typer.Option("--threads", "-t", min=1, help="CPU threads (default: physical cores).")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="Nothing on stderr except errors.")]
Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="Show llama.cpp's log and tracebacks.")]
ShowAccept = Annotated[bool, typer.Option("--show-accept", help="On a terminal, colour text that came from accepted drafts.")]
_PERSIST_HELP = (
    "'persist' also keeps every finished generation's prompt and output between runs, in a file per tokenizer in the cache folder "
    f"(mode 0600, at most {MAX_BYTES >> 20} MiB, oldest out first; `specli cache` shows it, `--clear` deletes it) and copies from it "
    "when the text so far has no match. 'off' is the default: 'persist' writes your text to disk, and on text with nothing to recall memory gains nothing."
)
# batch's and serve's: one memory for the process, or kept between runs too.
DraftMemory = Annotated[typing.Literal[MEMORY_OFF, MEMORY_PROCESS, MEMORY_PERSIST], typer.Option(
    "--memory", help=(
        "Draft from memory too (with --lookup only): 'process' keeps every finished generation's prompt and output "
        f"(the latest {MEMORY_BOUND:,} tokens, in memory only) and copies from them when the text so far has no match; "
    ) + _PERSIST_HELP + f" With 'persist', serve saves when idle (at most every {MEMORY_SAVE_EVERY_S:.0f} s) and at exit, batch at the end.",
)]
# run's: one generation, so only a memory kept between runs can help it.
RunMemory = Annotated[typing.Literal[MEMORY_OFF, MEMORY_PERSIST], typer.Option(
    "--memory", help="Draft from memory too (with --lookup only): " + _PERSIST_HELP,
)]
# chat's: 'process' recalls earlier turns of this chat only.
ChatMemory = Annotated[typing.Literal[MEMORY_OFF, MEMORY_PROCESS, MEMORY_PERSIST], typer.Option(
    "--memory", help="Draft from memory too (with --lookup only): 'process' recalls this chat's earlier turns (in memory only); " + _PERSIST_HELP,
)]
@dataclass
class Constrain:
    """A constraint on the output (run, chat, batch, bench): llama.cpp's spellings. One of them at most."""

    grammar: Annotated[Optional[str], typer.Option("--grammar", metavar="GBNF", help="Constrain the output to this GBNF grammar (llama.cpp's format).")] = None
    grammar_file: Annotated[Optional[str], typer.Option("--grammar-file", metavar="FILE", help="--grammar from a file.")] = None
    json_schema: Annotated[Optional[str], typer.Option("-j", "--json-schema", metavar="SCHEMA",
        help="Constrain the output to JSON that validates against this JSON Schema ('{}' for any JSON).")] = None
    json_schema_file: Annotated[Optional[str], typer.Option("-jf", "--json-schema-file", metavar="FILE", help="--json-schema from a file.")] = None
    compact_json: Annotated[bool, typer.Option("--compact-json",
        help=("With --json-schema: JSON without spaces ({\"a\":1}) instead of with one after ':' and ','; more of the output is then "
              "forced by the schema, so drafted for free."))] = False

    def grammar_asked(self) -> Grammar | None:
        """The constraint asked for, checked before any model loads (GrammarError: exit 2)."""
        given = [(name, value) for name, value in (("--grammar", self.grammar), ("--grammar-file", self.grammar_file),
                 ("--json-schema", self.json_schema), ("--json-schema-file", self.json_schema_file)) if value is not None]
        if len(given) > 1:
            raise UsageError(f"{given[0][0]} and {given[1][0]} both constrain the output; give one of them")
        if self.compact_json and not (self.json_schema or self.json_schema_file):
            raise UsageError("--compact-json shapes JSON output: it goes with --json-schema or --json-schema-file")
        if not given:
            return None
        name, value = given[0]
        if name.endswith("-file"):
            value = _read_text_file(value, name)
        kind = "gbnf" if name.startswith("--grammar") else "json_schema"
        grammar = Grammar(kind, value, json_style="compact" if self.compact_json else "spaced", where=name)
        grammar.check()
        return grammar


def _read_text_file(path: str, option: str) -> str:
    """A grammar or schema file's text (bounded; UsageError naming the option)."""
    try:
        with open_regular(path) as handle:  # (a FIFO would block the open, a device be read for ever)
            data = read_limited(handle, f"{option} {path}")
    except FileNotFoundError:
        raise UsageError(f"{option}: no such file: {path}") from None
    except NotRegularFile as err:
        raise UsageError(f"{option}: {err}; give a file") from None
    except OSError as err:
        raise UsageError(f"{option}: cannot read {path}: {err.strerror}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"{option}: {path} is not UTF-8 text") from None


Stop = Annotated[Optional[list[str]], typer.Option("--stop", metavar="TEXT", help="End the output where this text appears (repeatable); the text itself is not output.")]


def stop_strings(stop: Optional[list[str]]) -> tuple[str, ...]:
    """--stop's values, checked before any model loads (an empty one is refused)."""
    return check_stop(stop or ())


def max_tokens_option(help: str, default: int = DEFAULT_MAX_TOKENS) -> Any:
    """-n/--n-predict/--max-tokens (llama.cpp's -n: tokens to generate), with what it means for
    the command (per reply, per item, per run)."""
    return typer.Option(default, "-n", "--n-predict", "--max-tokens", min=1, help=help)


def flatten(command: Callable[..., Any]) -> Callable[..., Any]:
    """Let `command` take option groups: a parameter annotated with a group (a dataclass above)
    is, for Typer, that group's fields in its place; the command is called with one object of
    the group. The parameter's default, when given, is a group instance holding the command's
    own defaults (bench: Sampling(temperature=0.0))."""
    hints = typing.get_type_hints(command, include_extras=True)
    keyword = inspect.Parameter.KEYWORD_ONLY  # Typer passes every option by name
    flat: list[inspect.Parameter] = []
    groups: dict[str, type] = {}
    for param in inspect.signature(command).parameters.values():
        kind = hints.get(param.name, param.annotation)
        if not (isinstance(kind, type) and dataclasses.is_dataclass(kind)):
            flat.append(param.replace(kind=keyword, annotation=kind))
            continue
        defaults = kind() if param.default is param.empty else param.default
        fields = typing.get_type_hints(kind, include_extras=True)
        for f in dataclasses.fields(kind):
            flat.append(inspect.Parameter(f.name, keyword, annotation=fields[f.name], default=getattr(defaults, f.name)))
        groups[param.name] = kind

    def flattened(**options: Any) -> Any:
        for name, kind in groups.items():
            options[name] = kind(**{f.name: options.pop(f.name) for f in dataclasses.fields(kind)})
        return command(**options)

    functools.update_wrapper(flattened, command, assigned=("__module__", "__name__", "__qualname__", "__doc__"), updated=())
    flattened.__signature__ = inspect.Signature(flat, return_annotation=hints.get("return", inspect.Signature.empty))  # type: ignore[attr-defined]
    flattened.__annotations__ = {p.name: p.annotation for p in flat}
    return flattened


# --- what the options become ---------------------------------------------------------------------
def check_parallel(parallel: int, ctx: int, branches: int = 1) -> None:
    """UsageError unless 1 <= --parallel <= MAX_PARALLEL and the P contexts of -c tokens fit in
    one llama.cpp context (at most MAX_CTX tokens: the P sequences share one KV cache), and
    --branches (tree passes: one sequence at a time) is 1 with P > 1: batch's and serve's
    --parallel."""
    if parallel > 1 and branches > 1:
        raise UsageError(f"--branches {branches} verifies one sequence at a time: use --parallel 1, or --branches 1 with --parallel {parallel}")
    if not 1 <= parallel <= MAX_PARALLEL:
        raise UsageError(f"--parallel must be from 1 to {MAX_PARALLEL} (llama.cpp's most sequences in one context), got {parallel}")
    if parallel > 1 and parallel * ctx > MAX_CTX:
        raise UsageError(
            f"--parallel {parallel} with -c {ctx} needs a KV cache of {parallel * ctx:,} tokens, over the maximum of "
            f"{MAX_CTX:,}; use a smaller -c or --parallel"
        )


def check_threads(threads: int | None) -> None:
    """UsageError when --threads is more than MAX_THREADS_PER_CPU per CPU (Typer refuses < 1)."""
    cpus = os.cpu_count()
    if threads is not None and cpus and threads > MAX_THREADS_PER_CPU * cpus:
        raise UsageError(
            f"--threads {threads} is more than {MAX_THREADS_PER_CPU} per CPU of this machine ({cpus} CPUs); "
            f"use at most {MAX_THREADS_PER_CPU * cpus}, or leave it out for one per physical core"
        )


def model_choice(
    models: Models, placement: Placement, sampling: Sampling, *, threads: int | None, seed: int | None,
    drafting: Drafting | None = None, memory: str = MEMORY_OFF,
) -> ModelChoice:
    """Check the shared options (before any model loads) and bundle them for the core
    (memory: --memory, where the command has it)."""
    drafting = drafting or Drafting()
    check_threads(threads)
    placement.check()
    return ModelChoice(
        models.model, models.draft, models.lookup, drafting.target_only, drafting.draft_length,
        placement.n_ctx, placement.ngl, placement.draft_ngl, threads, sampling.params(seed),
        rpc=placement.rpc_endpoints(), tensor_split=placement.split(), draft_rpc=placement.draft_rpc, rpc_timeout=placement.rpc_timeout,
        memory=memory, branches=drafting.branches,
    )


def load_models(the_plan: Plan, choice: ModelChoice, *, quiet: bool, verbose: bool = False) -> Loaded:
    """Load the plan's models, with a spinner on a terminal; say so when saved measurements
    were ignored (--verbose: why)."""
    from specli.cli.render import stderr_console

    if not quiet:  # what the headers told before loading (training context, a larger draft)
        for warning in the_plan.warnings:
            print(warning, file=sys.stderr)
    if quiet or not sys.stderr.isatty():
        loaded = load(the_plan, choice)
    else:
        names = the_plan.target_path.name + (f" and {the_plan.draft_path.name}" if the_plan.draft_path else "")
        with stderr_console().status(f"loading {names}"):
            loaded = load(the_plan, choice)
    if loaded.memory_file is not None and loaded.memory_file.notice and not quiet:
        print(loaded.memory_file.notice, file=sys.stderr)
    if loaded.policy_notice and not quiet:
        print(loaded.policy_notice + (f": {loaded.policy_problem}" if verbose else ""), file=sys.stderr)
    return loaded
