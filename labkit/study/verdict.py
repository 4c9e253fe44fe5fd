"""Faster, flat or slower: one verdict for a ratio of times, measured (the answer card) or predicted
(`labkit predict`), so that both say the same word for the same number.

`ratio` is the time at the larger batch over the time at the smaller one (per step, per epoch or to the
same loss). Within +-FLAT_BAND of 1 the time is "flat"; the card states the band beside its verdicts.
"""

from __future__ import annotations

import math
from typing import Literal

Verdict = Literal["faster", "flat", "slower"]
FLAT_BAND = 0.10  # +-10%: two runs of the same config on the 2-core CI machine differ by up to ~8% (README)


def verdict(ratio: float, band: float = FLAT_BAND) -> Verdict:
    """"faster" below 1 - band, "slower" above 1 + band, else "flat"."""
    if not math.isfinite(ratio) or ratio <= 0:
        raise ValueError(f"a ratio of times must be finite and positive, got {ratio!r}")
    if ratio < 1 - band:
        return "faster"
    if ratio > 1 + band:
        return "slower"
    return "flat"
