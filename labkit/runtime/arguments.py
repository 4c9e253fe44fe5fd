"""Checks of the values a notebook cell passes to the lab's functions, one message for each kind of mistake.

A learner types `2.5`, `"4"`, `True` or `0` where a count belongs; Python takes each of them somewhere (`True` is 1,
`range("4")` fails deep inside torch), so every function that takes a count checks it here first and names it.
"""

from __future__ import annotations

import numbers
from typing import Any


def whole_number(name: str, value: Any, minimum: int = 1, maximum: int | None = None) -> int:
    """`value` as an int in [minimum, maximum], else a ValueError naming `name` and the range. bool is refused
    though it is an Integral (`True` GPUs read as 1); numpy's integers are taken."""
    whole = not isinstance(value, bool) and isinstance(value, numbers.Integral)
    if not whole or int(value) < minimum or (maximum is not None and int(value) > maximum):
        upto = f" and <= {maximum:,}" if maximum is not None else ""
        raise ValueError(f"{name} must be a whole number >= {minimum}{upto}, got {value!r}")
    return int(value)
