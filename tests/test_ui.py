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


# --- the summary and the live line's wording --------------------------------------------------------
def big_stats():
    from specli.decoding.stats import Stats

    return Stats(n_tokens=1234567, decided=1234567, drafted=9876543, accepted=8765432, target_passes=123456, prompt_tokens=123456,
                 prompt_s=12345.67, draft_s=12345.67, verify_s=123456.78, generation_s=123456.78)


def test_the_summary_fits_the_terminal_and_breaks_only_between_words():
    stats = big_stats()
    wide = ui.summary_line(stats, stop_reason="max_tokens", with_drafting=True, width=10_000)
    assert "\n" not in wide and "verify" in wide  # a terminal wide enough: everything, on one line
    for width in (None, 100, 80, 60):  # None: not a terminal (SUMMARY_WIDTH, 100)
        text = ui.summary_line(stats, stop_reason="max_tokens", with_drafting=True, verbose=True, width=width)
        assert all(len(line) <= (width or ui.SUMMARY_WIDTH) for line in text.splitlines()), text
        words = lambda t: [w for w in t.split() if w != "·"]  # noqa: E731
        assert words(text) == words(wide), text  # the same words: lines break between them only
        assert "·\n" not in text and "\n·" not in text, text  # and between segments, not inside them
    # The essentials first, in order; the details only with --verbose or room for them.
    brief = ui.summary_line(stats, stop_reason="max_tokens", with_drafting=True)
    keys = ["1234567 tokens in 123456.78s", "10.0 tok/s", "accepted 89%", "10.00 tok/pass", "stop: max_tokens"]
    assert [brief.index(k) for k in keys] == sorted(brief.index(k) for k in keys), brief
    assert brief.startswith(keys[0]) and "verify" not in brief and "prompt" not in brief
    verbose = ui.summary_line(stats, stop_reason="max_tokens", with_drafting=True, verbose=True)
    assert "8765432 of 9876543 drafts accepted" in verbose and "verify 123456.78s" in verbose


def test_no_number_reads_as_a_count_of_drafted_tokens():
    from specli.decoding.stats import Stats

    stats = Stats(n_tokens=6, decided=6, drafted=1, accepted=1, target_passes=2, generation_s=0.5)  # 0.5 drafts per pass
    live = ui.status_text(stats, with_drafting=True).plain
    summary = ui.summary_line(stats, stop_reason="eos", with_drafting=True, verbose=True, width=80)
    for text in (live, summary, " · ".join(stats.drafting_summary())):
        assert "drafted →" not in text and "0.5 drafted" not in text, text
        assert "drafted/pass 0.5" in text, text
    assert "tok/pass 3.00" in live and "3.00 tok/pass" in summary
