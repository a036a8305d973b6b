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


MIN_MEMORY_BUDGET = 10**6  # bytes: a smaller activation budget is a slip (``1`` for "all of it"), not a plan


def check_memory_budget(value: Any) -> float | int | None:
    """An activation-memory budget: a float in (0, 1] is a fraction of the un-checkpointed peak, an int or a string
    such as ``"6GB"`` is a size in bytes, at least 1 MB (``1`` would be one byte: refused rather than obeyed).
    Returns the fraction, the size in bytes, or None.

    Example:
        >>> check_memory_budget(0.6), check_memory_budget("6GB"), check_memory_budget(None)
        (0.6, 6000000000, None)
        >>> check_memory_budget(1)
        Traceback (most recent call last):
        ...
        ValueError: `memory_budget` in bytes must be at least 1MB, got 1 (a fraction: a float such as 0.6)
    """
    from lightning_memguard.core.units import parse_bytes

    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise TypeError(
            "`memory_budget` must be a fraction in (0, 1] (a float), a size in bytes (an int) or a string such as"
            f" '6GB', got {value!r}"
        )
    if isinstance(value, float):
        if not 0 < value <= 1:
            raise ValueError(f"`memory_budget` as a fraction must be in (0, 1], got {value!r} (bytes: an int or '6GB')")
        return value
    size = parse_bytes(value, "memory_budget")
    if size < MIN_MEMORY_BUDGET:
        raise ValueError(
            f"`memory_budget` in bytes must be at least 1MB, got {value!r} (a fraction: a float such as 0.6)"
        )
    return size
