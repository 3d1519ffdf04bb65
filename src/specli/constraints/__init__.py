"""Constraints on the output: a JSON schema, a Lark or GBNF grammar, or a regular expression,
enforced by llguidance (the `structured` extra). docs/constraints.md says how a constraint
meets the step: it masks every verified row, cuts drafts at their first forbidden token,
drafts its own forced tokens, and advances on the tokens a step emits.

`Grammar` is what a user asked for, checked before any model loads; `Constraint` is that
grammar on one model's vocabulary, and makes one `Matcher` per sequence (Request.constraint).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from specli.errors import UsageError
from specli.llama.grammar import grammar_tokenizer, import_llguidance
from specli.llama.model import LlamaModel

KINDS = ("json_schema", "lark", "gbnf", "regex")
MAX_GRAMMAR_CHARS = 1_000_000  # a larger grammar or schema is refused before it is compiled
# JSON written compactly or with fixed separators: free whitespace would let a model pad forever
# and leave no span forced. "compact": {"a":1}; "spaced" (the default): {"a": 1, "b": 2}.
JSON_STYLES = {
    "compact": {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"},
    "spaced": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
}


class GrammarError(UsageError):
    """A grammar or schema that does not compile (exit 2): the engine's message names where."""


@dataclass(frozen=True)
class Grammar:
    """A constraint as asked: its kind (KINDS) and text, checked (`check`) before any model loads."""

    kind: str
    text: str
    json_style: str = "spaced"
    where: str = "the grammar"  # how the user gave it, for messages ("--json-schema", "response_format")

    def lark(self) -> str:
        """The grammar in llguidance's own form (raises GrammarError)."""
        llg = import_llguidance()
        if len(self.text) > MAX_GRAMMAR_CHARS:
            raise GrammarError(f"{self.where} is {len(self.text):,} characters; at most {MAX_GRAMMAR_CHARS:,}")
        try:
            if self.kind == "json_schema":
                schema = json.loads(self.text)
                if not isinstance(schema, (dict, bool)):
                    raise GrammarError(f"{self.where}: a JSON schema must be an object or a boolean, got {type(schema).__name__}")
                return llg.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_STYLES[self.json_style])
            if self.kind == "lark":
                return llg.LLMatcher.grammar_from_lark(self.text)
            if self.kind == "regex":
                return llg.LLMatcher.grammar_from_regex(self.text)
            if self.kind == "gbnf":
                return llg.grammar_from("gbnf", self.text)
        except json.JSONDecodeError as err:
            raise GrammarError(f"{self.where} is not valid JSON: {err.msg} at line {err.lineno} column {err.colno}") from None
        except (ValueError, RecursionError) as err:
            raise GrammarError(f"{self.where} does not compile: {_one_line(str(err))}") from None
        raise GrammarError(f"unknown grammar kind {self.kind!r}; expected one of {', '.join(KINDS)}")

    def check(self) -> str:
        """The compiled grammar text; GrammarError naming the problem when it does not compile
        (no tokenizer needed: this runs before a model loads)."""
        llg = import_llguidance()
        lark = self.lark()
        problem = llg.LLMatcher.validate_grammar(lark, None)
        if problem:
            raise GrammarError(f"{self.where} does not compile: {_one_line(problem)}")
        return lark


_EXECUTOR: list[Any] = []  # llguidance's mask workers: one for the process (one thread: the loop runs on one)


def _executor(llg: Any) -> Any:
    if not _EXECUTOR:
        _EXECUTOR.append(llg.LLExecutor(num_threads=1))
    return _EXECUTOR[0]


def _one_line(message: str) -> str:
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return lines[0] if len(lines) <= 1 else f"{lines[0]} ({' '.join(lines[1:3])})"


class Constraint:
    """A grammar on one model's vocabulary: Request.constraint. Each sequence gets its own
    Matcher (`start`)."""

    def __init__(self, grammar: Grammar, model: LlamaModel):
        self.grammar = grammar
        self._lark = grammar.lark()
        self._tokenizer = grammar_tokenizer(model)
        self.n_vocab = model.n_vocab
        self._llg = import_llguidance()
        problem = self._llg.LLMatcher.validate_grammar(self._lark, self._tokenizer)
        if problem:
            raise GrammarError(f"{grammar.where} does not compile: {_one_line(problem)}")

    def start(self) -> Matcher:
        return Matcher(self._llg.LLMatcher(self._tokenizer, self._lark, log_level=0), self.n_vocab, self._llg)


class Matcher:
    """One sequence's place in its grammar (vLLM's structured-output verbs). Every token it is
    told to accept was allowed by its masks, so it never enters llguidance's error state."""

    def __init__(self, matcher: Any, n_vocab: int, llg: Any):
        self._m, self.n_vocab, self._llg = matcher, n_vocab, llg

    def forced(self, n_max: int) -> list[int]:
        """The tokens the grammar forces next (at most n_max): a draft that is never wrong about
        the grammar; the target still verifies it, so its tokenization stays the model's choice."""
        if self._m.is_stopped():
            return []
        return list(self._m.compute_ff_tokens())[:n_max]

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of a draft the grammar allows (its state unchanged)."""
        return int(self._m.validate_tokens(list(tokens))) if tokens else 0

    def masks(self, draft: Sequence[int]) -> np.ndarray:
        """Bitmask rows (int32, 32 tokens a word) of the allowed tokens before each draft token
        and after the whole draft: len(draft) + 1 rows, the state unchanged. The draft must be
        allowed (valid_prefix)."""
        llnp = self._llg.numpy
        rows = llnp.allocate_token_bitmask(len(draft) + 1, self.n_vocab)
        if not draft:
            llnp.fill_next_token_bitmask(self._m, rows, 0)
            return rows
        llnp.fill_next_token_bitmask_par_with_draft_tokens(_executor(self._llg), [(self._m, 0, list(draft))], rows)
        # The row after the whole draft once more, from the state the draft leads to: llguidance
        # leaves it unwritten where the draft's last token ends the grammar (only an end may follow).
        if not self._m.consume_tokens(list(draft)):
            raise UsageError(f"internal: the grammar refused a draft it allowed ({self._m.get_error()}); please report it")
        llnp.fill_next_token_bitmask(self._m, rows, len(draft))
        self._m.rollback(len(draft))
        return rows

    def accept(self, tokens: Sequence[int], is_eog) -> None:
        """The tokens a step emitted (an end-of-generation token ends the generation: not fed)."""
        tokens = [t for t in tokens if not is_eog(t)]
        if tokens and not self._m.consume_tokens(tokens):
            raise UsageError(f"internal: the grammar refused tokens it allowed ({self._m.get_error()}); please report it")

    @property
    def done(self) -> bool:
        """Nothing but the end of the generation can follow."""
        return bool(self._m.is_stopped())
