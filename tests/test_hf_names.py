"""Hugging Face names as llama.cpp's -hf takes them (`user/repo:QUANT`, `user/repo/file.gguf`),
through the CLI, against a Hugging Face cache laid out by hand in tmp_path (HF_HUB_CACHE).

No test here touches the network: resolving from the cache needs none, and the download path
runs with huggingface_hub.hf_hub_download and HfApi.list_repo_files replaced by functions that
copy local files into the same cache layout (the real client is tested against a local stand-in
for the hub in test_pull.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures.cli import assert_one_line_error, specli

COMMIT = "ab" * 20


def cache_file(hub: Path, repo: str, filename: str, source: Path, commit: str = COMMIT) -> Path:
    """Put `source` in the cache as the hub client does: a blob, and a snapshot symlink to it."""
    folder = hub / ("models--" + repo.replace("/", "--"))
    blob = folder / "blobs" / f"{abs(hash((repo, filename))):x}"
    blob.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, blob)
    link = folder / "snapshots" / commit / filename
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(blob, link.parent))
    (folder / "refs").mkdir(exist_ok=True)
    (folder / "refs" / "main").write_text(commit)
    return link


@pytest.fixture
def hf_cache(tmp_path, pair_perturbed):
    """A cache holding org/tiny-GGUF (target as Q8_0, the draft as Q4_K_M, an mmproj) and
    org/twins-GGUF (two Q4_K_M files); HF_HUB_OFFLINE set: any network use would fail."""
    target, draft = pair_perturbed
    hub = tmp_path / "hf" / "hub"
    cache_file(hub, "org/tiny-GGUF", "tiny-Q8_0.gguf", target)
    cache_file(hub, "org/tiny-GGUF", "tiny-Q4_K_M.gguf", draft)
    cache_file(hub, "org/tiny-GGUF", "mmproj-tiny-Q8_0.gguf", draft)
    cache_file(hub, "org/twins-GGUF", "a-Q4_K_M.gguf", draft)
    cache_file(hub, "org/twins-GGUF", "b-Q4_K_M.gguf", draft)
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1",
           "XDG_CONFIG_HOME": str(tmp_path / "config")}
    return hub, env, target, draft


RUN = ("Once upon a time", "-n", "12", "--draft-max", "3", "--seed", "0", "--json")


def test_run_takes_quant_and_file_names_from_the_cache(hf_cache):
    _, env, target, draft = hf_cache
    by_path = specli("run", *RUN, "-m", str(target), "-d", str(draft), env=env)
    # Quant matched case-insensitively; mmproj-tiny-Q8_0.gguf is no candidate.
    by_name = specli("run", *RUN, "-m", "org/tiny-GGUF:q8_0", "-md", "org/tiny-GGUF/tiny-Q4_K_M.gguf", env=env)
    assert by_path.returncode == 0 and by_name.returncode == 0, by_path.stderr + by_name.stderr
    a, b = json.loads(by_path.stdout), json.loads(by_name.stdout)
    assert a["text"] == b["text"] and a["text"]
    assert b["target"].endswith("snapshots/" + COMMIT + "/tiny-Q8_0.gguf")
    assert b["draft"].endswith("/tiny-Q4_K_M.gguf")
    assert "downloading" not in by_name.stderr


def test_ambiguous_quant_lists_the_candidates(hf_cache):
    _, env, _, _ = hf_cache
    result = specli("run", "hi", "-m", "org/twins-GGUF:Q4_K_M", env=env)
    assert_one_line_error(result, 2, "org/twins-GGUF:Q4_K_M is ambiguous", "a-Q4_K_M.gguf, b-Q4_K_M.gguf",
                          "org/twins-GGUF/FILE.gguf")


def test_quant_not_cached_and_offline_is_one_line(hf_cache):
    _, env, _, _ = hf_cache
    # Q4_K is not Q4_K_M: a quant name matches whole, not as a prefix.
    for name in ("org/tiny-GGUF:Q4_K", "org/absent-GGUF:Q8_0"):
        result = specli("run", "hi", "-m", name, env=env)
        assert_one_line_error(result, 1, "not in the Hugging Face cache", "HF_HUB_OFFLINE")
    result = specli("run", "hi", "-m", "org/absent-GGUF/x-Q8_0.gguf", env=env)
    assert_one_line_error(result, 1, "download org/absent-GGUF/x-Q8_0.gguf", "not in the Hugging Face cache", "HF_HUB_OFFLINE")


def test_an_existing_file_wins_over_the_hf_reading(hf_cache, tmp_path, monkeypatch):
    _, env, target, _ = hf_cache
    local = tmp_path / "org" / "tiny-GGUF" / "tiny-Q8_0.gguf"  # a relative path that parses as a name
    local.parent.mkdir(parents=True)
    shutil.copyfile(target, local)
    result = subprocess.run([sys.executable, "-m", "specli", "run", *RUN, "-m", "org/tiny-GGUF/tiny-Q8_0.gguf",
                             "--lookup"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env={**os.environ, **env, "HF_HUB_CACHE": str(tmp_path / "empty")})
    assert result.returncode == 0, result.stderr


def test_fit_reads_a_cached_name_and_never_downloads(hf_cache):
    _, env, target, _ = hf_cache
    result = specli("fit", "-m", "org/tiny-GGUF:Q8_0", "--json", env=env)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["target"]["origin"] == "GGUF header" and out["bytes"]["weights_target"] == target.stat().st_size
    missing = specli("fit", "-m", "org/tiny-GGUF/tiny-F16.gguf", env={**env, "HF_HUB_OFFLINE": "0"})
    assert_one_line_error(missing, 2, "org/tiny-GGUF/tiny-F16.gguf is not downloaded", "specli pull org/tiny-GGUF/tiny-F16.gguf")


def test_models_lists_cached_ggufs_by_the_names_m_takes(hf_cache):
    _, env, target, _ = hf_cache
    result = specli("models", env=env)
    assert result.returncode == 0, result.stderr
    rows = [line.split("\t") for line in result.stdout.splitlines()]
    assert rows[0] == ["NAME", "DRAFT", "SIZE", "LOCAL", "DESCRIPTION"]
    assert all(len(r) == 5 for r in rows)  # piped: tab-separated, never wrapped
    names = [r[0] for r in rows]
    assert "gemma3-270m" in names and "llama-3.1-70b" in names
    assert "org/tiny-GGUF:Q8_0" in names and "org/tiny-GGUF:Q4_K_M" in names
    # Two files of one quant: only the file names pick one. mmproj files are no model.
    assert "org/twins-GGUF/a-Q4_K_M.gguf" in names and "org/twins-GGUF/b-Q4_K_M.gguf" in names
    assert not any("mmproj" in n for n in names)


def test_models_on_an_80_column_terminal(hf_cache):
    import pty
    import select

    _, env, _, _ = hf_cache
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "specli", "models"], stdout=slave, stderr=subprocess.PIPE,
                            env={**os.environ, **env, "COLUMNS": "80", "LINES": "40"})
    os.close(slave)
    import fcntl
    import struct
    import termios
    fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 80, 0, 0))
    out = b""
    while True:
        ready, _, _ = select.select([master], [], [], 60)
        if not ready:
            break
        try:
            chunk = os.read(master, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    proc.wait(timeout=60)
    os.close(master)
    assert proc.returncode == 0, proc.stderr.read()
    lines = out.decode().replace("\r\n", "\n").splitlines()
    assert lines[0].split() == ["NAME", "DRAFT", "SIZE", "LOCAL", "DESCRIPTION"]
    assert all(len(line) <= 80 for line in lines), lines
    # Every name whole, at the start of its own line.
    assert any(line.startswith("org/twins-GGUF/a-Q4_K_M.gguf ") for line in lines)
    assert any(line.startswith("llama-3.1-70b ") for line in lines)


# --- downloads, with the hub client replaced ------------------------------------------------------

FAKE_HUB = '''
import json, os, shutil, sys
from pathlib import Path
import huggingface_hub
from huggingface_hub import constants

REPOS = json.loads(os.environ["FAKE_REPOS"])  # repo -> {file: local path}
LOG = Path(os.environ["FAKE_LOG"])

def log(*what):
    with LOG.open("a") as f:
        f.write(" ".join(what) + "\\n")

def hf_hub_download(repo_id, filename, **kwargs):
    log("download", repo_id, filename)
    folder = Path(constants.HF_HUB_CACHE) / ("models--" + repo_id.replace("/", "--"))
    path = folder / "snapshots" / ("cd" * 20) / filename
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(REPOS[repo_id][filename], path)
    (folder / "refs").mkdir(exist_ok=True)
    (folder / "refs" / "main").write_text("cd" * 20)
    return str(path)

def list_repo_files(self, repo_id, **kwargs):
    log("list", repo_id)
    return sorted(REPOS[repo_id])

huggingface_hub.hf_hub_download = hf_hub_download
huggingface_hub.HfApi.list_repo_files = list_repo_files
# The hub "answers": specli's first look at HF_ENDPOINT (nothing listens there) is part of the fake.
from specli.models import hub
hub.silent_endpoint = lambda: None
sys.argv[0] = "specli"
from specli.cli.app import main
main()
'''


@pytest.fixture
def fake_hub(tmp_path, pair_perturbed):
    target, draft = pair_perturbed
    script = tmp_path / "fake_hub.py"
    script.write_text(FAKE_HUB)
    repos = {"org/new-GGUF": {"new-Q8_0.gguf": str(target), "new-Q4_K_M.gguf": str(draft), "README.md": str(script)}}
    log = tmp_path / "hub.log"
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": str(tmp_path / "hf" / "hub"),
           "XDG_CONFIG_HOME": str(tmp_path / "config"), "FAKE_REPOS": json.dumps(repos), "FAKE_LOG": str(log),
           # An address that resolves without DNS: the no-network check passes; nothing listens there.
           "HF_ENDPOINT": "http://127.0.0.1:9"}
    env.pop("HF_HUB_OFFLINE", None)

    def run(*args, **extra):
        return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                              timeout=120, env={**env, **extra})

    def calls():
        return log.read_text().splitlines() if log.exists() else []

    return run, calls, target, draft


def test_pull_quant_and_draft_then_run_offline(fake_hub):
    run, calls, target, draft = fake_hub
    result = run("pull", "org/new-GGUF:Q8_0", "--draft", "org/new-GGUF:q4_k_m")
    assert result.returncode == 0, result.stderr
    paths = [Path(p) for p in result.stdout.splitlines()]
    assert [p.name for p in paths] == ["new-Q8_0.gguf", "new-Q4_K_M.gguf"]
    assert paths[0].read_bytes() == target.read_bytes()
    assert calls() == ["list org/new-GGUF", "download org/new-GGUF new-Q8_0.gguf",
                       "list org/new-GGUF", "download org/new-GGUF new-Q4_K_M.gguf"]
    assert "run it: specli run -m org/new-GGUF:Q8_0 -d org/new-GGUF:q4_k_m" in result.stderr
    # Now cached: the quant is found in the cached snapshot, without listing the repo again.
    again = run("run", *RUN, "-m", "org/new-GGUF:Q8_0", "-d", "org/new-GGUF:Q4_K_M", HF_HUB_OFFLINE="1")
    assert again.returncode == 0, again.stderr
    assert len(calls()) == 4


def test_run_downloads_on_first_use_only(fake_hub):
    run, calls, _, _ = fake_hub
    first = run("run", *RUN, "-m", "org/new-GGUF:Q8_0", "--lookup")
    assert first.returncode == 0, first.stderr
    assert "org/new-GGUF:Q8_0 is not in the Hugging Face cache: downloading it" in first.stderr
    assert calls() == ["list org/new-GGUF", "download org/new-GGUF new-Q8_0.gguf"]
    second = run("run", *RUN, "-m", "org/new-GGUF:Q8_0", "--lookup")
    assert second.returncode == 0 and "downloading" not in second.stderr
    assert json.loads(second.stdout)["text"] == json.loads(first.stdout)["text"]
    assert len(calls()) == 2


def test_remote_quant_with_no_match_lists_the_repo(fake_hub):
    run, calls, _, _ = fake_hub
    result = run("pull", "org/new-GGUF:Q5_K_M")
    assert_one_line_error(result, 2, "org/new-GGUF has no GGUF file named with Q5_K_M",
                          "new-Q4_K_M.gguf, new-Q8_0.gguf")
    assert "README" not in result.stderr and calls() == ["list org/new-GGUF"]


def test_pull_refuses_a_path(fake_hub):
    run, _, _, _ = fake_hub
    assert_one_line_error(run("pull", "./x/y.gguf"), 2, "not a file")
