"""The one rule for a bound given in seconds: a positive, finite number (never a bool).

Standard library only: the conformance kit's pytest plugin, which imports dsh lazily,
checks its options with it too.
"""

from __future__ import annotations

import math

__all__ = ["is_positive_seconds"]


def is_positive_seconds(value: object) -> bool:
    """Whether ``value`` is a positive, finite ``int`` or ``float`` (a ``bool`` is no number of seconds).

    An int too large for a float counts as infinite: no timer could be set for it.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        number = float(value)
    except OverflowError:
        return False
    return math.isfinite(number) and number > 0
