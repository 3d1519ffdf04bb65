"""Several candidate continuations verified in one target pass (a token tree), where it pays.

Where earlier texts went different ways after the same words (a name, a date, an argument),
one draft must bet on one of them; a tree of drafts checks several in the same pass. The
branches share their common prefixes (a trie): each node is one token of the pass, its parent
the node before it (-1: the root, the pass's `last`). The target's row for a node predicts the
token after the node's path, so verification is greedy verification along each branch; the
longest accepted branch wins (verify_tree), and the cache keeps that branch alone
(LlamaModel.keep_branch).

Which branches, and whether a tree at all (plan_branches, choose_branches): the step's own
draft (the chain) first, then the memory's other candidates (TokenMemory.lookup: continuations
with how many earlier places agree on each), up to `max_branches`. A wider pass must pay for
itself: with a cost table (--draft-max auto), a node outside the chain is kept only while the
chance that the text follows it (the share of the memory's places that agree on its path,
times BRANCH_ODDS) times a one-token pass's cost exceeds what the node adds to the pass, and
none beside a copy from the context; without one (a fixed --draft-max) --branches decides alone.
Replayed (benchmarks/branch_replay.py, in git history at 048e22a; memory_replay's workloads and 160 Spec-Bench texts): on
the 2-core CPU table a tree at a fixed --branches costs 2-54% of the chain's speed, the judged
one almost never branches (within 0.1%); on a flat (GPU-like) table the judged tree gains 1-2%
on Spec-Bench (1-5% per category), up to 8% on repeated tool calls, -1% on code at 16.

Pure functions and data: nothing here talks to llama.cpp.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from specli.decoding.memory_drafter import MEMORY
from specli.decoding.verify import Verdict, verify_greedy

MAX_BRANCHES = 8  # --branches' largest (each is a sequence of the target's context)
BRANCH_SOURCE = MEMORY  # the stats' source of tokens accepted on a branch other than the draft's
# What a node off the draft's path is worth per its share of the memory's places: such nodes are
# reached only where the draft is refused, and replayed (benchmarks/branch_replay.py at 048e22a: the written
# workloads and Spec-Bench) they were accepted about a quarter as often as their shares say.
BRANCH_ODDS = 0.25


@dataclass(frozen=True)
class TokenTree:
    """Branches merged on their common prefixes. Nodes come parents first; `paths[b]` is
    branch b's node indices, root to leaf."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]  # -1: the root (the pass's first token, `last`)
    paths: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, branches: Sequence[Sequence[int]]) -> "TokenTree":
        tokens: list[int] = []
        parents: list[int] = []
        children: dict[tuple[int, int], int] = {}
        paths = []
        for branch in branches:
            at, path = -1, []
            for token in branch:
                node = children.get((at, int(token)))
                if node is None:
                    node = children[(at, int(token))] = len(tokens)
                    tokens.append(int(token))
                    parents.append(at)
                path.append(node)
                at = node
            paths.append(tuple(path))
        return cls(tuple(tokens), tuple(parents), tuple(paths))

    @property
    def width(self) -> int:
        """Tokens in the pass: the root and every node."""
        return len(self.tokens) + 1

    def branch(self, b: int) -> list[int]:
        return [self.tokens[i] for i in self.paths[b]]


def distinct_branches(chain: Sequence[int], others: Sequence[Sequence[int]], n_max: int, max_branches: int) -> list[list[int]]:
    """The chain (when not empty), then the others cut to n_max tokens, skipping any that is
    empty or a prefix of a branch already taken (it would add no node), up to max_branches.
    A branch may be a prefix of a later one (see maximal)."""
    out: list[list[int]] = [list(chain)] if chain else []
    for other in others:
        if len(out) >= max_branches:
            break
        t = [int(x) for x in other[:n_max]]
        if t and not any(b[: len(t)] == t for b in out):
            out.append(t)
    return out


def maximal(branches: Sequence[Sequence[int]]) -> list[list[int]]:
    """The branches that are no prefix of another (the same tree), in their order."""
    out = []
    for i, b in enumerate(branches):
        longer = any(len(o) > len(b) and list(o[: len(b)]) == list(b) for o in branches)
        same = any(list(o) == list(b) for o in branches[:i])
        if not longer and not same:
            out.append(list(b))
    return out


def node_chances(tree: TokenTree, candidates: Sequence[tuple[Sequence[int], int]]) -> list[float]:
    """Per node, the share of the candidates' places (count each) whose continuation starts
    with the node's path: the memory's odds that the text follows that path."""
    total = sum(count for _, count in candidates)
    if total <= 0:
        return [0.0] * len(tree.tokens)
    index = {}  # path tuple -> node
    for path in tree.paths:
        for depth, node in enumerate(path):
            index[tuple(tree.tokens[i] for i in path[: depth + 1])] = node
    share = [0.0] * len(tree.tokens)
    for tokens, count in candidates:
        for depth in range(len(tokens)):
            node = index.get(tuple(tokens[: depth + 1]))
            if node is None:
                break
            share[node] += count / total
    return share


def choose_branches(chain: Sequence[int], candidates: Sequence[tuple[Sequence[int], int]], n_max: int, max_branches: int,
                    costs: Callable[[int], float] | None = None, odds: float = BRANCH_ODDS) -> list[list[int]]:  # fmt: skip
    """The branches of this step's pass: [chain] alone (or [] without one) when no other
    branch is worth it. `candidates`: (tokens, count) of the memory's continuations, best
    first. Without `costs` (a fixed --draft-max) up to max_branches distinct branches; with
    `costs` (width -> seconds of a pass) a node outside the chain is kept while its chance
    (node_chances times `odds`) times costs(1) exceeds what it adds to the pass, its parent
    being kept."""
    branches = distinct_branches(chain, [c for c, _ in candidates], n_max, max_branches)
    if costs is None or len(branches) <= (1 if chain else 0):
        return maximal(branches)
    tree = TokenTree.of(branches)
    chance = node_chances(tree, candidates)
    kept = set(tree.paths[0]) if chain else set()
    width = len(kept) + 1
    one = costs(1)
    # Most likely first (a child is never likelier than its parent; shallower first on a tie).
    depth = [0] * len(tree.tokens)
    for i, parent in enumerate(tree.parents):
        depth[i] = 0 if parent < 0 else depth[parent] + 1
    for node in sorted(range(len(tree.tokens)), key=lambda i: (-chance[i], depth[i])):
        if node in kept or (tree.parents[node] >= 0 and tree.parents[node] not in kept):
            continue
        if chance[node] * odds * one > costs(width + 1) - costs(width):
            kept.add(node)
            width += 1
    # (kept nodes are closed under parents: on each path they are a prefix of it)
    return maximal([[tree.tokens[i] for i in path if i in kept] for path in tree.paths])


def plan_branches(drafter, context: Sequence[int], chain: Sequence[int], n_max: int, max_branches: int,
                  costs: Callable[[int], float] | None = None, source: str | None = None) -> list[list[int]]:  # fmt: skip
    """This step's branches for `drafter`, whose proposal is `chain` (from `source`): its own
    `propose_branches` (context, chain, n_max, max_branches, costs) if it has one, else
    choose_branches over the continuations its `memory` (a TokenMemory: a MemoryDrafter's)
    finds after the context; [chain] for any other drafter. With `costs`, none beside a copy
    from the context (a chain of another source than the memory): the memory's odds say
    nothing of a text that repeats itself (replayed on Spec-Bench, such branches cost up to 1%
    on the CPU table, gained under 0.5% on the flat one)."""
    own = getattr(drafter, "propose_branches", None)
    if own is not None:
        return own(context, chain, n_max, max_branches, costs)
    if costs is not None and chain and source != MEMORY:
        return [list(chain)]
    memory = getattr(drafter, "memory", None)
    found = memory.lookup(context, n_max) if memory is not None and n_max > 0 else []
    if not found:
        return [list(chain)] if chain else []
    return choose_branches(chain, [(c.tokens, c.count) for c in found], n_max, max_branches, costs)


@dataclass(frozen=True)
class TreeVerdict:
    """verify_tree's outcome: the accepted branch (its index in the tree's paths) and its verdict."""

    branch: int
    verdict: Verdict


def verify_tree(rows: np.ndarray | Sequence[np.ndarray], tree: TokenTree, row_of=None) -> TreeVerdict:
    """Greedy verification of every branch: rows[0] is the root's (the pass's `last`), rows[1 + i]
    node i's. The branch whose agreeing prefix is longest wins (the first such on a tie); its
    verdict is the one a pass over that branch alone gives. `row_of(node_rows, branch)`: the
    rows as verify_greedy reads them (e.g. with a repetition penalty), default the rows."""
    best: TreeVerdict | None = None
    for b, path in enumerate(tree.paths or ((),)):
        node_rows = [rows[0]] + [rows[1 + i] for i in path]
        draft = [tree.tokens[i] for i in path]
        verdict = verify_greedy(row_of(node_rows, draft) if row_of else node_rows, draft)
        if best is None or verdict.n_accepted > best.verdict.n_accepted:
            best = TreeVerdict(b, verdict)
    assert best is not None
    return best
