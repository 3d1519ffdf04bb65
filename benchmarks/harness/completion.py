"""Code completion as an editor asks for it: holes cut out of real source files, filled through
POST /infill by `specli serve` and by llama.cpp's `llama-server` on the same model (Qwen2.5-Coder
1.5B, its 0.5B as draft model). Does drafting pay on completions, and is the text unchanged?

Holes: spans of 1-5 whole lines at seeded random positions in source files nobody wrote for this
benchmark: Python from the installed starlette, click and jinja2, C++ and C from the llama.cpp
source (src/, ggml/src/). Every third hole is held out (`split == "check"`): tune on "dev".

Requests, as llama.vscode sends them (llama-server README, /infill): `input_prefix` the last
--prefix-lines lines before the hole, `prompt` the hole's first line's indentation (the cursor
after it), `input_suffix` the first --suffix-lines lines after it, `input_extra` a --chunk-lines
chunk of each of two other files of the same project (fixed per project, as an editor's ring of
recent chunks is: consecutive requests share it), `n_indent`, `n_predict`, `cache_prompt: true`.
Unlike llama.vscode: temperature 0 with llama-server's default sampler chain (greedy; its
top_k/top_p/infill chain samples), and no t_max_* time limits (they would cut texts by the clock).

Configurations, each its own fresh server with one slot and -c 4096, all up at once; each hole
goes to each in turn, the order rotating (so load that drifts during the run slows all alike;
--sequential: one server after the other), and every server sees the holes in the same order:
  specli serve: --target-only; lookup (the default, --draft-max auto); --memory process; -md
  llama-server: plain; --spec-type ngram-mod; --spec-type ngram-simple; -md --spec-type draft-simple
                (its defaults otherwise: --spec-draft-n-max 3 for -md)

Figures per configuration (from each response's `timings`, and specli's `speculative`): tokens
per target pass (specli: its target_passes; llama-server: generated - accepted drafts), time to
first token (the server's prompt_ms: the
first token comes from the prompt's last pass), generation tokens per second (predicted_n /
predicted_ms, summed), wall time, and how many completions equal the target-only one of the
same server (and, for specli's, llama-server's plain one).

--cache-reuse N, instead of the holes: an editor's moving window (`windows`) through specli serve
--lookup and llama-server, each with --cache-reuse 0 and N: time to first token, tokens reused.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import random
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from harness import models, native
from harness.common import DEFAULT_OUT, ROOT, log, table, write_json

C_SOURCE = Path("/tmp/specli-native/src/vendor/llama.cpp")  # benchmarks/build_native.sh unpacks it here
CHECK_EVERY = 3  # every third hole is held out


@dataclass(frozen=True)
class Project:
    name: str
    language: str
    root: Path
    files: tuple[Path, ...]


@dataclass
class Hole:
    id: str
    project: str
    language: str
    split: str  # "dev" or "check"
    path: str  # relative to the project's root
    line: int  # the hole's first line (1-based)
    n_lines: int
    indent: str  # the hole's first line's indentation: `prompt`, typed before the cursor
    expected: str  # what the hole held after the indentation
    prefix: str
    suffix: str
    extra: list  # [{"filename", "text"}]


def _python_package(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    return Path(spec.origin).parent if spec and spec.origin else None


def projects(c_source: Path = C_SOURCE) -> list[Project]:
    """Three Python packages installed here and llama.cpp's C++ and ggml's C; those missing are
    left out (the run says which)."""
    found = []
    for name in ("starlette", "click", "jinja2"):
        root = _python_package(name)
        if root is not None:
            found.append(Project(name, "python", root, tuple(sorted(root.rglob("*.py")))))
    for name, language, sub, pattern in (("llama.cpp", "c++", "src", "*.cpp"), ("ggml", "c", "ggml/src", "*.c")):
        root = c_source / sub
        if root.is_dir():
            found.append(Project(name, language, root, tuple(sorted(root.rglob(pattern)))))
    return found


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)


def _usable(path: Path, min_lines: int) -> bool:
    try:
        return min_lines <= len(_lines(path)) <= 20000
    except OSError:
        return False


def cut_holes(found: list[Project], n_holes: int, *, seed: int = 0, prefix_lines: int = 32, suffix_lines: int = 8,
              chunk_lines: int = 16) -> list[Hole]:
    """n_holes holes, spread evenly over the projects, grouped by project (an editing session per
    project: its two extra files stay the same), each a span of 1-5 lines whose first line holds
    code. Seeded: the same arguments cut the same holes."""
    rng = random.Random(seed)
    holes: list[Hole] = []
    per = [n_holes // len(found) + (k < n_holes % len(found)) for k in range(len(found))]
    for project, count in zip(found, per):
        files = [f for f in project.files if _usable(f, 40)]
        if len(files) < 3:
            log(f"{project.name}: fewer than 3 files of 40 lines or more; left out")
            continue
        extra_files = rng.sample(files, 2)
        extra = []
        for f in extra_files:
            lines = _lines(f)
            at = rng.randrange(0, max(1, len(lines) - chunk_lines))
            extra.append({"filename": str(f.relative_to(project.root)), "text": "".join(lines[at : at + chunk_lines])})
        candidates = [f for f in files if f not in extra_files]
        for _ in range(count):
            for _attempt in range(1000):
                f = rng.choice(candidates)
                lines = _lines(f)
                n = rng.randint(1, 5)
                start = rng.randrange(8, len(lines) - n - 4)
                first = lines[start]
                if first.strip() and len(first.strip()) > 2 and "".join(lines[start : start + n]).strip():
                    break
            else:
                raise RuntimeError(f"{project.name}: no hole found")
            indent = first[: len(first) - len(first.lstrip(" \t"))]
            k = len(holes)
            holes.append(Hole(
                id=f"{project.name}-{k}", project=project.name, language=project.language,
                split="check" if k % CHECK_EVERY == CHECK_EVERY - 1 else "dev",
                path=str(f.relative_to(project.root)), line=start + 1, n_lines=n, indent=indent,
                expected="".join(lines[start : start + n])[len(indent):],
                prefix="".join(lines[max(0, start - prefix_lines) : start]),
                suffix="".join(lines[start + n : start + n + suffix_lines]), extra=extra,
            ))
    return holes


def infill_body(hole: Hole, n_predict: int) -> dict:
    """The request llama.vscode sends for this cursor position (module docstring)."""
    return {
        "input_prefix": hole.prefix, "input_suffix": hole.suffix, "input_extra": hole.extra, "prompt": hole.indent,
        "n_indent": len(hole.indent.expandtabs(4)), "n_predict": n_predict, "temperature": 0, "top_k": 40, "top_p": 0.99,
        "stream": False, "cache_prompt": True,
    }


# --- configurations ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    name: str
    side: str  # "specli" or "llama-server"
    args: tuple[str, ...]
    baseline: str  # the configuration whose texts this one's must equal


def configs(pair: models.Pair, native_draft_max: int | None) -> list[Config]:
    draft = str(pair.draft)
    n_max = ("--spec-draft-n-max", str(native_draft_max)) if native_draft_max else ()
    return [
        Config("specli target-only", "specli", ("--target-only",), "specli target-only"),
        Config("specli lookup auto", "specli", (), "specli target-only"),
        Config("specli --memory process", "specli", ("--memory", "process"), "specli target-only"),
        Config("specli -md", "specli", ("-md", draft), "specli target-only"),
        Config("llama-server plain", "llama-server", (), "llama-server plain"),
        Config("llama-server ngram-mod", "llama-server", ("--spec-type", "ngram-mod"), "llama-server plain"),
        Config("llama-server ngram-simple", "llama-server", ("--spec-type", "ngram-simple"), "llama-server plain"),
        Config("llama-server -md", "llama-server", ("-md", draft, "--spec-type", "draft-simple", *n_max), "llama-server plain"),
    ]


# Each specli configuration beside the llama-server one it is compared with.
PAIRS = [
    ("plain", "specli target-only", "llama-server plain"),
    ("n-gram", "specli lookup auto", "llama-server ngram-simple"),
    ("n-gram, memory", "specli --memory process", "llama-server ngram-mod"),
    ("draft model", "specli -md", "llama-server -md"),
]


def _command(config: Config, pair: models.Pair, args) -> list[str]:
    if config.side == "specli":
        return native.specli_serve_cmd(pair.target, *config.args, threads=args.threads, ctx=args.ctx)
    return native.llama_server_cmd(pair.target, *config.args, threads=args.threads, ctx=args.ctx, native_bin=Path(args.native_bin))


def ask(server: native.Server, hole: Hole, n_predict: int) -> dict:
    """One hole through `server`: its record."""
    data, wall = native.timed(lambda: server.post("/infill", infill_body(hole, n_predict)))
    t = data.get("timings") or {}
    return {
        "hole": hole.id, "split": hole.split, "text": data.get("content", ""), "n_tokens": int(t.get("predicted_n") or 0),
        "drafted": int(t.get("draft_n") or 0), "accepted": int(t.get("draft_n_accepted") or 0),
        "prompt_n": int(t.get("prompt_n") or 0), "cache_n": int(t.get("cache_n") or 0),
        "prompt_ms": float(t.get("prompt_ms") or 0.0), "predicted_ms": float(t.get("predicted_ms") or 0.0),
        "wall_s": wall, "speculative": data.get("speculative"),
    }


def run_config(config: Config, pair: models.Pair, holes: list[Hole], args, work: Path) -> list[dict]:
    """Every hole through one fresh server (--sequential): one record per hole."""
    with native.serving(_command(config, pair, args), config.name, work) as server:
        return [ask(server, hole, args.n_predict) for hole in holes]


def run_interleaved(conf: list[Config], pair: models.Pair, holes: list[Hole], args, work: Path) -> dict[str, list[dict]]:
    """Every configuration's server up at once, each hole sent to each in turn (the order
    rotating from hole to hole): a machine whose load drifts during the run slows every
    configuration alike. Each server still sees the holes in order, as it would alone. A
    configuration that fails to start or to answer is left out, with one line."""
    records: dict[str, list[dict]] = {}
    servers: dict[str, native.Server] = {}
    with contextlib.ExitStack() as stack:
        for config in conf:
            try:
                servers[config.name] = stack.enter_context(native.serving(_command(config, pair, args), config.name, work))
                records[config.name] = []
            except native.ServerError as err:
                log(f"{config.name}: left out: {err}")
        t0 = time.perf_counter()
        for i, hole in enumerate(holes):
            names = list(servers)
            for name in names[i % max(1, len(names)):] + names[: i % max(1, len(names))]:
                try:
                    records[name].append(ask(servers[name], hole, args.n_predict))
                except native.ServerError as err:
                    log(f"{name}: left out: {err}")
                    servers.pop(name).stop()
                    records.pop(name)
            log(f"hole {i + 1}/{len(holes)} ({hole.id}) done, {time.perf_counter() - t0:.0f} s")
    return records


# --- figures -----------------------------------------------------------------------------------
def figures(records: list[dict], baseline: list[dict] | None, other: list[dict] | None = None) -> dict:
    n = sum(r["n_tokens"] for r in records)
    accepted = sum(r["accepted"] for r in records)
    drafted = sum(r["drafted"] for r in records)
    gen_s = sum(r["predicted_ms"] for r in records) / 1000
    # Target passes: specli counts them (its `speculative` stats); llama-server's are one per
    # generated token not accepted from a draft (the first comes from the prompt's last pass).
    passes = sum((r["speculative"] or {}).get("target_passes", r["n_tokens"] - r["accepted"]) for r in records)
    out = {
        "holes": len(records), "tokens": n, "drafted": drafted, "accepted": accepted, "target_passes": passes,
        "tokens_per_pass": n / passes if passes else float("nan"),
        "acceptance": accepted / drafted if drafted else None,
        "ttft_ms_median": statistics.median(r["prompt_ms"] for r in records) if records else float("nan"),
        "tokens_per_s": n / gen_s if gen_s > 0 else float("nan"),
        "wall_s": sum(r["wall_s"] for r in records),
    }
    if baseline is not None:
        same = {r["hole"]: r["text"] for r in baseline}
        out["equal_to_target_only"] = sum(r["text"] == same.get(r["hole"]) for r in records)
    if other is not None:
        same = {r["hole"]: r["text"] for r in other}
        out["equal_to_llama_server_plain"] = sum(r["text"] == same.get(r["hole"]) for r in records)
    return out


def _cell(value, fmt: str) -> str:
    if value is None or value != value:  # None or NaN
        return "-"
    return format(value, fmt)


def report(results: dict[str, list[dict]], conf: list[Config], split: str) -> dict:
    """The tables for one split ("all", "dev", "check"); their figures, for the JSON."""
    chosen = {name: [r for r in recs if split == "all" or r["split"] == split] for name, recs in results.items()}
    by_name = {c.name: c for c in conf}
    figs = {}
    for name, recs in chosen.items():
        base = chosen.get(by_name[name].baseline)
        other = chosen.get("llama-server plain") if by_name[name].side == "specli" else None
        figs[name] = figures(recs, base, other)
    n_holes = max((f["holes"] for f in figs.values()), default=0)
    rows = []
    for name, f in figs.items():
        equal = f"{f['equal_to_target_only']}/{f['holes']}" if "equal_to_target_only" in f else "-"
        if "equal_to_llama_server_plain" in f:
            equal += f" ({f['equal_to_llama_server_plain']} = llama-server's)"
        rows.append([name, _cell(f["tokens_per_pass"], ".2f"), _cell(f["acceptance"], ".0%"), _cell(f["ttft_ms_median"], ".0f"),
                     _cell(f["tokens_per_s"], ".1f"), _cell(f["wall_s"], ".1f"), equal])
    table(["configuration", "tokens/pass", "accepted", "TTFT ms (median)", "tok/s", "wall s", "= target-only"], rows,
          title=f"/infill, {split} holes ({n_holes}):")
    paired = []
    for what, mine, theirs in PAIRS:
        if mine in figs and theirs in figs:
            a, b = figs[mine], figs[theirs]
            paired.append([what, f"{_cell(a['tokens_per_pass'], '.2f')} / {_cell(b['tokens_per_pass'], '.2f')}",
                           f"{_cell(a['ttft_ms_median'], '.0f')} / {_cell(b['ttft_ms_median'], '.0f')}",
                           f"{_cell(a['tokens_per_s'], '.1f')} / {_cell(b['tokens_per_s'], '.1f')}",
                           _cell(a["tokens_per_s"] / b["tokens_per_s"] if b["tokens_per_s"] else None, ".2f")])
    if paired:
        table(["drafting", "tokens/pass specli / llama-server", "TTFT ms", "tok/s", "tok/s specli ÷ llama-server"], paired,
              title=f"paired, {split} holes:")
    return figs


# --- --cache-reuse: an editor's moving window -------------------------------------------------
def windows(line: int, path: str = "src/specli/decoding/drafters.py", extra: str = "src/specli/decoding/text.py") -> list[Hole]:
    """llama.vscode's requests as its cursor moves in `path` (as committed; 256 lines before the
    cursor, 64 after, a chunk of `extra`): at `line`, the same again, 3 lines down, then a line
    inserted above it. Moving down moves the window's start, so the common prefix with the
    slot's cache ends after the extra context: --cache-reuse moves the rest instead."""
    text, chunk = (subprocess.run(["git", "show", f"HEAD:{p}"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
                   for p in (path, extra))
    lines = text.splitlines(keepends=True)
    edited = lines[: line + 1] + ["        x = compute(x)  # an edit above the cursor\n"] + lines[line + 1 :]
    out = []
    for name, ls, at in (("cold", lines, line), ("same again", lines, line), ("3 lines down", lines, line + 3),
                         ("line inserted above", edited, line + 4)):
        col = len(ls[at]) - len(ls[at].lstrip())
        out.append(Hole(name, "specli", "python", "dev", path, at + 1, 1, ls[at][:col], "", "".join(ls[max(0, at - 256) : at]),
                        ls[at][col:] + "".join(ls[at + 1 : at + 64]), [{"filename": extra, "text": chunk}]))
    return out


def cache_reuse(pair: models.Pair, args, work: Path) -> dict:
    """Each window through specli serve --lookup and llama-server, each with --cache-reuse 0 and N:
    time to first token (the server's prompt_ms), tokens reused (cache_n) and evaluated (prompt_n)."""
    rows, records = [], {}
    for side in [s for s in ("specli", "llama-server") if args.only in ("both", s if s == "specli" else "native")]:
        for reuse in (0, args.cache_reuse):
            extra = ("--lookup",) if side == "specli" else ("--cache-ram", "0")
            config = Config(f"{side} --cache-reuse {reuse}", side, (*extra, "--cache-reuse", str(reuse)), "")
            with native.serving(_command(config, pair, args), config.name, work) as server:
                records[config.name] = [ask(server, hole, 16) for hole in windows(args.line)]
            rows += [[config.name, r["hole"], f"{r['prompt_ms']:.0f}", r["cache_n"], r["prompt_n"], f"{r['wall_s']:.2f}"] for r in records[config.name]]
    table(["server", "request", "TTFT ms (prompt_ms)", "cache_n", "prompt_n", "wall s"], rows,
          title=f"an editor's moving window, --cache-reuse 0 and {args.cache_reuse}")
    return records


# --- the entry point ---------------------------------------------------------------------------
def add_arguments(ap) -> None:
    ap.add_argument("--holes", type=int, default=30, help="holes cut (default 30; a third held out as the check split)")
    ap.add_argument("--seed", type=int, default=0, help="where the holes are cut")
    ap.add_argument("--n-predict", type=int, default=64, help="tokens to generate at most per hole (llama.vscode: 128)")
    ap.add_argument("--prefix-lines", type=int, default=32, help="lines before the hole sent (llama.vscode: 256)")
    ap.add_argument("--suffix-lines", type=int, default=8, help="lines after it (llama.vscode: 64)")
    ap.add_argument("--chunk-lines", type=int, default=16, help="lines of each of the two extra files (llama.vscode: 64)")
    ap.add_argument("--threads", type=int, default=2, help="threads per server (use 1 on a machine others share)")
    ap.add_argument("--ctx", type=int, default=4096, help="each server's -c (llama-server gives extra context n_ctx - 2048 tokens)")
    ap.add_argument("--only", choices=["both", "specli", "native"], default="both")
    ap.add_argument("--configs", help="only these configurations (comma list of names, e.g. 'llama-server plain,specli -md')")
    ap.add_argument("--native-draft-max", type=int, help="llama-server -md's --spec-draft-n-max (default: its own, 3)")
    ap.add_argument("--native-bin", default=str(native.NATIVE_BIN), help="llama-server's folder")
    ap.add_argument("--c-source", default=str(C_SOURCE), help="the llama.cpp source the C/C++ holes come from")
    ap.add_argument("--sequential", action="store_true", help="one server at a time, all holes each (default: all servers up, holes interleaved)")
    ap.add_argument("--list", action="store_true", help="print the holes and stop (no server)")
    ap.add_argument("--resume", action="store_true", help="keep the configurations a run with the same holes already saved")
    ap.add_argument("--cache-reuse", type=int, default=0, metavar="N",
                    help="instead of the holes: an editor's moving window with --cache-reuse 0 and N on both servers")
    ap.add_argument("--line", type=int, default=300, help="--cache-reuse: the cursor's first line (0-based)")
    ap.add_argument("--out", default=str(DEFAULT_OUT))


def main(args) -> int:
    pair = models.qwen()
    if args.cache_reuse:
        path = write_json(Path(args.out) / "completion" / "cache-reuse.json", cache_reuse(pair, args, Path(args.out) / "completion" / "logs"))
        log(f"results: {path}")
        return 0
    found = projects(Path(args.c_source))
    languages = {p.language for p in found}
    log(f"projects: {', '.join(f'{p.name} ({p.language}, {len(p.files)} files)' for p in found)}")
    if len(found) < 3 or len(languages) < 2:
        raise SystemExit(f"need three projects in two languages; found {[p.name for p in found]} (--c-source: the llama.cpp source)")
    holes = cut_holes(found, args.holes, seed=args.seed, prefix_lines=args.prefix_lines, suffix_lines=args.suffix_lines,
                      chunk_lines=args.chunk_lines)
    log(f"{len(holes)} holes: {sum(h.split == 'dev' for h in holes)} dev, {sum(h.split == 'check' for h in holes)} check")
    if args.list:
        for h in holes:
            print(f"{h.id:14} {h.split:5} {h.path}:{h.line} +{h.n_lines}  {h.indent!r} {h.expected[:60]!r}")
        return 0
    conf = configs(pair, args.native_draft_max)
    if args.only != "both":
        conf = [c for c in conf if c.side == ("specli" if args.only == "specli" else "llama-server")]
    if args.configs:
        wanted = [name.strip() for name in args.configs.split(",")]
        conf = [c for c in conf if c.name in wanted]
    out_dir = Path(args.out) / "completion"
    work = out_dir / "logs"
    results: dict[str, list[dict]] = {}
    path = out_dir / f"completion-{args.seed}.json"
    settings = {k: v for k, v in vars(args).items() if k != "func"}
    if args.resume and path.exists():
        before = json.loads(path.read_text(encoding="utf-8"))["results"]
        if before.get("holes") == [asdict(h) for h in holes]:
            results = {name: recs for name, recs in before["records"].items() if name in {c.name for c in conf}}
            log(f"resuming {path}: {', '.join(results) or 'nothing'} done already")
    t0 = time.perf_counter()
    todo = [c for c in conf if c.name not in results]
    if args.sequential:
        for config in todo:
            log(f"{config.name}: {len(holes)} holes ...")
            t1 = time.perf_counter()
            try:
                results[config.name] = run_config(config, pair, holes, args, work)
            except native.ServerError as err:
                log(f"{config.name}: {err}")
                continue
            log(f"{config.name}: done in {time.perf_counter() - t1:.0f} s")
            write_json(path, {"holes": [asdict(h) for h in holes], "records": results, "settings": settings, "partial": True})
    elif todo:
        log(f"{len(todo)} servers, each hole through each in turn ...")
        results.update(run_interleaved(todo, pair, holes, args, work))
    log(f"all configurations: {time.perf_counter() - t0:.0f} s")
    payload = {"holes": [asdict(h) for h in holes], "configs": [asdict(c) for c in conf], "records": results, "figures": {}}
    for split in ("all", "dev", "check"):
        payload["figures"][split] = report(results, conf, split)
    write_json(path, {**payload, "settings": settings, "wall_s": time.perf_counter() - t0})
    log(f"results: {path}")
    return 0
