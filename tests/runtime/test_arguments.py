"""The one check of a count a notebook cell passes: what it takes, what it refuses, and what the refusal says."""

from __future__ import annotations

import numpy as np
import pytest

from labkit.runtime.arguments import whole_number


def test_a_whole_number_in_range_comes_back_as_an_int():
    assert whole_number("n", 3) == 3
    taken = whole_number("n", np.int64(7))  # a numpy count (a table's cell) is a count too
    assert taken == 7 and type(taken) is int
    assert whole_number("n", 0, minimum=0) == 0
    assert whole_number("n", 10, maximum=10) == 10


@pytest.mark.parametrize("value,minimum,maximum,message", [
    (True, 1, None, "gpus must be a whole number >= 1, got True"),  # an Integral that reads as 1
    (2.5, 1, None, "gpus must be a whole number >= 1, got 2.5"),
    (4.0, 1, None, "gpus must be a whole number >= 1, got 4.0"),
    ("4", 1, None, "gpus must be a whole number >= 1, got '4'"),
    (None, 1, None, "gpus must be a whole number >= 1, got None"),
    (0, 1, None, "gpus must be a whole number >= 1, got 0"),
    (-1, 0, None, "gpus must be a whole number >= 0, got -1"),
    (11, 1, 10, "gpus must be a whole number >= 1 and <= 10, got 11"),
    (10**12, 1, 10**7, "gpus must be a whole number >= 1 and <= 10,000,000, got 1000000000000"),
])
def test_anything_else_is_refused_naming_the_argument_and_its_range(value, minimum, maximum, message):
    with pytest.raises(ValueError) as refused:
        whole_number("gpus", value, minimum=minimum, maximum=maximum)
    assert str(refused.value) == message
