"""Argument checks shared by the components: a wrong type or value is named, with what was expected,
before anything starts (a bool is not a count: True would pass an isinstance(int) check)."""
import math
import numbers


def expect_int(owner, name, value):
    """An int, not a bool (numpy's integers count): TypeError otherwise. Returns it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{owner}: expected {name} to be an int, got {value!r}")
    return value


def expect_number(owner, name, value):
    """A real number, not a bool (NaN and infinities pass: some callers keep them, as torch does).
    Returns it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{owner}: expected {name} to be a number, got {value!r}")
    return value


def expect_count(owner, name, value, least=0):
    """An int (not a bool) >= least: TypeError for another type, ValueError below least. Returns it."""
    expect_int(owner, name, value)
    if value < least:
        raise ValueError(f"{owner}: expected {name} >= {least}, got {value!r}")
    return value


def expect_positive(owner, name, value, zero_ok=False):
    """A finite real number (not a bool) > 0 (>= 0 with zero_ok)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{owner}: expected {name} to be a number, got {value!r}")
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        raise ValueError(f"{owner}: expected {name} to be a finite number {'>=' if zero_ok else '>'} 0, got {value!r}")
