"""Argument checks shared by every public entry point (the callbacks, the strategies, ``checkpoint_blocks``, the
emulator): a ``TypeError`` or ``ValueError`` that names the argument and quotes the value.

The rules, the same everywhere: numbers are finite and in range, NumPy scalars count as the numbers they are
(``np.int64(4)`` is an int, ``np.float32(0.5)`` a float: checked through :mod:`numbers`, without importing NumPy),
a bool is never a number, flags are bools, and an object is an instance where an instance is meant (a class passed
instead gets a ``TypeError`` that says to call it).
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Iterable, Mapping
from typing import Any

from lightning_memguard.core.units import parse_bytes

MB = 10**6
MIN_CAPACITY = MB  # bytes: a device smaller than this is a slip (16 for "16GB"), and its GB figures round to zero
MAX_SIZE = 10**18  # bytes (1 EB): any memory size beyond this is a slip (10**400), and would not fit in a float
MIN_MEMORY_BUDGET = MB  # bytes: a smaller activation budget is a slip (``1`` for "all of it"), not a plan
# what a memory reader (``probe=``) must have, as the callbacks' messages say it
PROBE_NEEDS = "have capacity(), reset_peak() and read() methods (an instance, such as CpuProbe())"


def quoted(value: Any) -> str:
    """``repr(value)``, shortened in the middle if long (an int of 400 digits), for an error message.

    Example:
        >>> quoted(16), quoted(10**80)
        ('16', '100000000000000000000000000...000000000000000000000000000 (81 characters)')
    """
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:27]}...{text[-27:]} ({len(text)} characters)"


def _size_text(num_bytes: int) -> str:
    """``1MB``, ``1EB``: a power of 1000 as its unit, else the bytes."""
    for unit, size in (("EB", 10**18), ("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if num_bytes >= size and num_bytes % size == 0:
            return f"{num_bytes // size}{unit}"
    return f"{num_bytes} bytes" if num_bytes != 1 else "1 byte"


def check_bool(name: str, value: Any) -> bool:
    """``value`` as a flag: True or False, nothing that merely looks like one (``"False"``, ``None``, ``0``).

    Example:
        >>> check_bool("bn_correct", None)
        Traceback (most recent call last):
        ...
        TypeError: `bn_correct` must be a bool, got None
    """
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be a bool, got {quoted(value)}")
    return value


def check_int(name: str, value: Any, minimum: int) -> int:
    """``value`` as an int of at least ``minimum``; NumPy integers count, bools and floats (``64.0``) do not.

    Example:
        >>> import numpy as np
        >>> check_int("read_every", np.int64(10), 1)
        10
        >>> check_int("read_every", 0, 1)
        Traceback (most recent call last):
        ...
        ValueError: `read_every` must be >= 1, got 0
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"`{name}` must be an int, got {quoted(value)}")
    number = operator.index(value)
    if number < minimum:
        raise ValueError(f"`{name}` must be >= {minimum}, got {quoted(value)}")
    return number


def _finite(name: str, value: Any, expected: str) -> float:
    """``value`` as a finite float, or a ``TypeError`` / ``ValueError`` saying it must be ``expected``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"`{name}` must be {expected}, got {quoted(value)}")
    try:
        number = float(value)
    except OverflowError:  # an int beyond a float's range: 10**400
        number = math.inf
    if not math.isfinite(number):
        raise ValueError(f"`{name}` must be a finite number ({expected}), got {quoted(value)}")
    return number


def check_fraction(name: str, value: Any) -> float:
    """``value`` as a float in [0, 1); NumPy floats and ints count.

    Example:
        >>> check_fraction("headroom", 1.5)
        Traceback (most recent call last):
        ...
        ValueError: `headroom` must be in [0, 1), got 1.5
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"`{name}` must be a float, got {quoted(value)}")
    number = _finite(name, value, "a float in [0, 1)")
    if not 0 <= number < 1:
        raise ValueError(f"`{name}` must be in [0, 1), got {quoted(value)}")
    return number


def check_greater(name: str, value: Any, bound: float) -> float:
    """``value`` as a finite float above ``bound`` (``inf`` would switch the check it sets off without a word).

    Example:
        >>> check_greater("collapse", 3, 1)
        3.0
        >>> check_greater("collapse", float("inf"), 1)
        Traceback (most recent call last):
        ...
        ValueError: `collapse` must be a finite number (a number > 1), got inf
    """
    number = _finite(name, value, f"a number > {bound}")
    if not number > bound:
        raise ValueError(f"`{name}` must be a number > {bound}, got {quoted(value)}")
    return number


def check_fractions(name: str, values: Any) -> tuple[float, ...]:
    """``values`` (a sequence, or any iterable such as a NumPy array) as a tuple of floats in (0, 1].

    Example:
        >>> check_fractions("compile_settings", (1, 0.5))
        (1.0, 0.5)
        >>> check_fractions("compile_settings", (0.8, 0))
        Traceback (most recent call last):
        ...
        ValueError: `compile_settings` must be fractions in (0, 1], got (0.8, 0)
    """
    expected = "a sequence of fractions in (0, 1]"
    if isinstance(values, str | bytes | Mapping) or not isinstance(values, Iterable):
        raise TypeError(f"`{name}` must be {expected}, got {quoted(values)}")
    items = list(values)
    for item in items:
        if isinstance(item, bool) or not isinstance(item, numbers.Real):
            raise TypeError(f"`{name}` must be {expected}, got {quoted(values)}")
    numbers_ = [_finite(name, item, expected) for item in items]
    if not all(0 < x <= 1 for x in numbers_):
        raise ValueError(f"`{name}` must be fractions in (0, 1], got {quoted(values)}")
    return tuple(numbers_)


def check_size(name: str, value: Any, minimum: int = 1, maximum: int = MAX_SIZE) -> int:
    """A memory size (bytes, or a string such as ``"16GB"``, see :func:`~.units.parse_bytes`) in bytes, between
    ``minimum`` (0 allowed where nothing is a size, as for a margin) and ``maximum``.

    Example:
        >>> check_size("capacity", "16GB", MIN_CAPACITY), check_size("prevent_margin", 0, 0)
        (16000000000, 0)
        >>> check_size("capacity", 16, MIN_CAPACITY)
        Traceback (most recent call last):
        ...
        ValueError: `capacity` must be at least 1MB, got 16 (a number is bytes: '16GB' for gigabytes)
    """
    size = parse_bytes(value, name, allow_zero=minimum == 0)
    if size < minimum:
        raise ValueError(
            f"`{name}` must be at least {_size_text(minimum)}, got {quoted(value)} (a number is bytes: '16GB' for"
            " gigabytes)"
        )
    if size > maximum:
        raise ValueError(f"`{name}` must be at most {_size_text(maximum)}, got {quoted(value)}")
    return size


def check_callable(name: str, value: Any, expected: str = "callable", *, optional: bool = False) -> Any:
    """``value`` if it can be called (or is None, where ``optional``).

    Example:
        >>> check_callable("loss_fn", 5, "a callable (output) -> loss", optional=True)
        Traceback (most recent call last):
        ...
        TypeError: `loss_fn` must be a callable (output) -> loss or None, got 5
    """
    if optional and value is None:
        return None
    if not callable(value):
        raise TypeError(f"`{name}` must be {expected}{' or None' if optional else ''}, got {quoted(value)}")
    return value


def check_instance(name: str, value: Any, kind: type, expected: str) -> Any:
    """``value`` if it is an instance of ``kind`` (a class, or a runtime-checkable protocol). A class passed where
    an instance is meant, such as ``probe=CpuProbe``, is refused with the call it lacks (a protocol's class would
    pass a plain ``isinstance``: its methods are there, unbound). Callers that allow None check for it first.

    Args:
        name: the argument's name.
        value: what was passed.
        kind: the class or protocol.
        expected: what the message says ``value`` must do or be, after "must": ``"be a RebuildConfig or None"``.

    Example:
        >>> class Reader:
        ...     def read(self): ...
        >>> check_instance("probe", Reader, Reader, "be a Reader")
        Traceback (most recent call last):
        ...
        TypeError: `probe` must be an instance, got the class Reader: pass Reader()
    """
    if isinstance(value, type):
        try:
            fits = issubclass(value, kind)
        except TypeError:  # a protocol with data members takes no issubclass
            fits = False
        if fits:
            cls = value.__qualname__
            raise TypeError(f"`{name}` must be an instance, got the class {cls}: pass {cls}()")
    if not isinstance(value, kind):
        raise TypeError(f"`{name}` must {expected}, got {quoted(value)}")
    return value


def check_memory_budget(value: Any) -> float | int | None:
    """An activation-memory budget: a float in (0, 1] is a fraction of the un-checkpointed peak, an int or a string
    such as ``"6GB"`` is a size in bytes, at least 1 MB (``1`` would be one byte: refused rather than obeyed).
    NumPy numbers count as what they are (``np.float32`` a fraction, ``np.int64`` bytes).
    Returns the fraction (a float), the size in bytes (an int), or None.

    Example:
        >>> check_memory_budget(0.6), check_memory_budget("6GB"), check_memory_budget(None)
        (0.6, 6000000000, None)
        >>> check_memory_budget(1)
        Traceback (most recent call last):
        ...
        ValueError: `memory_budget` in bytes must be at least 1MB, got 1 (a fraction: a float such as 0.6)
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real | str):
        raise TypeError(
            "`memory_budget` must be a fraction in (0, 1] (a float), a size in bytes (an int) or a string such as"
            f" '6GB', got {quoted(value)}"
        )
    if not isinstance(value, numbers.Integral | str):  # a float: a fraction
        fraction = _finite("memory_budget", value, "a fraction in (0, 1]")
        if not 0 < fraction <= 1:
            raise ValueError(
                f"`memory_budget` as a fraction must be in (0, 1], got {quoted(value)} (bytes: an int or '6GB')"
            )
        return fraction
    size = parse_bytes(value, "memory_budget")
    if size < MIN_MEMORY_BUDGET:
        raise ValueError(
            f"`memory_budget` in bytes must be at least 1MB, got {quoted(value)} (a fraction: a float such as 0.6)"
        )
    if size > MAX_SIZE:
        raise ValueError(f"`memory_budget` in bytes must be at most {_size_text(MAX_SIZE)}, got {quoted(value)}")
    return size
