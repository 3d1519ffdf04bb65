"""llama.cpp's spellings through the command line: -n is tokens to generate, --draft-max the
draft length (with its aliases), -md/-ngl/-ngld/-p/-h parse as llama-cli users type them."""

from __future__ import annotations

import json

import pytest

from fixtures.cli import assert_one_line_error, specli

GREEDY = ("--temperature", "0")
COMMANDS = ("run", "chat", "batch", "bench", "fit", "models", "pull", "cache")


def run_json(*args: str) -> dict:
    result = specli("run", *args, "--json", *GREEDY)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_n_is_the_number_of_tokens_to_generate_not_the_draft_length(pair_perturbed):
    target, draft = map(str, pair_perturbed)
    out = run_json("Once upon a time", "-m", target, "-d", draft, "-n", "5")
    # Before, -n 5 meant 5-token drafts and 256 tokens: now 5 tokens, drafts left to auto.
    assert out["n_tokens"] <= 5 and out["n_draft"] == "auto"
    assert out["n_tokens"] == 5 or out["stop_reason"] == "eos"
    same = run_json("Once upon a time", "-m", target, "-d", draft, "--n-predict", "5")
    assert same["token_ids"] == out["token_ids"]
    assert_one_line_error(specli("run", "hi", "-m", target, "-n", "0"), 2, "'-n' / '--n-predict' / '--max-tokens'")
    # An older script's `-n auto` is an error that says where the draft length went.
    assert_one_line_error(specli("run", "hi", "-m", target, "-n", "auto"), 2, "tokens to generate", "--draft-max")


@pytest.mark.parametrize("option", ["--draft-max", "--spec-draft-n-max", "--num-speculative-tokens"])
def test_every_spelling_of_the_draft_length_sets_it(pair_perturbed, option):
    target, draft = map(str, pair_perturbed)
    out = run_json("Hello there", "-m", target, "-d", draft, option, "3", "-n", "8")
    assert out["n_draft"] == 3 and out["n_tokens"] <= 8
    # draft_lengths[k]: passes that checked k drafts; the first pass (8 tokens to go) drafts 3.
    assert len(out["stats"]["draft_lengths"]) == 4


def test_llama_cpp_model_and_offload_spellings_parse(pair_perturbed):
    target, draft = map(str, pair_perturbed)
    # -md was -m d ("unknown model 'd'"), -ngl was -n gl ("'gl' is not a number").
    out = run_json("Hello there", "-m", target, "-md", draft, "-ngl", "99", "-ngld", "0", "--draft-max", "2", "-n", "4")
    assert out["draft"] == draft and out["n_draft"] == 2
    plain = run_json("Hello there", "-m", target, "-d", draft, "--draft-max", "2", "-n", "4")
    assert plain["token_ids"] == out["token_ids"]
    assert_one_line_error(specli("run", "hi", "-m", target, "-ngl", "-5"), 2, "--ngl must be -1")


@pytest.mark.parametrize("command", ["run", "chat", "batch", "bench", "serve"])
def test_t_is_threads_in_every_command_that_has_them(command):
    # (refused as out of range: parsed as --threads, before anything loads)
    assert_one_line_error(specli(command, "-t", "0", "-m", "nothing.gguf"), 2, "'--threads' / '-t'")


def test_prompt_as_an_option(pair_perturbed):
    target = str(pair_perturbed[0])
    by_option = run_json("-p", "Hello there", "-m", target, "-n", "6", "--target-only")
    by_argument = run_json("Hello there", "-m", target, "-n", "6", "--target-only")
    assert by_option["token_ids"] == by_argument["token_ids"] and by_option["n_tokens"] > 0
    assert_one_line_error(specli("run", "Hello", "-p", "there", "-m", target), 2, "prompt is given twice", "-p/--prompt")


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_h_is_help(command):
    result = specli(*filter(None, [command]), "-h")
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert result.stdout.startswith(f"Usage: specli {command}".rstrip() + " ")
    assert "-h, --help" in result.stdout


def test_shell_completion(pair_perturbed):
    result = specli("--help")
    assert result.returncode == 0 and result.stderr == ""
    assert "--install-completion" in result.stdout and "--show-completion" in result.stdout
    # Click's completion protocol, as the installed bash script calls it, through main().
    env = {"_SPECLI_COMPLETE": "complete_bash", "COMP_WORDS": "specli run --draft-m", "COMP_CWORD": "2"}
    completed = specli(env=env)
    assert completed.returncode == 0 and completed.stdout.split() == ["--draft-max"], completed.stderr


def test_batch_and_chat_take_the_same_spellings(pair_perturbed, tmp_path):
    target, draft = map(str, pair_perturbed)
    result = specli("batch", "-", "-m", target, "-md", draft, "-n", "3", "--draft-max", "2", *GREEDY, "-q",
                    "--format", "text", stdin="Hello there\nOnce upon a time\n")
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(records) == 2 and all(r["n_tokens"] <= 3 and r["n_draft"] == 2 for r in records)
    chat = specli("chat", "-m", target, "-md", draft, "-ngl", "0", "-n", "3", "--draft-max", "2", "-q", stdin="hi\n")
    assert chat.returncode == 0 and chat.stdout.strip(), chat.stderr


def test_bench_sweeps_draft_max_and_n_is_its_tokens_per_run():
    # -n was bench's list of draft lengths; now it is tokens per run, so a list is refused.
    assert_one_line_error(specli("bench", "-n", "2,4"), 2, "'-n' / '--n-predict' / '--max-tokens'")
    assert_one_line_error(specli("bench", "--draft-max", "1,zero"), 2, "--draft-max takes", "'zero' is not a number")


def test_the_summary_says_how_many_target_passes_drafting_saved(pair_perturbed):
    target, draft = map(str, pair_perturbed)
    result = specli("run", "Once upon a time", "-m", target, "-d", draft, "--draft-max", "4", "-n", "24", "--json", *GREEDY)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    passes = out["stats"]["target_passes"]
    assert out["stats"]["accepted"] > 0 and passes < out["n_tokens"]  # the pair agrees 3 times in 4
    assert f"{passes} passes ({out['n_tokens'] - passes} saved)" in result.stderr
    plain = specli("run", "Once upon a time", "-m", target, "--target-only", "-n", "24", *GREEDY)
    assert plain.returncode == 0 and "saved)" not in plain.stderr  # nothing drafted, nothing to say


# The README's first command: a prompt the model copies, so lookup drafts most of the output.
README_PROMPT = "def mean(xs):\n    return sum(xs) / len(xs)\n\n# With type hints:\ndef mean(xs: list[float]) -> float:\n"


@pytest.mark.gemma
def test_the_readme_example_drafts_most_of_its_output(gemma_path):
    # A fixed draft length: auto's choices follow timings; greedy with a fixed N does not.
    result = specli("run", "--temp", "0", "-n", "96", "--draft-max", "8", "--json", README_PROMPT)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["n_tokens"] == 96 and out["draft"] == "lookup"
    assert out["stats"]["mean_tokens_per_pass"] > 3  # measured 4.57; plain decoding: 1
    assert "return sum(xs) / len(xs)" in out["text"]
