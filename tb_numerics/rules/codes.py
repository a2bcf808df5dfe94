"""The health codes: what a record, a timeline cell or a chart point is.

One code per health, by name, with the words the dashboard shows for it.
Codes are ordered by severity (a higher code is worse), so that the worst
health of a bucket of records is their maximum.
"""

from __future__ import annotations

import dataclasses

__all__ = ["HEALTH", "HEALTHY", "Health", "NONFINITE", "NO_DATA", "WARNING", "health_name"]

# A timeline cell with no record.
NO_DATA = -1
# Finite and inside the safe range.
HEALTHY = 0
# Finite, but outside the safe range (a warning kind names how).
WARNING = 1
# Any NaN, +Inf or -Inf (a -Inf where it is intended aside).
NONFINITE = 2


@dataclasses.dataclass(frozen=True)
class Health:
    """One health code: its number, its name (also the dashboard's colour) and its words."""

    code: int
    name: str
    words: str


# In the order the dashboard's legend lists them.
HEALTH = (
    Health(HEALTHY, "healthy", "healthy"),
    Health(WARNING, "warning", "warning"),
    Health(NONFINITE, "nonfinite", "non-finite (NaN/Inf)"),
    Health(NO_DATA, "nodata", "no record"),
)
_BY_CODE = {h.code: h for h in HEALTH}


def health_name(code: int) -> str:
    """The name of a health code ("nonfinite" for 2).

    Args:
      code: one of the codes above.

    Raises:
      KeyError: ``code`` is none of them.
    """
    return _BY_CODE[int(code)].name
