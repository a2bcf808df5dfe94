"""How numbers are written: in words for people, and in JSON for programs.

In words (banners, warnings' details, hints, the report, the dashboard's
tooltips and axes), one format, which the dashboard receives from the
``/rules`` route (``NUMBER_FORMAT``) and follows (``frontend/format.js``;
``tests/test_rules_frontend.py`` compares the two on a table of numbers):

  * ``digits`` (4) significant digits in plain notation where the rounded
    magnitude is in [``fixed_from``, ``fixed_below``): "4000", "0.0123";
  * otherwise ``exp_digits`` (3) significant digits with an exponent and no
    "+" or leading zero: "4.22e15", "2.5e-7";
  * trailing zeros dropped, 0 as "0", NaN and ±Inf as "NaN", "+Inf", "-Inf";
  * rounding half away from zero on the exact binary value, which is what
    JavaScript's ``toPrecision`` and ``toExponential`` do (Python's "%g"
    rounds half to even: 10.125 would read "10.12" in one and "10.13" in
    the other).

In JSON (the HTTP API and ``tb-numerics report --json``), one rule: a
non-finite number is the string "NaN", "Infinity" or "-Infinity", as
TensorBoard's own encoder (``json_util.Cleanse``, which ``http_util.Respond``
applies) writes it, so the text is valid JSON that browsers parse.
"""

from __future__ import annotations

import decimal
import json
import math
from typing import Any

import numpy as np
from tensorboard.backend import json_util

from tb_numerics.records import F

__all__ = ["NONFINITE_WORDS", "NUMBER_FORMAT", "count", "describe_nonfinite", "dumps", "number", "percent"]

# How the non-finite values are named, in numbers and in counts of them.
NONFINITE_WORDS = {"nan": "NaN", "posinf": "+Inf", "neginf": "-Inf"}

NUMBER_FORMAT = {
    "digits": 4,
    "fixed_from": 0.001,
    "fixed_below": 10000,
    "exp_digits": 3,
    "rounding": "half away from zero",
    **NONFINITE_WORDS,
}
_FIXED_FROM = decimal.Decimal("0.001")
_FIXED_BELOW = decimal.Decimal(10000)


def _round(d: decimal.Decimal, digits: int) -> decimal.Decimal:
    """``d`` (positive) rounded to ``digits`` significant digits, half away from zero."""
    return d.quantize(decimal.Decimal(1).scaleb(d.adjusted() - digits + 1), rounding=decimal.ROUND_HALF_UP)


def _plain(d: decimal.Decimal) -> str:
    """A decimal in plain notation without trailing zeros after the point."""
    text = format(d, "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def number(x: float) -> str:
    """A number as people read it: "4000", "0.0123", "4.22e15", "2.5e-7".

    Args:
      x: any real number (numpy scalars too; an integer beyond a float's
        range, as untrusted JSON may hold, exactly).
    """
    try:
        x = float(x)
    except OverflowError:
        return ("-" if x < 0 else "") + _magnitude(decimal.Decimal(abs(x)))
    if math.isnan(x):
        return NONFINITE_WORDS["nan"]
    if math.isinf(x):
        return NONFINITE_WORDS["posinf" if x > 0 else "neginf"]
    if x == 0:
        return "0"
    return ("-" if x < 0 else "") + _magnitude(decimal.Decimal(abs(x)))


def _magnitude(exact: decimal.Decimal) -> str:
    """A positive number's words (``number``'s), from its exact value."""
    r = _round(exact, NUMBER_FORMAT["digits"])
    if _FIXED_FROM <= r < _FIXED_BELOW:
        return _plain(r)
    r = _round(exact, NUMBER_FORMAT["exp_digits"])
    exponent = r.adjusted()
    return "%se%d" % (_plain(r.scaleb(-exponent)), exponent)


def count(n: float) -> str:
    """A count with thousands separators: "4,096"."""
    return format(int(n), ",")


def percent(share: float) -> str:
    """A share as a percentage, 3 significant digits: "77.3%"."""
    return "%.3g%%" % (100 * share)


def describe_nonfinite(v: np.ndarray) -> str:
    """A record's non-finite counts in words: "2 NaN, 1 +Inf of 4,096 values".

    Args:
      v: one record (``metadata.FIELDS``).
    """
    parts = ["%s %s" % (count(v[F[k]]), words) for k, words in NONFINITE_WORDS.items() if v[F[k]] > 0]
    size = int(v[F["count"]])
    return "%s of %s value%s" % (", ".join(parts) or "no non-finite values", count(size), "" if size == 1 else "s")


def _numpy_value(obj: Any) -> Any:
    """A numpy array or scalar as plain Python, non-finite numbers as strings."""
    if isinstance(obj, (np.ndarray, np.generic)):
        return json_util.Cleanse(obj.tolist())
    raise TypeError("%s is not JSON serialisable" % type(obj).__name__)


def dumps(obj: Any) -> str:
    """``obj`` as JSON text, each NaN or ±Inf as TensorBoard writes it.

    Args:
      obj: dicts, lists, tuples, strings, numbers, None; numpy arrays and
        scalars too.

    Raises:
      TypeError: ``obj`` holds something else.
    """
    try:  # the usual body holds no NaN: the C encoder alone, about twice as fast
        return json.dumps(obj, default=_numpy_value, allow_nan=False, separators=(",", ":"))
    except (ValueError, TypeError):
        return json.dumps(json_util.Cleanse(obj), default=_numpy_value, allow_nan=False, separators=(",", ":"))
