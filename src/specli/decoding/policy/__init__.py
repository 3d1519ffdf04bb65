"""`--draft-max auto`: how many tokens to draft each step, and what is kept between runs.

- judge.py: what a drafter asks while proposing (DraftJudge; FIXED, the judge of a fixed --draft-max);
- costs.py: what a target pass costs (PassCost, ContextSlope, running_time);
- acceptance.py: how likely drafts are accepted, and the length that pays best;
- adaptive.py: the `--draft-max auto` policy itself (AdaptivePolicy), built on those;
- store.py: its saved file, read and written between runs.

The design and the measurements behind each rule: docs/policy.md.
"""

from specli.decoding.policy.adaptive import AdaptivePolicy, StepReport
from specli.decoding.policy.judge import FIXED, DraftJudge

__all__ = ["FIXED", "AdaptivePolicy", "DraftJudge", "StepReport"]
