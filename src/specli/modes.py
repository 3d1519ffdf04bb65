"""How a generation drafts: one vocabulary from the options (session.loading's Plan) down to the
drafters (decoding.drafters.make_drafter) and the engine, and in JSON and policy files, where a
mode is its value: DraftMode (what drafts) and DraftLength (how many tokens a step drafts)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class DraftMode(str, enum.Enum):
    DRAFT_MODEL = "draft-model"  # a small draft model
    LOOKUP = "lookup"  # prompt lookup: n-grams of the prompt and output so far
    HYBRID = "hybrid"  # lookup, else the draft model
    TARGET_ONLY = "target-only"  # no drafting: plain decoding

    # A mode is its value: in messages, JSON and f-strings, and as a key beside plain strings
    # (a policy file read back, a mode typed on the command line).
    __str__ = str.__str__
    __hash__ = str.__hash__

    @property
    def needs_draft_model(self) -> bool:
        return self in (DraftMode.DRAFT_MODEL, DraftMode.HYBRID)


MAX_DRAFT = 64  # draft lengths beyond this only waste target work
AUTO_MAX_DRAFT = 64  # the longest draft `--draft-max auto` considers (text copied verbatim pays up to native's 48-64)
_AUTO = "auto"


@dataclass(frozen=True)
class DraftLength:
    """How many tokens one step may draft: a fixed number (1 .. MAX_DRAFT), or auto, where the
    policy (decoding/policy) chooses each step's length up to `maximum`; `off()` is no drafting
    (a decoder without a drafter, bench's target-only runs). One value from the options
    (`--draft-max`, parsed by `parse`) down to the engine.

    str() is what the user would type ("auto" or "N"); `json_value` what the JSON output holds
    ("auto" or the number, 0 for off)."""

    fixed: int | None  # the fixed length; None for auto; 0 for off
    maximum: int  # the most drafts one step may take: auto's cap, else the fixed length (0: off)

    def __post_init__(self) -> None:
        if self.fixed is None:
            ok = 1 <= self.maximum <= MAX_DRAFT
        else:
            ok = self.maximum == self.fixed and (0 <= self.fixed <= MAX_DRAFT)
        if not ok:
            raise ValueError(f"not a draft length: fixed={self.fixed!r}, maximum={self.maximum!r}")

    @classmethod
    def auto(cls, maximum: int = AUTO_MAX_DRAFT) -> DraftLength:
        """Chosen each step by the policy, up to `maximum` drafts."""
        return cls(None, maximum)

    @classmethod
    def fixed_at(cls, n: int) -> DraftLength:
        """n drafts every step (1 .. MAX_DRAFT; ValueError otherwise)."""
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_DRAFT:
            raise ValueError(f"a fixed draft length is a whole number from 1 to {MAX_DRAFT}, got {n!r}")
        return cls(n, n)

    @classmethod
    def off(cls) -> DraftLength:
        """No drafting: plain decoding."""
        return cls(0, 0)

    @classmethod
    def parse(cls, text: str) -> DraftLength:
        """`--draft-max`'s value as typed: "auto" (any case) or a whole number of drafts from 1 to
        MAX_DRAFT. Raises ValueError saying what is wrong (callers put it in their own words)."""
        text = text.strip()
        if text.lower() == _AUTO:
            return cls.auto()
        try:
            n = int(text)
        except ValueError:
            raise ValueError(f"'{text}' is not a number") from None
        if not 1 <= n <= MAX_DRAFT:
            raise ValueError(f"got {n}")
        return cls.fixed_at(n)

    @classmethod
    def of(cls, value: DraftLength | int | str) -> DraftLength:
        """A library caller's draft length (tests, benchmarks): a DraftLength, "auto" or a whole
        number from 1 to MAX_DRAFT. ValueError for anything else, off included (a drafter with
        nothing to draft)."""
        if isinstance(value, DraftLength):
            length = value
        elif value == _AUTO:
            length = cls.auto()
        elif isinstance(value, int) and 1 <= value <= MAX_DRAFT:
            length = cls.fixed_at(int(value))
        else:
            raise ValueError(f"a draft length is 'auto' or between 1 and {MAX_DRAFT}, got {value!r}")
        if length.is_off:
            raise ValueError(f"a draft length is 'auto' or between 1 and {MAX_DRAFT}, got {length}")
        return length

    @property
    def is_auto(self) -> bool:
        return self.fixed is None

    @property
    def is_off(self) -> bool:
        return self.fixed == 0

    @property
    def json_value(self) -> int | str:
        """As the JSON output writes it: "auto", or the number (0 for off)."""
        return _AUTO if self.fixed is None else self.fixed

    def __str__(self) -> str:
        return _AUTO if self.fixed is None else str(self.fixed)
