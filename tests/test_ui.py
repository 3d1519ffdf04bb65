"""The live status line (ui.LiveStatus) on a fake terminal and a fake clock."""

from __future__ import annotations

import io

from rich.text import Text

from specli.cli import render as ui


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_live_status_builds_its_line_only_when_it_redraws_it(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(ui.time, "monotonic", lambda: clock[0])
    err = FakeTerminal()
    status = ui.LiveStatus(err, io.StringIO(), enabled=True, fps=8.0)  # stdout elsewhere: not shared
    built = []

    def line() -> Text:
        built.append(clock[0])
        return Text(f"{len(built)} tokens")

    for _ in range(40):  # 40 steps within one eighth of a second: one line built, redrawn 40 times
        status.clear()
        status.show(line)
        clock[0] += 0.001
    assert built == [100.0]
    assert err.getvalue().count("1 tokens") == 40
    clock[0] += 0.2  # later: built afresh
    status.clear()
    status.show(line)
    assert len(built) == 2 and err.getvalue().endswith("2 tokens")
