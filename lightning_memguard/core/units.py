"""Memory sizes: parsing user input and formatting for people."""

from __future__ import annotations

import math
import numbers
import operator
import re
from collections.abc import Callable
from fractions import Fraction

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")

GB = 10**9


def parse_bytes(value: int | float | str | numbers.Real, name: str = "capacity", *, allow_zero: bool = False) -> int:
    """Turn ``16000000000``, ``"16GB"``, ``"16GiB"`` or ``"512MB"`` into a number of bytes.

    Decimal units (``KB``, ``MB``, ``GB``, ``TB``) are powers of 1000, binary units (``KiB`` ... ``TiB``)
    powers of 1024; unit letters are case-insensitive. The result must be a whole number of bytes, at least one:
    ``0.5``, ``"0.5B"`` or ``"0.9"`` are refused rather than rounded down to a size of nothing. NumPy numbers count
    as the numbers they are (``np.int64(1024)`` is 1024 bytes).

    Args:
        value: a positive number of bytes, or a string with a number and a unit.
        name: the argument's name, quoted in the error message.
        allow_zero: a size of 0 is allowed too (a margin, not a capacity).

    Raises:
        TypeError: if ``value`` is neither a number nor a string.
        ValueError: if the string cannot be read, or the size is not a whole, positive number of bytes.

    Example:
        >>> parse_bytes("16GB"), parse_bytes("16GiB"), parse_bytes("512MB"), parse_bytes(1024), parse_bytes("1.5KiB")
        (16000000000, 17179869184, 512000000, 1024, 1536)
        >>> parse_bytes(0.5)
        Traceback (most recent call last):
        ...
        ValueError: `capacity` must be a whole number of bytes, at least 1, got 0.5
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real | str):
        raise TypeError(f"`{name}` must be a number of bytes or a string such as '16GB', got {value!r}")
    least = 0 if allow_zero else 1
    sign = "non-negative" if allow_zero else "positive"
    if isinstance(value, str):
        match = _PATTERN.match(value)
        unit = match.group(2).upper() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"`{name}` must be a number of bytes or a size such as '16GB', '16GiB' or '512MB', got {value!r}"
            )
        size = Fraction(match.group(1)) * _UNITS[unit]  # exact: "0.1GB" is 100000000 bytes, not 99999999.99...
    elif isinstance(value, numbers.Integral):  # int, np.int64: exact, however large
        size = Fraction(operator.index(value))
    else:
        try:
            number = float(value)  # float, np.float32; a Fraction as the float nearest to it
        except OverflowError:
            number = math.inf
        if not math.isfinite(number):
            raise ValueError(f"`{name}` must be a {sign} size, got {value!r}")
        size = Fraction(number)
    if size < 0 or (size == 0 and not allow_zero):
        raise ValueError(f"`{name}` must be a {sign} size, got {value!r}")
    if size.denominator != 1:
        raise ValueError(f"`{name}` must be a whole number of bytes, at least {least}, got {value!r}")
    return int(size)


def size_formatter(reference: float, gb_digits: int = 3) -> Callable[[float], str]:
    """Formats byte counts for people in one unit, the one that fits ``reference`` (the figure the others are read
    against: a card's capacity, a plan's baseline), so figures side by side compare at a glance: GB with
    ``gb_digits`` decimals, MB or kB with one, else bytes. A card of 150 MB reads "160.3 MB against 150.0 MB", not
    "0.16 GB against 0.15 GB", and a 1 MB emulated card not "0.00 GB against 0.00 GB".

    Example:
        >>> size_formatter(2_500_000_000)(800_000_000), size_formatter(12_345_678)(4_000_000), size_formatter(900)(512)
        ('0.800 GB', '4.0 MB', '512 B')
        >>> size = size_formatter(150_000_000, gb_digits=2)
        >>> size(160_296_440), size(16_000_000_000), size_formatter(16 * 10**9, gb_digits=2)(17 * 10**9)
        ('160.3 MB', '16000.0 MB', '17.00 GB')
    """
    unit, scale, digits = size_unit(reference, gb_digits)
    return lambda n: f"{n / scale:.{digits}f} {unit}"


def format_size(num_bytes: float, gb_digits: int = 2) -> str:
    """One size alone, in the unit that fits it (:func:`size_formatter` read against itself).

    Example:
        >>> format_size(70_312_000), format_size(12_400_000_000)
        ('70.3 MB', '12.40 GB')
    """
    return size_formatter(num_bytes, gb_digits)(num_bytes)


def size_unit(reference: float, gb_digits: int = 3) -> tuple[str, int, int]:
    """The unit :func:`size_formatter` writes sizes in, read against ``reference``: its name, its bytes and the
    decimals it takes. For a table whose header names the unit once (``peak MB / capacity MB``).

    Example:
        >>> size_unit(16 * 10**9, gb_digits=2), size_unit(150_000_000), size_unit(2_000), size_unit(900)
        (('GB', 1000000000, 2), ('MB', 1000000, 1), ('kB', 1000, 1), ('B', 1, 0))
    """
    for scale, unit, digits in ((GB, "GB", gb_digits), (10**6, "MB", 1), (10**3, "kB", 1)):
        if reference >= scale:
            return unit, scale, digits
    return "B", 1, 0


def to_gb(num_bytes: float) -> float:
    """Bytes to decimal gigabytes, the unit of every ``*_gb`` log key.

    Example:
        >>> to_gb(2_500_000_000)
        2.5
    """
    return num_bytes / GB
