"""Argument checks shared by the callbacks: a ``TypeError`` or ``ValueError`` that names the argument and value."""

from __future__ import annotations

from typing import Any


def check_int(name: str, value: Any, minimum: int) -> int:
    """``value`` as an int of at least ``minimum``.

    Example:
        >>> check_int("read_every", 0, 1)
        Traceback (most recent call last):
        ...
        ValueError: `read_every` must be >= 1, got 0
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"`{name}` must be >= {minimum}, got {value!r}")
    return value


def check_fraction(name: str, value: Any) -> float:
    """``value`` as a float in [0, 1).

    Example:
        >>> check_fraction("headroom", 1.5)
        Traceback (most recent call last):
        ...
        ValueError: `headroom` must be in [0, 1), got 1.5
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"`{name}` must be a float, got {value!r}")
    if not 0 <= value < 1:
        raise ValueError(f"`{name}` must be in [0, 1), got {value!r}")
    return float(value)
