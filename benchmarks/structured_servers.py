#!/usr/bin/env python3
"""Wall clock of schema-constrained extraction through servers: the schema workloads of
workloads/structured.jsonl sent as chat completions with response_format json_schema, greedy, to
each server given (specli serve, llama-server --jinja, with or without draft models), one
request at a time. Printed side by side: decoding tokens per second (the servers' own
`timings.predicted_per_second`, geometric mean over the workloads, with its min and max),
request wall seconds, and whether every reply validates against its schema.

    python benchmarks/structured_servers.py NAME=http://127.0.0.1:8080 NAME2=http://127.0.0.1:8081 [--rounds 2]

Run it on a quiet machine; runs differ by 30% here (NOTES.md), so compare only figures
measured in the same minutes.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import urllib.request
from pathlib import Path

WORKLOADS = Path(__file__).parent / "workloads" / "structured.jsonl"


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def valid(value, schema: dict) -> bool:
    try:
        import jsonschema
    except ImportError:  # (the suite's check is stricter; here: it parses, and has the required keys)
        return isinstance(value, dict) and all(k in value for k in schema.get("required", []))
    try:
        jsonschema.validate(value, schema)
        return True
    except jsonschema.ValidationError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("servers", nargs="+", help="NAME=BASE_URL")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args()
    workloads = [json.loads(line) for line in WORKLOADS.read_text().splitlines() if line.strip()]
    workloads = [w for w in workloads if "schema" in w]
    print(f"{len(workloads)} schema workloads x {args.rounds} round(s), greedy, max_tokens {args.max_tokens}")
    print("| server | decode tok/s (geo mean) | min | max | wall s per request | tokens | valid |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for spec in args.servers:
        name, _, base = spec.partition("=")
        speeds, walls, tokens, ok = [], [], 0, 0
        for _ in range(args.rounds):
            for w in workloads:
                body = {"messages": [{"role": "user", "content": w["prompt"]}], "temperature": 0, "max_tokens": args.max_tokens,
                        "response_format": {"type": "json_schema", "json_schema": {"name": w["id"], "schema": w["schema"], "strict": True}}}
                t0 = time.perf_counter()
                reply = post(f"{base}/v1/chat/completions", body)
                walls.append(time.perf_counter() - t0)
                speeds.append(reply["timings"]["predicted_per_second"])
                tokens += reply["usage"]["completion_tokens"]
                try:
                    ok += valid(json.loads(reply["choices"][0]["message"]["content"]), w["schema"])
                except json.JSONDecodeError:
                    pass
        geo = math.exp(sum(math.log(s) for s in speeds) / len(speeds))
        print(f"| {name} | {geo:.1f} | {min(speeds):.1f} | {max(speeds):.1f} | {sum(walls) / len(walls):.2f} | {tokens} | {ok}/{len(speeds)} |")


if __name__ == "__main__":
    main()
