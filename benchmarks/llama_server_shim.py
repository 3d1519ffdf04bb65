#!/usr/bin/env python3
"""Stand-in for the llama-server binary that llama.cpp's own server tests start
(tools/server/tests/utils.py runs $LLAMA_SERVER_BIN_PATH with llama-server's flags): it runs
either the native llama-server or `specli serve` on local models, so that the same test suite
runs against both (benchmarks/llama_server_suite.sh).

Environment:
  SHIM_BACKEND   native | specli
  SHIM_MODEL     the local GGUF that replaces every --hf-repo/--hf-file/--model the tests ask for
                 (no model hub here); SHIM_DRAFT the draft model for --model-draft
  SHIM_NATIVE    the llama-server binary (native backend)
  SHIM_PYTHON    the Python that runs specli (default: this one)

The process execs the server (same pid), so the tests' stop() reaches it.
"""

from __future__ import annotations

import os
import sys

# llama-server flags that take a value and that the specli side drops (no equivalent, or an
# effect that does not apply: llama-server's batch sizes, its web UI, hub options)
VALUE_FLAGS = {
    "--temp", "--seed", "--host", "--port", "--model", "-m", "--hf-repo", "-hfr", "--hf-file", "-hff", "--model-url", "--model-draft", "-md",
    "--ctx-size", "-c", "--parallel", "-np", "--alias", "-a", "--api-key", "--n-predict", "-n", "--threads", "-t", "--batch-size", "-b",
    "--ubatch-size", "-ub", "--n-gpu-layers", "-ngl", "--pooling", "--tags", "-ctk", "-ctv", "-fa", "--slot-save-path", "--grp-attn-n",
    "--grp-attn-w", "--lora", "--spec-type", "--spec-draft-n-max", "--spec-draft-n-min", "--spec-synth-len", "--spec-synth-rates",
    "--reasoning-format", "--reasoning", "--chat-template", "--chat-template-file", "--mmproj-url", "--media-path", "--sleep-idle-seconds",
    "--cache-ram", "--tools", "--tools-runtime", "--mcp-servers-config", "--mcp-servers-json", "--cors-origins", "--models-dir",
    "--models-max", "--models-preset", "--draft-max", "--draft-min", "--cache-reuse",
}


def parse(argv: list[str]) -> tuple[dict[str, str], set[str]]:
    values, switches = {}, set()
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in VALUE_FLAGS and i + 1 < len(argv):
            values[arg] = argv[i + 1]
            i += 2
        else:
            switches.add(arg)
            i += 1
    return values, switches


def first(values: dict[str, str], *names: str) -> str | None:
    return next((values[n] for n in names if n in values), None)


def native(argv: list[str]) -> list[str]:
    """llama-server's own flags, the hub model replaced by the local one."""
    out, i = [os.environ["SHIM_NATIVE"]], 0
    model = os.environ["SHIM_MODEL"]
    out += ["--model", model]
    while i < len(argv):
        arg = argv[i]
        if arg in ("--hf-repo", "-hfr", "--hf-file", "-hff", "--model", "-m", "--model-url"):
            i += 2
            continue
        if arg in ("--model-draft", "-md"):
            out += [arg, os.environ.get("SHIM_DRAFT", model)]
            i += 2
            continue
        out.append(arg)
        i += 1
    return out


def specli(argv: list[str]) -> list[str]:
    values, switches = parse(argv)
    python = os.environ.get("SHIM_PYTHON", sys.executable)
    n_slots = int(first(values, "--parallel", "-np") or 4)  # (llama-server's default: 4 slots)
    out = [python, "-m", "specli", "serve", "-m", os.environ["SHIM_MODEL"], "--port", values["--port"], "--host", values.get("--host", "127.0.0.1"),
           "--parallel", str(n_slots)]
    draft = first(values, "--model-draft", "-md")
    if draft is not None or values.get("--spec-type", "").startswith("draft"):
        out += ["-md", os.environ.get("SHIM_DRAFT", os.environ["SHIM_MODEL"])]
    elif values.get("--spec-type", "").startswith("ngram"):
        out += ["--lookup"]
    else:
        out += ["--lookup"]  # (specli's drafting: what is measured against llama-server's plain decoding)
    n_max = first(values, "--spec-draft-n-max", "--draft-max")
    if n_max is not None:
        out += ["--draft-max", n_max]
    ctx = first(values, "--ctx-size", "-c")
    # llama-server's -c is the whole cache, split among its slots; specli's is each request's
    per_slot = max(256, int(ctx) // n_slots) if ctx is not None and int(ctx) > 0 else 4096
    out += ["-c", str(per_slot)]
    mapping = {"--temp": "--temperature", "--seed": "--seed", "--alias": "--alias", "-a": "--alias", "--api-key": "--api-key",
               "--threads": "--threads", "-t": "--threads", "--cors-origins": "--cors-origins", "--cache-reuse": "--cache-reuse", "--tags": "--tags"}
    for flag, ours in mapping.items():
        if flag in values:
            out += [ours, values[flag]]
    n_predict = first(values, "--n-predict", "-n")
    if n_predict is not None and int(n_predict) > 0:
        out += ["-n", n_predict]
    if "--chat-template" in values:
        out += ["--template", values["--chat-template"]]
    if "--chat-template-file" in values:
        out += ["--chat-template-file", values["--chat-template-file"]]
    if values.get("--reasoning") in ("on", "off", "auto"):
        out += ["--reasoning", values["--reasoning"]]
    for switch in ("--metrics", "--slots", "--verbose"):
        if switch in switches:
            out.append(switch)
    return out


def main() -> None:
    argv = sys.argv[1:]
    command = native(argv) if os.environ.get("SHIM_BACKEND") == "native" else specli(argv)
    print("shim:", " ".join(command), file=sys.stderr, flush=True)
    os.execv(command[0], command)


if __name__ == "__main__":
    main()
