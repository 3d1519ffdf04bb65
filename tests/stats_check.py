"""A goodness-of-fit test without scipy, shared by the sampling and engine tests."""

from __future__ import annotations

import math
from collections import Counter
from typing import Hashable


def chi_square_p_value(counts: Counter, law: dict[Hashable, float], draws: int) -> float:
    """Pearson's test of counts against law (cells expecting < 5 pooled), Wilson-Hilferty p-value."""
    stat, df = 0.0, -1
    pooled_obs = pooled_exp = 0.0
    for cell, prob in law.items():
        expected = draws * prob
        if expected < 5:
            pooled_obs += counts.get(cell, 0)
            pooled_exp += expected
            continue
        stat += (counts.get(cell, 0) - expected) ** 2 / expected
        df += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        df += 1
    # chi2(df)/df is close to normal after a cube root (Wilson & Hilferty 1931)
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))
