"""Pairs that make sense, through the CLI: a pair's name as -d is its draft model, `fit` names each
model by its own file, and fit and run flag what the GGUF headers tell before loading (a draft
larger than its target, another tokenizer, -c above the training context)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from fixtures import synthetic
from fixtures.cli import assert_one_line_error, specli

COMMIT = "0123abcd" * 5
REPO = "test/tiny-GGUF"


def hf_cache_with(cache: Path, files: dict[str, Path]) -> None:
    """Lay out `files` (name in the repo -> local GGUF) in a Hugging Face cache as the hub
    client does (refs/main, snapshots/COMMIT/NAME as links), so a models.toml entry finds them offline."""
    repo_dir = cache / ("models--" + REPO.replace("/", "--"))
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs" / "main").write_text(COMMIT)
    for name, path in files.items():
        link = repo_dir / "snapshots" / COMMIT / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory, fixture_dir, pair_truncated):
    """A user models.toml whose pair `tiny` is the truncated fixture pair (2-layer target, 1-layer
    draft), in an offline Hugging Face cache; plus odd drafts and a short-context model."""
    root = tmp_path_factory.mktemp("pairs")
    target, draft = pair_truncated
    big = synthetic.make_model(root / "big-draft.gguf", seed=2, n_layer=3)  # same vocabulary, 3 layers
    short = synthetic.make_model(root / "short-ctx.gguf", seed=4, n_ctx_train=256)
    hf_cache_with(root / "hub", {"tiny-target-F32.gguf": target, "tiny-draft-F32.gguf": draft})
    toml = root / "models.toml"
    toml.write_text(textwrap.dedent(f"""\
        [models.tiny]
        description = "the truncated fixture pair"
        [models.tiny.target]
        hf_repo = "{REPO}"
        hf_file = "tiny-target-F32.gguf"
        [models.tiny.draft]
        hf_repo = "{REPO}"
        hf_file = "tiny-draft-F32.gguf"
    """))
    env = {"SPECLI_MODELS": str(toml), "HF_HUB_CACHE": str(root / "hub"), "HF_HUB_OFFLINE": "1",
           "XDG_CONFIG_HOME": str(root / "config")}
    return {"env": env, "target": target, "draft": draft, "big": big, "short": short,
            "snapshot": root / "hub" / ("models--" + REPO.replace("/", "--")) / "snapshots" / COMMIT}


def run_json(models, *args):
    result = specli("run", "Once upon a time", "-n", "4", "--draft-max", "2", "--json", *args, env=models["env"])
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout), result.stderr


def test_a_pair_name_as_draft_is_the_pairs_draft(models):
    out, _ = run_json(models, "-m", str(models["target"]), "-d", "tiny")
    assert out["draft"] == str(models["snapshot"] / "tiny-draft-F32.gguf")
    # As -m, the name is still the pair: its target drafted by its draft.
    out, _ = run_json(models, "-m", "tiny")
    assert out["target"] == str(models["snapshot"] / "tiny-target-F32.gguf")
    assert out["draft"] == str(models["snapshot"] / "tiny-draft-F32.gguf")


def test_help_says_what_a_pair_name_means_as_draft():
    result = specli("run", "--help", env={"COLUMNS": "300"})
    assert "pair's draft model" in " ".join(result.stdout.split())


def test_fit_names_each_model_by_its_own_file(models):
    for args in (("-m", "tiny"), ("-m", str(models["target"]), "-d", "tiny")):
        result = specli("fit", *args, "--json", env=models["env"])
        assert result.returncode == 0, result.stderr
        out = json.loads(result.stdout)
        draft_label = out["draft"]["label"]
        assert draft_label == "tiny-draft-F32.gguf", args
        assert out["bytes"]["weights_draft"] == models["draft"].stat().st_size
        assert out["warnings"] == [] and result.stderr == ""
    table = specli("fit", "-m", "tiny", env={**models["env"], "COLUMNS": "300"})
    title = " ".join(table.stdout.split("┏")[0].split())
    assert "target tiny-target-F32.gguf (" in title and "+ draft tiny-draft-F32.gguf (" in title


def test_a_draft_larger_than_its_target_warns_in_fit_and_run(models):
    target, big = str(models["target"]), str(models["big"])
    fit = specli("fit", "-m", target, "-d", big, "--json", env=models["env"])
    assert fit.returncode == 0, fit.stderr
    lines = fit.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: the draft big-draft.gguf") and "larger than the target" in lines[0]
    assert json.loads(fit.stdout)["warnings"] == lines
    out, stderr = run_json(models, "-m", target, "-d", big)
    assert out["text"] and stderr.splitlines()[0] == lines[0]  # a warning, not an error
    # The usual way round: no warning.
    _, stderr = run_json(models, "-m", target, "-d", str(models["draft"]))
    assert "warning" not in stderr


@pytest.mark.parametrize("variant, fragment", [
    ("renamed", "disagree on token"), ("eos", "different EOS tokens"), ("small", "differ in size"),
])
def test_another_tokenizer_is_flagged_by_fit_and_refused_by_run_before_loading(models, tmp_path, variant, fragment):
    # Both files lose their last tensor bytes: any load would fail on that, so the tokenizer
    # error below can only come from the headers.
    target, bad = tmp_path / "target.gguf", tmp_path / f"draft-{variant}.gguf"
    target.write_bytes(models["target"].read_bytes()[:-4096])
    bad.write_bytes(synthetic.make_incompatible_draft(tmp_path, variant).read_bytes()[:-4096])
    fit = specli("fit", "-m", str(target), "-d", str(bad), env=models["env"])
    assert fit.returncode == 0, fit.stderr
    assert len(fit.stderr.splitlines()) == 1 and fragment in fit.stderr and "specli run refuses" in fit.stderr
    run = specli("run", "hi", "-m", str(target), "-d", str(bad), env=models["env"])
    assert_one_line_error(run, 2, fragment, bad.name)
    # (without the header check, the load fails on the missing bytes instead)
    alone = specli("run", "hi", "-m", str(target), "--lookup", env=models["env"])
    assert alone.returncode != 0 and fragment not in alone.stderr


def test_context_above_training_warns_in_fit_and_run(models):
    short = str(models["short"])
    warning = "warning: -c 512 is above the model's training context (256): quality may drop"
    fit = specli("fit", "-m", short, "-c", "512", "--lookup", env=models["env"])
    assert fit.returncode == 0 and fit.stderr.splitlines() == [warning]
    out, stderr = run_json(models, "-m", short, "-c", "512", "--lookup")
    assert out["text"] and stderr.splitlines()[0] == warning
    assert stderr.count("training context") == 1  # (llama.cpp's own line stays behind --verbose)
    _, stderr = run_json(models, "-m", short, "-c", "256", "--lookup")
    assert "training context" not in stderr
    quiet = specli("run", "hi", "-m", short, "-c", "512", "--lookup", "-n", "2", "--quiet", env=models["env"])
    assert quiet.returncode == 0 and quiet.stderr == ""
