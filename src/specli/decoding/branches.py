"""Several candidate continuations verified in one target pass (a token tree), where it pays.

Where earlier texts went different ways after the same words (a name, a date, an argument),
one draft must bet on one of them; a tree of drafts checks several in the same pass. The
branches share their common prefixes (a trie): each node is one token of the pass, its parent
the node before it (-1: the root, the pass's `last`). The target's row for a node predicts the
token after the node's path, so verification is greedy verification along each branch; the
longest accepted branch wins (verifier.verify_tree), and the cache keeps that branch alone
(LlamaModel.keep_branch).

Which branches, and whether a tree at all (Drafter.propose_branches: a MemoryDrafter's uses choose_branches): the step's own
draft (the chain) first, then the memory's other candidates (TokenMemory.lookup: continuations
with how many earlier places agree on each), up to `max_branches`. A wider pass must pay for
itself: with a cost table (--draft-max auto), a node outside the chain is kept only while the
chance that the text follows it (the share of the memory's places that agree on its path,
times BRANCH_ODDS) times a one-token pass's cost exceeds what the node adds to the pass, and
none beside a copy from the context; without one (a fixed --draft-max) --branches decides alone.
What trees gain and cost, replayed on the CPU and GPU-like tables: docs/memory.md.

Pure functions and data: nothing here talks to llama.cpp.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

MAX_BRANCHES = 8  # --branches' largest (each is a sequence of the target's context)
# What a node off the draft's path is worth per its share of the memory's places: such nodes are
# reached only where the draft is refused, and replayed (docs/memory.md) they were accepted
# about a quarter as often as their shares say.
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
                    costs: Callable[[int], float] | None = None, odds: float = BRANCH_ODDS) -> list[list[int]]:
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
