"""What a drafter asks while proposing, and the judge of a fixed `--draft-max`."""

from __future__ import annotations


class DraftJudge:
    """What a drafter asks while proposing. This one drafts exactly as asked (fixed --draft-max).

    A proposal asks `limit` once, then, when the judge `wants_confidence` and the drafter knows
    it, `keep` for each token and `last` after each kept one. The answers of one proposal belong
    to that proposal alone (the adaptive judge holds them in its `plan`, made by `limit`).
    """

    wants_confidence = False  # whether `keep` is to be asked (it needs the draft's probabilities)

    def limit(self, source: str, n_max: int, context_len: int = 0, match: int = 0, agreed: int | None = None,
              cap: int | None = None) -> int:
        """How many tokens of `source` are worth proposing now (0 = none), at most n_max, the
        context being context_len tokens long. A drafter that copies the text (prompt lookup)
        tells its evidence: `match`, how many tokens at the end of the context repeat those
        before the copied place (0 = none); `agreed`, how many leading tokens of the copy a
        second earlier place agrees on (None: no second place; the text often forks where they
        differ); `cap`, how many its own rules vouch for (None: all). This judge drafts up to
        the cap."""
        return n_max if cap is None else max(min(n_max, cap), 0)

    def resting(self, source: str) -> bool:
        """Whether `source` is set aside for now (its measured costs cannot pay): a draft model
        then need not read a new prompt into its cache. This judge sets none aside."""
        return False

    def keep(self, source: str, position: int, confidence: float) -> bool:
        """Whether the draft token at `position`, which the drafter gives this probability,
        is worth sending to the target (False ends the proposal before it)."""
        return True

    def last(self) -> bool:
        """Whether the token `keep` has just kept is to end the proposal: no draft pass to see
        the next one."""
        return False


FIXED = DraftJudge()
