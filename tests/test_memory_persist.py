"""`--memory persist`: a token memory per tokenizer kept between runs in the cache folder (session/
memory_store.py). A second run of the same text drafts from what the first one saved, with the
tokens of `--memory off`; the file is 0600; a damaged or foreign file is ignored with one line
and never written; concurrent saves keep every run's documents; `specli cache` lists the file
and `--clear` removes it; chat remembers each finished turn."""

from __future__ import annotations

import json
import multiprocessing
import stat
import threading
from pathlib import Path

import pytest

from fixtures.cli import GREEDY_ARGS, PROMPTS, read_records, specli, write_jsonl
from specli.decoding.memory import TokenMemory
from specli.decoding.memory_drafter import MEMORY
from specli.session import memory_store
from specli.session.memory_store import MemoryFile, memory_path

ARGS = ("--lookup", "--draft-max", "4", "--max-tokens", "24", "--json", *GREEDY_ARGS)


def run(target, cache, *extra, prompt=PROMPTS[0]):
    result = specli("run", prompt, "-m", str(target), *ARGS, *extra, env={"SPECLI_CACHE_DIR": str(cache)})
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    return result, json.loads(result.stdout)


def memory_file(cache):
    (path,) = cache.glob("memory-*.tmem")
    return path


def test_a_second_run_drafts_from_the_first_and_gives_the_same_tokens(tmp_path, pair_perturbed):
    target, cache = pair_perturbed[0], tmp_path / "cache"
    _, off = run(target, tmp_path / "unused", "--memory", "off")
    assert not (tmp_path / "unused").exists() or not list((tmp_path / "unused").glob("memory-*"))
    _, first = run(target, cache, "--memory", "persist")
    path = memory_file(cache)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert not list(cache.glob("*.lock")) and not list(cache.glob(".memory-*"))
    _, second = run(target, cache, "--memory", "persist")
    assert first["token_ids"] == second["token_ids"] == off["token_ids"]
    assert MEMORY not in first["stats"]["by_source"]
    assert second["stats"]["by_source"][MEMORY]["accepted"] > 0, second["stats"]
    saved = TokenMemory.from_bytes(path.read_bytes())
    assert saved.n_documents == 2 and saved.fingerprint.startswith(memory_store.FINGERPRINT_PREFIX)

    listed = specli("cache", "--json", env={"SPECLI_CACHE_DIR": str(cache)})
    assert listed.returncode == 0, listed.stderr
    (row,) = [r for r in json.loads(listed.stdout) if r.get("kind") == "token-memory"]
    assert row["file"] == str(path) and row["fingerprint"] == saved.fingerprint
    assert row["documents"] == 2 and row["tokens"] == saved.n_tokens and row["bytes"] == path.stat().st_size
    assert row["age_s"] >= 0
    text = specli("cache", env={"SPECLI_CACHE_DIR": str(cache)})
    assert "token memory" in text.stdout and saved.fingerprint in text.stdout
    cleared = specli("cache", "--clear", env={"SPECLI_CACHE_DIR": str(cache)})
    assert cleared.returncode == 0 and "1 token memory file" in cleared.stderr
    assert not list(cache.glob("memory-*"))


@pytest.mark.parametrize("damage", ["damaged", "foreign", "oversized"])
def test_a_bad_file_is_ignored_with_one_line_and_never_written(tmp_path, pair_perturbed, damage):
    target, cache = pair_perturbed[0], tmp_path / "cache"
    _, reference = run(target, cache, "--memory", "persist")
    path = memory_file(cache)
    if damage == "damaged":
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        data = bytes(data)
    elif damage == "foreign":
        other = TokenMemory("vocab-sha256:another-tokenizer")
        other.add([1, 2, 3, 4, 5])
        data = other.to_bytes()
    else:
        data = b"\0" * (memory_store.MAX_BYTES + 1)
    path.write_bytes(data)
    result, got = run(target, cache, "--memory", "persist")
    notices = [line for line in result.stderr.splitlines() if str(path) in line]
    assert len(notices) == 1 and "ignored" in notices[0], result.stderr
    assert got["token_ids"] == reference["token_ids"] and MEMORY not in got["stats"]["by_source"]
    assert path.read_bytes() == data  # not overwritten
    listed = json.loads(specli("cache", "--json", env={"SPECLI_CACHE_DIR": str(cache)}).stdout)
    assert [r for r in listed if r.get("kind") == "token-memory"][0]["ignored"]


def test_concurrent_saves_keep_every_document(tmp_path):
    fingerprint = "vocab-sha256:test"
    # Each opened before any saves: none of them has seen the others' documents.
    files = [MemoryFile.open(tmp_path, fingerprint, 100) for _ in range(6)]
    barrier = threading.Barrier(len(files))
    problems = []

    def save(i, f):
        barrier.wait()
        for j in range(3):
            problems.append(f.remember([i + 1, j + 1, 7, 8, 9, i + 1]))

    threads = [threading.Thread(target=save, args=(i, f)) for i, f in enumerate(files)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert problems == [None] * 18
    saved = memory_store.read_memory_file(memory_path(tmp_path, fingerprint), fingerprint)
    assert sorted(map(tuple, saved.documents())) == sorted((i + 1, j + 1, 7, 8, 9, i + 1) for i in range(6) for j in range(3))
    assert stat.S_IMODE(memory_path(tmp_path, fingerprint).stat().st_mode) == 0o600
    # A later run sees them all, and adds only its own.
    later = MemoryFile.open(tmp_path, fingerprint, 100)
    assert later.memory.n_documents == 18
    assert later.remember([5, 5, 5]) is None
    assert memory_store.read_memory_file(later.path, fingerprint).n_documents == 19


def _save_in_a_process(folder: str, fingerprint: str, i: int, opened) -> list:
    f = MemoryFile.open(Path(folder), fingerprint, 100)
    opened.wait(timeout=60)  # (every process has read the file before any saves)
    return [f.remember([i + 1, j + 1, 7, 8, 9, i + 1]) for j in range(3)]


def test_concurrent_saves_from_separate_processes_keep_every_document(tmp_path):
    # The lock is between processes (runs and servers), not only threads.
    fingerprint = "vocab-sha256:test"
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager:
        opened = manager.Barrier(4)
        with ctx.Pool(4) as pool:
            pending = [pool.apply_async(_save_in_a_process, (str(tmp_path), fingerprint, i, opened)) for i in range(4)]
            problems = [r.get(timeout=120) for r in pending]
    assert problems == [[None] * 3] * 4
    saved = memory_store.read_memory_file(memory_path(tmp_path, fingerprint), fingerprint)
    assert sorted(map(tuple, saved.documents())) == sorted((i + 1, j + 1, 7, 8, 9, i + 1) for i in range(4) for j in range(3))
    assert not list(tmp_path.glob(".memory-*"))  # no temporary file left behind


def test_the_bound_keeps_the_file_within_64_mib_and_drops_the_oldest(tmp_path, monkeypatch):
    worst = TokenMemory._HEADER.size + TokenMemory.MAX_FINGERPRINT + 8 * memory_store.PERSIST_BOUND + TokenMemory._DIGEST
    assert worst <= memory_store.MAX_BYTES
    monkeypatch.setattr(memory_store, "PERSIST_BOUND", 10)
    f = MemoryFile.open(tmp_path, "fp", 100)
    for i in range(5):
        assert f.remember([i + 1] * 4) is None
    saved = memory_store.read_memory_file(f.path, "fp")
    assert saved.documents() == [[4] * 4, [5] * 4]


def test_chat_remembers_each_finished_turn(tmp_path, pair_perturbed):
    target, cache = str(pair_perturbed[0]), tmp_path / "cache"
    script = f"{PROMPTS[1]}\n{PROMPTS[1]}\n/exit\n"
    for n in (2, 4):  # a second chat reads the first's and adds its own
        result = specli("chat", "-m", target, "--lookup", "--memory", "persist", "--max-tokens", "20", *GREEDY_ARGS,
                        stdin=script, env={"SPECLI_CACHE_DIR": str(cache)})
        assert result.returncode == 0, result.stderr
        saved = TokenMemory.from_bytes(memory_file(cache).read_bytes())
        assert saved.n_documents == n  # one per turn
    first, second = saved.documents()[:2]
    assert first[:5] == second[:5] and len(second) > len(first)  # the second turn's prompt holds the first turn


def test_batch_saves_its_finished_items_and_a_second_batch_drafts_from_them(tmp_path, pair_perturbed):
    target, cache = str(pair_perturbed[0]), tmp_path / "cache"
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": p} for i, p in enumerate(PROMPTS[:3])])
    runs = []
    for name in ("first", "second"):
        out = tmp_path / f"{name}.jsonl"
        result = specli("batch", str(src), "-o", str(out), "-m", target, "--lookup", "--draft-max", "4", "--max-tokens", "24", "--memory", "persist",
                        "--quiet", *GREEDY_ARGS, env={"SPECLI_CACHE_DIR": str(cache)})
        assert result.returncode == 0, result.stderr
        runs.append(read_records(out))
        assert TokenMemory.from_bytes(memory_file(cache).read_bytes()).n_documents == 3 * len(runs)
    assert stat.S_IMODE(memory_file(cache).stat().st_mode) == 0o600
    first, second = runs
    assert [r["token_ids"] for r in first] == [r["token_ids"] for r in second]
    assert all(MEMORY not in r["stats"]["by_source"] for r in first[:1])
    assert all(r["stats"]["by_source"].get(MEMORY, {}).get("accepted", 0) > 0 for r in second)


def test_memory_persist_needs_lookup(tmp_path, pair_perturbed):
    target, draft = map(str, pair_perturbed)
    result = specli("run", "x", "-m", target, "-d", draft, "--memory", "persist", *GREEDY_ARGS, env={"SPECLI_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 2 and "--memory persist" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    refused = specli("batch", str(write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])), "-m", target, "--target-only", "--memory", "persist")
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1 and "--memory persist" in refused.stderr
