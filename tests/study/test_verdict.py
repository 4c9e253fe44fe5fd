import math

import pytest

from labkit.study.verdict import FLAT_BAND, verdict


@pytest.mark.parametrize(("ratio", "expected"), [(0.17, "faster"), (0.899, "faster"), (0.9, "flat"), (1.0, "flat"),
                                                  (1.1, "flat"), (1.101, "slower"), (10.9, "slower")])
def test_verdict_follows_the_ratio_with_a_ten_percent_band(ratio, expected):
    assert FLAT_BAND == 0.10
    assert verdict(ratio) == expected


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_a_ratio_that_is_no_ratio_of_times_is_refused(bad):
    with pytest.raises(ValueError, match="finite and positive"):
        verdict(bad)
