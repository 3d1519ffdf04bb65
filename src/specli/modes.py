"""How a generation drafts: one vocabulary from the options (session.loading's Plan) down to the
drafters (decoding.drafters.make_drafter), and in JSON and policy files, where a mode is its
value."""

from __future__ import annotations

import enum


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
