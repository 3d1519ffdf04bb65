"""Every tuned number of the `--draft-max auto` policy, grouped as docs/policy.md's "The rules
on a page" are. Each says what it does and the measurement that set it; the longer story of
each measurement is in docs/policy.md, under the constant's name.

(store.py keeps its own limits, which say what a valid saved file is, not how the policy decides.)
"""

from __future__ import annotations

# 1. Measure
PRIOR_SLOPE = 0.5  # T(n) = T(1) * (1 + PRIOR_SLOPE * (n - 1)) until two pass sizes are measured
PRIOR_DRAFT_COST = 0.1  # t_draft / T(1) until a draft is measured
COST_EMA = 0.2  # weight of the newest timing in a running mean of a duration
RECENT = 0.95  # weight of a wide pass in the cost line, and of a step in the going rate, per newer one (about the last 20)
CLIP = 1.5  # a timing counts at most this times its estimate; a pass at most this many one-token passes per token
CONTEXT_FORGET = 0.995  # weight of a pass in the context slope per newer pass (about 200 passes)
CONTEXT_PRIOR = 4 * 100.0**2  # the slope leans to 0 until passes' n * context differ this much
CONTENDED = 0.8  # a pass using less CPU per second than this share of the usual was slowed down

# 2. Estimate acceptance
PRIOR_ACCEPT = 0.7  # before anything is measured: optimistic (so the first steps draft and learn)
PRIOR_WEIGHT = 3.0  # pseudo-observations behind a prior or a neighbour's estimate
DECAY = 0.97  # weight of older observations per new one: recent text counts most
COPY_BINS = (0, 4, 8, 16, 32, 64)  # match lengths at which a copying drafter's records begin
COPY_WEIGHT_MAX = 16.0  # the current match counts as at most this many verdicts
COPY_AGREED = 0.95  # prior acceptance of a copied token a second earlier place agrees on
COPY_FORK = 0.5  # ... of the token where the two places differ

# 3. Choose
WARM_UP_DRAFTS = 4  # a draft model's first steps draft (keep still judges each token)

# 4. Reach
REACH_MIN = 2  # accepted run (at least this) ...
REACH_COST = 1.25  # ... unless going further costs at most this times the pass at that reach
COPY_REACH = 0.5  # a copy after a match of m tokens reaches at least this times m

# 5. Stop what cannot pay
CEILING_ACCEPT = 0.95  # a draft model's per-token acceptance it is never assumed to beat
CEILING_RECHECK = 256  # plain steps before such a drafter is probed again (doubling)

# 6. Probe what might
PROBE_LENGTH = 2
PROBE_EVERY_MIN = 4  # plain steps before a re-probe, at least
PROBE_BUDGET = 0.02  # probes that do not pay take at most this share of the time,
PROBE_FADE = 0.1  # evidence kept when a probe's verdict is news
PROBE_SURPRISE = 0.25  # a fully accepted probe is news only if the record gave it less than this

# 7. Plain checks
PLAIN_CHECK_EVERY_MIN = 128  # drafting steps before plain decoding is timed again, doubling after
PLAIN_CHECK_EVERY_MAX = 1024  # each check up to this (a long serve must still notice a machine that changed)
PLAIN_CHECK_STEPS = 4  # plain steps of a check: the first runs on caches the drafter filled
PLAIN_CHECK_MARGIN = 1.5  # no check where drafting is expected to beat plain by more than this

# 8. Between runs
SEED_WEIGHT = 2.0  # pseudo-passes a saved pass cost counts as
SEED_TRUST = 1.5  # saved costs are dropped when a run's own passes differ by more than this factor
SEED_CHECKS = 3  # own passes of each kind (one-token, wide) that confirm or refute them
FIRST_PASS_SLOWER = 1.2  # the first pass of a size in a process, against later ones
SEED_WATCH = 256  # steps after which saved costs that were never refuted are taken as confirmed
SAVED_ACCEPT_WEIGHT = 2.0  # verdicts per draft position a saved acceptance record counts as
SAVED_CALIBRATION_WEIGHT = 3.0  # likewise per confidence bin of a draft model
