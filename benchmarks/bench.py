#!/usr/bin/env python3
"""specli's benchmarks: one command, one entry point per question. `python benchmarks/bench.py -h`
lists them; benchmarks/README.md says what each answers and how long it takes."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import completion, drafting, host, memory, rpc, serve, structured, synthetic  # noqa: E402

ENTRY_POINTS = {"drafting": drafting, "completion": completion, "serve": serve, "memory": memory, "host": host, "rpc": rpc, "structured": structured, "pairs": synthetic}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="entry", required=True, metavar="ENTRY")
    for name, module in ENTRY_POINTS.items():
        module.add_arguments(sub.add_parser(name, help=module.__doc__.split("\n")[0], description=module.__doc__,
                                            formatter_class=argparse.RawDescriptionHelpFormatter))
    args = ap.parse_args(argv)
    return ENTRY_POINTS[args.entry].main(args) or 0


if __name__ == "__main__":
    sys.exit(main())
