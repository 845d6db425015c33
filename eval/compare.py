"""How a program's answer is compared with the expected one (pure functions; the parent side of
:mod:`eval.execution` applies them, outside the tested process)."""

from __future__ import annotations

import math
import re

__all__ = ["FLOAT_TOLERANCE", "outputs_match", "values_match"]

FLOAT_TOLERANCE = 1e-6
"""Two numbers (at least one not an integer) match when within this absolute or relative error."""

_INT_TOKEN = re.compile(r"[+-]?\d+")


def _tokens_close(got: str, expected: str) -> bool:
    if _INT_TOKEN.fullmatch(got) and _INT_TOKEN.fullmatch(expected):
        return int(got) == int(expected)
    try:
        g, e = float(got), float(expected)
    except ValueError:
        return False
    if math.isnan(g) or math.isnan(e):
        return math.isnan(g) and math.isnan(e)
    return math.isclose(g, e, rel_tol=FLOAT_TOLERANCE, abs_tol=FLOAT_TOLERANCE)


def outputs_match(got: str, expected: str) -> bool:
    """Whether a standard-input program's output ``got`` matches ``expected``.

    Compared as whitespace-separated tokens, so line breaks, trailing spaces and blank lines do
    not matter (APPS's whitespace-split comparison; Codeforces' default token checker). Two tokens
    match when equal as strings, when both are integers of equal value, or when both parse as
    floats (at least one not an integer) within :data:`FLOAT_TOLERANCE` absolute or relative
    error. Case matters ("YES" is not "Yes"); order matters (APPS's last, order-free set
    comparison is not used).
    """
    if got == expected:
        return True
    g, e = got.split(), expected.split()
    return len(g) == len(e) and all(a == b or _tokens_close(a, b) for a, b in zip(g, e))


def _plain(value):
    if isinstance(value, tuple):
        return list(value)
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes, list, dict)):
        try:  # numpy scalars and arrays
            return value.tolist()
        except Exception:
            return value
    return value


def _same(got, expected) -> bool:
    got, expected = _plain(got), _plain(expected)
    if isinstance(expected, bool) or isinstance(got, bool):
        return isinstance(expected, bool) and isinstance(got, bool) and got == expected
    if isinstance(expected, (int, float)) and isinstance(got, (int, float)):
        if isinstance(expected, int) and isinstance(got, int):
            return got == expected
        if math.isnan(got) or math.isnan(expected):
            return math.isnan(got) and math.isnan(expected)
        return math.isclose(got, expected, rel_tol=FLOAT_TOLERANCE, abs_tol=FLOAT_TOLERANCE)
    if isinstance(expected, list) and isinstance(got, list):
        return len(got) == len(expected) and all(_same(g, e) for g, e in zip(got, expected))
    if isinstance(expected, dict) and isinstance(got, dict):
        if len(got) != len(expected):
            return False
        by_str = {str(k): v for k, v in got.items()}  # JSON turned the reference's keys into strings
        for key, value in expected.items():
            if key in got:
                if not _same(got[key], value):
                    return False
            elif not (isinstance(key, str) and key in by_str and _same(by_str[key], value)):
                return False
        return True
    try:
        return bool(got == expected)
    except Exception:
        return False


def values_match(got, expected, wrapped: bool) -> bool:
    """Whether a call-based solution's return value ``got`` matches the test's ``expected``.

    ``wrapped=True`` (MapCoder rows): ``expected`` is ``[value]``; compare with ``value`` only.
    ``wrapped=False`` (original APPS rows): APPS's rule, ``got == expected`` or, when ``expected``
    is a non-empty list, ``got == expected[0]``. Tuples compare as lists (the reference went
    through JSON), dict keys may have become strings, bools only equal bools, and numbers (at
    least one a float) compare within :data:`FLOAT_TOLERANCE`.
    """
    if wrapped:
        if isinstance(expected, (list, tuple)) and len(expected) == 1:
            return _same(got, expected[0])
        return _same(got, expected)
    return _same(got, expected) or (isinstance(expected, list) and len(expected) > 0 and _same(got, expected[0]))
