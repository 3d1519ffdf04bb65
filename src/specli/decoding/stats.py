"""Run statistics, each defined in plain words.

- drafted: draft tokens sent to the target for checking.
- accepted: draft tokens the target agreed with.
- acceptance_rate = accepted / drafted (None when nothing was drafted).
- target_passes: target decodes during generation, one per step; the first step's also holds
  the prompt's end (the part after its whole passes of one batch: the first tokens come from the
  pass that finishes the prompt, as llama-server's do); the prompt's other passes are not counted.
- decided: tokens the target's passes decided: the generated tokens, plus the end-of-generation
  token that ended a reply and any tokens a stop string cut off (a pass made them too).
- mean_tokens_per_pass = decided / target passes: exactly 1.0 for plain decoding (a reply that
  ends at EOS included), and 1 + accepted/passes when drafting.
- tokens_per_s = tokens decided by the passes after the prompt's last one / their time (the
  generation time): the speed of decoding, prompt processing excluded, as llama.cpp's "eval
  time" counts it. The tokens of the prompt's last pass (the first one or few) are the prompt's
  (prompt_s); None when that pass decided them all (a one-token reply has no decoding speed).
- prompt_s: time to put the prompt into the target's (and the draft model's) cache, the pass
  that finishes it included; in `serve` with several slots, from the first of its batches to
  the last, the other slots' passes between them included.
- prompt_reused: prompt tokens already in the target's cache from an earlier generation (a chat's
  history), so not evaluated again; prompt_tokens - prompt_reused were evaluated.
- draft_s: time spent proposing drafts; verify_s: time in target passes and verification;
  constraint_s: a constraint's masks and bookkeeping (part of both; 0 without one).
- wall_s: prompt_s + generation time, all in.
- draft_lengths[k]: target passes that checked k drafts (with `--draft-max auto`, the lengths the
  policy chose); mean_draft_length = drafted / target_passes.
- by_source: drafted and accepted per drafter ("lookup", "draft-model"): the hybrid drafter
  uses both.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Stats:
    n_tokens: int = 0
    decided: int = 0  # see the module docstring
    prompt_pass_decided: int = 0  # ... of them, by the pass that finished the prompt
    drafted: int = 0
    accepted: int = 0
    target_passes: int = 0
    prompt_tokens: int = 0
    prompt_reused: int = 0
    prompt_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    constraint_s: float = 0.0
    generation_s: float = 0.0
    # accepted_at[i]: steps in which the draft token at position i (0-based) was accepted;
    # drafted_at[i]: steps that drafted a token at position i. Per-position acceptance.
    accepted_at: list[int] = field(default_factory=list)
    drafted_at: list[int] = field(default_factory=list)
    draft_lengths: list[int] = field(default_factory=list)
    by_source: dict[str, list[int]] = field(default_factory=dict)  # source -> [drafted, accepted]

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_tokens_per_pass(self) -> float | None:
        return self.decided / self.target_passes if self.target_passes else None

    @property
    def tokens_per_s(self) -> float | None:
        decoded = self.decided - self.prompt_pass_decided
        return decoded / self.generation_s if decoded > 0 and self.generation_s > 0 else None

    @property
    def mean_draft_length(self) -> float | None:
        return self.drafted / self.target_passes if self.target_passes else None

    @property
    def wall_s(self) -> float:
        return self.prompt_s + self.generation_s

    def record_step(self, n_drafted: int, n_accepted: int, n_emitted: int, source: str | None = None,
                    n_decided: int | None = None) -> None:
        """Count one target pass that checked `n_drafted` drafts (from `source`), emitted
        `n_emitted` tokens and decided `n_decided` (default: n_emitted; more when it also made
        the end-of-generation token, or tokens a stop string cut off)."""
        assert 0 <= n_accepted <= n_drafted
        self.target_passes += 1
        self.drafted += n_drafted
        self.accepted += n_accepted
        self.n_tokens += n_emitted
        self.decided += n_emitted if n_decided is None else n_decided
        _add_counts(self.drafted_at, [1] * n_drafted)
        _add_counts(self.accepted_at, [1] * n_accepted)
        _add_counts(self.draft_lengths, [0] * n_drafted + [1])
        if source is not None:
            _add_counts(self.by_source.setdefault(source, [0, 0]), [n_drafted, n_accepted])

    def drafting_summary(self) -> list[str]:
        """The drafting part of a one-line summary: acceptance, then drafts and tokens per pass."""
        rate = self.acceptance_rate
        parts = [f"accepted {rate:.0%} ({self.accepted}/{self.drafted})" if rate is not None else "nothing drafted"]
        if self.drafted and self.mean_tokens_per_pass:
            # "drafted/pass 0.5", not "0.5 drafted": a mean per pass, not a count.
            parts.append(f"drafted/pass {self.mean_draft_length:.1f}, {self.mean_tokens_per_pass:.2f} tokens per pass")
        return parts

    def add(self, other: "Stats") -> None:
        """Add another run's counts and times to these (session totals)."""
        for name in ("n_tokens", "decided", "prompt_pass_decided", "drafted", "accepted", "target_passes", "prompt_tokens", "prompt_reused",
                     "prompt_s", "draft_s", "verify_s", "constraint_s", "generation_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine, theirs in ((self.drafted_at, other.drafted_at), (self.accepted_at, other.accepted_at),
                             (self.draft_lengths, other.draft_lengths)):
            _add_counts(mine, theirs)
        for source, totals in other.by_source.items():
            _add_counts(self.by_source.setdefault(source, [0, 0]), totals)

    def to_dict(self) -> dict:
        """The `stats` object of `--json` (times in seconds)."""
        rnd = lambda x: None if x is None else round(x, 4)  # noqa: E731
        return {
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": rnd(self.acceptance_rate),
            "target_passes": self.target_passes,
            "mean_tokens_per_pass": rnd(self.mean_tokens_per_pass),
            "tokens_per_s": rnd(self.tokens_per_s),
            "prompt_tokens": self.prompt_tokens,
            "prompt_reused": self.prompt_reused,
            "prompt_s": rnd(self.prompt_s),
            "draft_s": rnd(self.draft_s),
            "verify_s": rnd(self.verify_s),
            **({"constraint_s": rnd(self.constraint_s)} if self.constraint_s else {}),
            "wall_s": rnd(self.wall_s),
            "acceptance_by_position": [
                round(a / d, 4) for a, d in zip(self.accepted_at, self.drafted_at) if d
            ],
            "mean_draft_length": rnd(self.mean_draft_length),
            "draft_lengths": self.draft_lengths,
            "by_source": {
                source: {"drafted": d, "accepted": a, "acceptance_rate": rnd(a / d if d else None)}
                for source, (d, a) in self.by_source.items()
            },
        }


def _add_counts(counts: list[int], more: list[int]) -> None:
    """counts[i] += more[i] for every i, growing `counts` with zeros where it is shorter."""
    counts.extend([0] * (len(more) - len(counts)))
    for i, n in enumerate(more):
        counts[i] += n
