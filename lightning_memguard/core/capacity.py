"""The memory a run is judged against, and what PyTorch may reserve of it."""

from __future__ import annotations


def judged_capacity(given: int | None, device: int) -> int:
    """The capacity a run is judged against: the one the user gave, else the device's.

    Example:
        >>> judged_capacity(None, 80 * 10**9), judged_capacity(16 * 10**9, 80 * 10**9)
        (80000000000, 16000000000)
    """
    return device if given is None else given


def allocator_cap(capacity: int, total: int, other_bytes: int | None, margin: int) -> int:
    """The bytes PyTorch may reserve so that this run, what other processes hold and a margin fit in ``capacity``.

    ``total`` is the device's physical memory (a capacity set above it cannot be used), ``other_bytes`` what other
    processes hold (None where unknown: only the margin is left for them); the margin covers what PyTorch does not
    count (this process's CUDA context) and other processes' growth. Zero or less means nothing is left.

    Example:
        >>> allocator_cap(16 * 10**9, 16 * 10**9, 1_500_000_000, 512 * 2**20)
        13963129088
        >>> allocator_cap(16 * 10**9, 12 * 10**9, None, 0)
        12000000000
    """
    return min(capacity, total) - (other_bytes or 0) - margin
