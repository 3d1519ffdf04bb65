"""Several candidate continuations in one target pass: the token tree (branches.py), the tree
pass on the one-sequence cache (LlamaModel.eval_tree / keep_branch), and greedy decoding with
branches (exact: the target's own greedy output, whatever the branches)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import FIXTURE_CTX
from specli.decoding.branches import TokenTree, choose_branches, distinct_branches, maximal, node_chances
from specli.decoding.generation import Request
from specli.decoding.loop import generate
from specli.decoding.replay import CostTable
from specli.decoding.verifier import verify_tree
from specli.llama.model import LlamaModel, tree_sequences
from specli.llama.native import init_backend

# Batched and one-token passes differ by ~1e-5 on the F32 fixtures with an F32 cache and no
# flash attention (LlamaModel's docstring); logits there spread over tens.
TOL = 1e-3


# --------------------------------------------------------------------------------------------
# The tree, pure


def test_branches_share_their_common_prefixes():
    tree = TokenTree.of([[1, 2, 3], [1, 2, 4, 5], [6], [1, 7]])
    assert tree.tokens == (1, 2, 3, 4, 5, 6, 7)
    assert tree.parents == (-1, 0, 1, 1, 3, -1, 0)
    assert [tree.branch(b) for b in range(4)] == [[1, 2, 3], [1, 2, 4, 5], [6], [1, 7]]
    assert tree.width == 8


def test_tree_sequences_give_each_leaf_a_sequence_and_each_node_its_leaves():
    # root 0; 1 <- 0; 2 <- 1; 3 <- 1; 4 <- 0 (leaves 2, 3, 4)
    assert tree_sequences([-1, 0, 1, 1, 0]) == [[1, 2, 3], [1, 2], [1], [2], [3]]
    assert tree_sequences([-1]) == [[1]]


def test_distinct_branches_skip_what_adds_no_node_and_stop_at_the_limit():
    assert distinct_branches([1, 2], [(1, 2), (1,), (3, 4, 5), (6,)], 2, 3) == [[1, 2], [3, 4], [6]]
    assert distinct_branches([], [(1, 2, 3), (1, 2)], 8, 4) == [[1, 2, 3]]
    assert maximal([[1], [1, 2], [3], [3]]) == [[1, 2], [3]]


def test_node_chances_are_the_share_of_places_agreeing_on_the_path():
    tree = TokenTree.of([[1, 2], [1, 3], [4]])
    chance = node_chances(tree, [((1, 2), 2), ((1, 3), 1), ((4,), 1)])
    assert chance == pytest.approx([0.75, 0.5, 0.25, 0.25])


def test_the_judge_keeps_other_branches_where_a_wider_pass_costs_little_and_not_where_it_costs_much():
    found = [((5, 6, 7), 9), ((8, 9), 1)]  # the other one on a tenth of the places
    flat = CostTable.flat(0.01, 1.1)
    steep = CostTable.from_points({1: 0.0225, 4: 0.066, 16: 0.127})
    assert choose_branches([5, 6, 7], found, 8, 4, flat) == [[5, 6, 7], [8, 9]]
    assert choose_branches([5, 6, 7], found, 8, 4, steep) == [[5, 6, 7]]
    assert choose_branches([5, 6, 7], found, 8, 4) == [[5, 6, 7], [8, 9]]  # no table: --branches alone
    assert choose_branches([5, 6, 7], found, 8, 1, flat) == [[5, 6, 7]]


def test_verify_tree_takes_the_longest_accepted_branch():
    tree = TokenTree.of([[1, 2], [1, 3, 4], [5]])  # nodes 1, 2, 3, 4, 5
    vocab = 8

    def row(token):
        r = np.zeros(vocab)
        r[token] = 1.0
        return r

    # root predicts 1; node 1 predicts 3; node 3 predicts 4; node 4 predicts 6
    rows = [row(1), row(3), row(0), row(4), row(6), row(0)]
    got = verify_tree(rows, tree)
    assert got.branch == 1 and got.n_accepted == 3 and got.tokens == [1, 3, 4, 6]
    got = verify_tree([row(7)] + rows[1:], tree)  # nothing accepted: the root's own choice
    assert got.n_accepted == 0 and got.tokens == [7]


# --------------------------------------------------------------------------------------------
# The tree pass on a fixture model


@pytest.fixture(scope="module")
def models(pair_perturbed):
    """The F32 target twice: with room for 4 branches, and plain (the reference)."""
    init_backend()
    kw = dict(n_ctx=FIXTURE_CTX, n_threads=2, kv_type="f32", flash_attn="off")
    tree_model = LlamaModel(pair_perturbed[0], branches=4, **kw)
    plain = LlamaModel(pair_perturbed[0], **kw)
    yield tree_model, plain
    tree_model.close(), plain.close()


def tree_pass(last: int, tree: TokenTree) -> tuple[list[int], list[int]]:
    """eval_tree's tokens and parents for [last, *tree's nodes]."""
    return [last, *tree.tokens], [-1, *(p + 1 for p in tree.parents)]


def plain_rows(plain: LlamaModel, context: list[int], tokens: list[int]) -> np.ndarray:
    plain.reset()
    plain.eval(context, logits="none")
    return plain.eval(tokens, logits="all").copy()


def test_each_node_gets_the_logits_of_its_branch_evaluated_alone_and_the_cache_keeps_one(models):
    model, plain = models
    rng = np.random.default_rng(0)
    prompt = [1] + rng.integers(10, 900, 30).tolist()
    branches = [[11, 12, 13], [11, 12, 14, 15], [16, 17], [18]]
    tree = TokenTree.of(branches)
    model.reset()
    model.eval(prompt[:-1], logits="none")
    tokens, parents = tree_pass(prompt[-1], tree)
    rows = model.eval_tree(tokens, parents).copy()
    assert model.cached == prompt[:-1]  # the tree sits beside the cache until keep_branch
    for b, branch in enumerate(branches):
        alone = plain_rows(plain, prompt[:-1], [prompt[-1], *branch])
        mine = rows[[0, *(1 + i for i in tree.paths[b])]]
        assert np.abs(mine - alone).max() < TOL, b
        assert (mine.argmax(axis=1) == alone.argmax(axis=1)).all()
    # Keep the root and two nodes of branch 1; the cache then goes on as a plain one would.
    model.keep_branch([0, *(1 + i for i in tree.paths[1][:2])])
    kept = prompt + branches[1][:2]
    assert model.cached == kept
    more = rng.integers(10, 900, 5).tolist()
    got = model.eval(more, logits="all").copy()
    assert np.abs(got - plain_rows(plain, kept, more)).max() < TOL
    # A second tree after it: nothing of the first is left in the branch sequences.
    kept += more
    tree2 = TokenTree.of([[21, 22], [23], [24, 25, 26], [27]])
    tokens, parents = tree_pass(30, tree2)
    rows = model.eval_tree(tokens, parents).copy()
    for b, branch in enumerate(tree2.branch(b) for b in range(4)):
        alone = plain_rows(plain, kept, [30, *branch])
        assert np.abs(rows[[0, *(1 + i for i in tree2.paths[b])]] - alone).max() < TOL
    model.keep_branch([0])  # the root alone: as a pass that accepted no draft
    assert model.cached == kept + [30]
    got = model.eval([31, 32], logits="all").copy()
    assert np.abs(got - plain_rows(plain, kept + [30], [31, 32])).max() < TOL


def test_a_dropped_tree_leaves_the_cache_as_it_was(models):
    """drop_tree (as after a Ctrl-C between the pass and keep_branch), or any other change."""
    model, plain = models
    prompt = [1, 50, 60, 70, 80, 90]
    model.reset()
    model.eval(prompt, logits="none")
    model.eval_tree([100, 101, 102, 103], [-1, 0, 0, 2])
    model.drop_tree()
    assert model.cached == prompt
    got = model.eval([104, 105], logits="all").copy()
    assert np.abs(got - plain_rows(plain, prompt, [104, 105])).max() < TOL
    model.eval_tree([106, 107, 108], [-1, 0, 0])
    model.truncate(3)  # (a pending tree is forgotten by any other change to the cache)
    assert model.cached == prompt[:3]
    got = model.eval(prompt[3:], logits="all").copy()
    assert np.abs(got - plain_rows(plain, prompt[:3], prompt[3:])).max() < TOL


def test_a_tree_wider_than_the_context_allows_is_refused(models, pair_perturbed):
    model, plain = models
    model.reset()
    model.eval([1, 5, 6], logits="none")
    from specli.errors import SpecliError

    with pytest.raises(SpecliError):
        model.eval_tree([7, 8, 9, 10, 11, 12], [-1, 0, 0, 0, 0, 0])  # 5 leaves, room for 4
    with pytest.raises(SpecliError):
        plain.eval_tree([7, 8, 9], [-1, 0, 0])  # a plain context holds no branches
    assert model.cached == [1, 5, 6]


# --------------------------------------------------------------------------------------------
# Greedy decoding with branches: exactly the target's own output


PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Once upon a time, in a small village, there lived"]
MAX_TOKENS = 40


def misleading_memory(prompt: list[int], output: list[int], seed: int):
    """A memory where most earlier places went the wrong way: the prompt and the true output
    once, and copies of it with one token changed, at 8 (8 copies), 18 (4) and 28 (2): at each
    of those points the wrong token has most places (the draft takes it), the true one a few."""
    from specli.decoding.memory import TokenMemory

    rng = np.random.default_rng(seed)
    memory = TokenMemory("test")
    memory.add(prompt + output)
    for at, copies in ((8, 8), (18, 4), (28, 2)):
        if at >= len(output):
            break
        wrong = list(output)
        wrong[at] = int(rng.integers(10, 900))
        memory.extend([prompt + wrong] * copies)
    return memory


@pytest.mark.parametrize("n_draft", [4, 8, "auto"])
def test_greedy_output_with_branches_is_the_target_only_output(models, n_draft):
    from specli.decoding.memory_drafter import MemoryDrafter
    from specli.decoding.step import SpeculativeDecoder

    model, plain = models
    trees = passes_tree = passes_chain = 0
    for i, prompt in enumerate(PROMPTS):
        ids = plain.tokenize(prompt)
        plain.reset()
        reference = generate(SpeculativeDecoder(plain, None, 0), Request(ids, max_tokens=MAX_TOKENS)).run().token_ids
        model.reset()
        assert generate(SpeculativeDecoder(model, None, 0), Request(ids, max_tokens=MAX_TOKENS)).run().token_ids == reference
        memory = misleading_memory(ids, reference, seed=i)
        model.reset()
        decoder = SpeculativeDecoder(model, MemoryDrafter(memory), n_draft)
        if n_draft == "auto":
            # A flat cost, as on a GPU: the judge then finds the branches worth their width.
            for _ in range(40):
                decoder.policy.pass_cost.observe(1, 0.01)
                decoder.policy.pass_cost.observe(17, 0.011)
        gen = generate(decoder, Request(ids, max_tokens=MAX_TOKENS))
        for step in gen:
            trees += step.n_branches > 1
        assert gen.token_ids == reference, (prompt, n_draft)
        passes_tree += gen.stats.target_passes
        plain.reset()  # (the same drafting without room for branches: the draft alone)
        chain = SpeculativeDecoder(plain, MemoryDrafter(misleading_memory(ids, reference, seed=i)), n_draft)
        chain_gen = generate(chain, Request(ids, max_tokens=MAX_TOKENS)).run()
        assert chain_gen.token_ids == reference
        passes_chain += chain_gen.stats.target_passes
        assert model.cached == ids + reference[:-1] or gen.stop_reason != "max_tokens"
    print("trees", trees, "passes", passes_tree, "without branches", passes_chain)
    assert trees  # (branches were verified)
    if n_draft != "auto":  # (the memory's majority misleads the draft alone; a branch follows the text)
        assert passes_tree < passes_chain


def test_verbose_shows_each_tree_pass(models):
    import io

    from specli.cli.render import stream_generation
    from specli.decoding.memory_drafter import MemoryDrafter
    from specli.decoding.step import SpeculativeDecoder

    model, plain = models
    ids = plain.tokenize(PROMPTS[0])
    plain.reset()
    reference = generate(SpeculativeDecoder(plain, None, 0), Request(ids, max_tokens=MAX_TOKENS)).run().token_ids
    model.reset()
    gen = generate(SpeculativeDecoder(model, MemoryDrafter(misleading_memory(ids, reference, seed=0)), 4), Request(ids, max_tokens=MAX_TOKENS))
    trace = io.StringIO()
    stream_generation(gen, io.StringIO(), io.StringIO(), show_text=False, live=False, show_accept=False, with_drafting=True, trace=trace)
    *lines, last = trace.getvalue().splitlines()
    assert lines and all(line.startswith("specli: tree pass after ") and " branches in a pass of " in line for line in lines)
    assert last.startswith(f"specli: {len(lines)} of {gen.stats.target_passes} passes verified several branches")


# --------------------------------------------------------------------------------------------
# The command line


def test_branches_without_memory_is_a_one_line_usage_error(pair_perturbed):
    from fixtures.cli import GREEDY_ARGS, assert_one_line_error, specli

    result = specli("run", "-m", str(pair_perturbed[0]), "--lookup", "--branches", "3", *GREEDY_ARGS, "x")
    assert_one_line_error(result, 2, "--branches 3", "--memory")


@pytest.mark.parametrize("command", ["batch", "serve"])
def test_branches_with_several_sequences_is_a_one_line_usage_error(tmp_path, pair_perturbed, command):
    from fixtures.cli import GREEDY_ARGS, assert_one_line_error, specli, write_jsonl

    where = [str(write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}]))] if command == "batch" else ["--port", "0"]
    result = specli(command, *where, "-m", str(pair_perturbed[0]), "--lookup", "--memory", "process", "--branches", "2",
                    "--parallel", "2", *GREEDY_ARGS)
    assert_one_line_error(result, 2, "--branches 2", "--parallel 1")


def test_run_with_branches_gives_the_target_only_tokens(pair_perturbed):
    import json

    from fixtures.cli import GREEDY_ARGS, specli

    prompt = "The quick brown fox jumps over the lazy dog. The quick brown"
    common = ["run", "-m", str(pair_perturbed[0]), *GREEDY_ARGS, "-n", "24", "--json", prompt]
    plain = json.loads(specli(*common, "--target-only").stdout)
    for _ in range(2):  # (the second run drafts from the first one's memory)
        result = specli(*common, "--lookup", "--memory", "persist", "--branches", "3", "--draft-max", "4", "-v")
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["token_ids"] == plain["token_ids"]


def test_greedy_with_a_repeat_penalty_and_branches_is_exact(models):
    from specli.decoding.memory_drafter import MemoryDrafter
    from specli.decoding.sampling import SamplingParams
    from specli.decoding.step import SpeculativeDecoder

    model, plain = models
    penalized = SamplingParams(temperature=0.0, repeat_penalty=1.5, repeat_last_n=64)
    ids = plain.tokenize(PROMPTS[1])
    plain.reset()
    reference = generate(SpeculativeDecoder(plain, None, 0, penalized), Request(ids, max_tokens=MAX_TOKENS)).run().token_ids
    model.reset()
    gen = generate(SpeculativeDecoder(model, MemoryDrafter(misleading_memory(ids, reference, seed=2)), 4, penalized), Request(ids, max_tokens=MAX_TOKENS))
    trees = sum(step.n_branches > 1 for step in gen)
    assert gen.token_ids == reference and trees


def test_batch_with_branches_gives_the_tokens_of_batch_without(tmp_path, pair_perturbed):
    from fixtures.cli import GREEDY_ARGS, read_records, specli, write_jsonl
    from fixtures.cli import PROMPTS as CLI_PROMPTS

    repeated = [CLI_PROMPTS[0], CLI_PROMPTS[1], CLI_PROMPTS[0], CLI_PROMPTS[1]]
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": p} for i, p in enumerate(repeated)])
    records = {}
    for name, extra in (("plain", ["--target-only"]), ("branches", ["--lookup", "--memory", "process", "--branches", "4", "--draft-max", "4"])):
        out = tmp_path / f"{name}.jsonl"
        result = specli("batch", str(src), "-o", str(out), "-m", str(pair_perturbed[0]), "--max-tokens", "24", "--quiet", *extra, *GREEDY_ARGS)
        assert result.returncode == 0, result.stderr
        records[name] = read_records(out)
    assert [r["token_ids"] for r in records["plain"]] == [r["token_ids"] for r in records["branches"]]


def test_tree_pass_on_gemma_with_default_numerics(gemma_path):
    """The real model (sliding-window layers, F16 cache, quantized weights): each node's logits
    as its branch's alone within batch numerics, which move with the pass's size (here a pass
    over 10 tokens against 8 moved the whole vocabulary's logits by up to 1.9, the top token's
    by up to 0.5): the top token's logit within 0.6, the same argmax where the top two are
    further apart."""
    init_backend()
    model = LlamaModel(gemma_path, n_ctx=512, n_threads=2, branches=3)
    try:
        prompt = model.tokenize("def mean(xs):\n    return sum(xs) / len(xs)\n\n# With type hints:\ndef mean(")
        branches = [model.tokenize("xs: list[float]) -> float:", add_bos=False), model.tokenize("values)", add_bos=False),
                    model.tokenize("xs: list[int])", add_bos=False)]
        tree = TokenTree.of(branches)
        model.eval(prompt[:-1], logits="none")
        rows = model.eval_tree(*tree_pass(prompt[-1], tree)).copy()
        model.keep_branch([0, *(1 + i for i in tree.paths[0][:3])])
        kept_next = model.eval([branches[0][3]], logits="last").copy()
        for b, branch in enumerate(branches):
            alone = plain_rows(model, prompt[:-1], [prompt[-1], *branch])
            mine = rows[[0, *(1 + i for i in tree.paths[b])]]
            top = alone.argmax(axis=1)
            at = np.arange(len(top))
            assert np.abs(mine[at, top] - alone[at, top]).max() < 0.6, b
            top2 = np.sort(alone, axis=1)[:, -2:]
            clear = top2[:, 1] - top2[:, 0] > 0.6
            assert (mine.argmax(axis=1) == top)[clear].all(), b
        # After keep_branch the cache goes on as one that evaluated the kept path.
        alone = plain_rows(model, prompt + branches[0][:3], [branches[0][3]])
        assert kept_next.argmax() == alone.argmax() and abs(kept_next[0, alone.argmax()] - alone.max()) < 0.6
    finally:
        model.close()
