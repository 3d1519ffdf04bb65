"""Every tuned number of the `--draft-max auto` policy, grouped as docs/policy.md's "The rules
on a page" are. Each line says what it does, then the measurement that set it (pair, texts,
figure); the longer story is in docs/policy.md, under the constant's name or the rule's.

Where two rules needed the same kind of number, they share one: how noisy a timing may be
(NOISE), how much anything not measured in this run weighs (PRIOR_WEIGHT), how many
observations a first judgement takes (FIRST_LOOK), how often a settled decision is checked
again (RECHECK_EVERY). (store.py keeps its own limits, which say what a valid saved file is,
not how the policy decides.)
"""

from __future__ import annotations

# 1. Measure
PRIOR_SLOPE = 0.5  # T(n) = T(1) * (1 + PRIOR_SLOPE * (n - 1)) until two pass sizes are measured
# ... Qwen pair's wide passes cost 0.45-0.7 T(1) a token; at 0.1 lookup auto 1.046x plain, now 1.077x (156 Spec-Bench texts)
PRIOR_DRAFT_COST = 0.1  # t_draft / T(1) until a draft is measured
# ... 0.3 cost the Qwen pair's draft auto 2.51x -> 2.36x on the GPU-like table (101 Spec-Bench dev texts)
RECENT = 0.95  # weight of a wide pass in the cost line, and of a step in the going rate, per newer one (about the last 20)
# ... one mean per size left a size timed in a slow moment dear for good (a90 stuck at 4 or 8 drafts)
NOISE = 1.5  # timings of one thing on a shared machine differ by up to this factor: beyond it, a stall or another machine
# ... unclipped, a 50 ms stall lifted a70's 1 ms mean to 10.8 ms; CPU use per second is 2.0 quiet, 1.0 contended
CONTEXT_PRIOR = 4 * 100.0**2  # the context slope leans to its prior until passes' n * context differ this much
# ... (a regulariser: tests pass from 1 to 80,000; the slope it enables: a70 at 1.1x where prices without it held plain)

# 2. Estimate acceptance
PRIOR_ACCEPT = 0.7  # before anything is measured: optimistic (so the first steps draft and learn)
# ... at 0.4 the Qwen pair's draft auto lost 6.8% overall (GPU-like table, 101 Spec-Bench dev texts)
PRIOR_WEIGHT = 3.0  # verdicts or passes a prior, a neighbour's estimate or anything saved by an earlier run counts as
# ... at 1.5, the Qwen pair's draft auto warm lost 5.5% on rag (GPU-like table, 101 Spec-Bench dev texts)
DECAY = 0.97  # weight of older verdicts per new one: recent text counts most (a record holds about 33)
# ... at 0.94, the Qwen pair's draft auto warm lost 2.6% on writing (GPU-like table, 101 Spec-Bench dev texts)
COPY_BINS = (0, 4, 8, 16, 32, 64)  # match lengths at which a copying drafter's records begin
# ... one record held lookup plain on a checklist: 1.02 tokens per pass where a fixed N made 3.81 (issue 30)

# 3. Choose
FIRST_LOOK = 4  # observations a first judgement takes: a draft model's first drafting steps, a plain check's steps,
# the plain steps before a probe, own passes that confirm saved costs (a running mean weighs a new timing 1/FIRST_LOOK)
# ... a draft model's first timings run 2x slow; at 2 the Qwen pair's hybrid auto warm lost 2.4% on roleplay

# 4. Reach
REACH_MIN = 2  # accepted run (at least this) ... (and a probe's length: the shortest draft the policy considers)
REACH_COST = 1.25  # ... unless going further costs at most this times the pass at that reach
COPY_REACH = 0.5  # a copy after a match of m tokens reaches at least this times m
# ... a first reach of 16 (REACH_MIN 8) refused early costs a dozen plain passes on a CPU: Qwen pair, 156 texts

# 5. Stop what cannot pay
CEILING_ACCEPT = 0.95  # per-token acceptance no drafter is assumed to beat (a copy two earlier places agree on starts here)
# ... the Qwen pair was seen at 0.68-0.99 per reply; probing its 0.5B on this CPU cost -md auto 5% (0.946x -> 0.992x)

# 6. Probe what might
PROBE_BUDGET = 0.02  # probes that do not pay take at most this share of the time
# ... simulated pairs: at 0.01 a text that starts to pay is noticed too late, at 0.04 a sure-and-wrong draft is probed too often

# 7. Check again
RECHECK_EVERY = 256  # steps between plain checks while drafting; before a set-aside drafter is re-timed (doubling);
# until unrefuted saved costs are confirmed
# ... a70's stale plain estimate (2.8 ms, truly 2.4) drafted on where every fixed N lost 9%
