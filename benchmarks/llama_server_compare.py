#!/usr/bin/env python3
"""Which of llama.cpp's server tests each backend passed (llama_server_suite.sh's JUnit files):
the tests llama-server passes, how many of them specli passes, and each one it fails with the
first line of its failure."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def outcomes(path: Path) -> dict[str, tuple[bool, str]]:
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped") is not None
        if skipped:
            continue
        message = "" if problem is None else (problem.get("message") or "").splitlines()[0][:160] if problem.get("message") else ""
        out[name] = (problem is None, message)
    return out


def main() -> None:
    out = Path(sys.argv[1])
    total_native = total_both = 0
    rows = []
    for native_file in sorted(out.glob("native-*.xml")):
        name = native_file.stem.removeprefix("native-")
        specli_file = out / f"specli-{name}.xml"
        native = outcomes(native_file)
        ours = outcomes(specli_file) if specli_file.exists() else {}
        passed = [t for t, (ok, _) in native.items() if ok]
        both = [t for t in passed if ours.get(t, (False, ""))[0]]
        extra = [t for t, (ok, _) in ours.items() if ok and not native.get(t, (False, ""))[0]]
        total_native += len(passed)
        total_both += len(both)
        rows.append((name, len(native), len(passed), len(both), len(extra)))
        for t in passed:
            if t not in both:
                print(f"  specli fails {t}: {ours.get(t, (False, 'not run'))[1]}")
    print("| file | tests | llama-server passes | specli passes of those | specli passes, llama-server fails |")
    print("| --- | --- | --- | --- | --- |")
    for name, n, p, b, e in rows:
        print(f"| {name} | {n} | {p} | {b} | {e} |")
    print(f"| all | | {total_native} | {total_both} | |")


if __name__ == "__main__":
    main()
