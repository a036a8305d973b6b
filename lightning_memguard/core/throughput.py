"""Step times and samples in, median step time and throughput out."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StepStats:
    """A summary of consecutive training steps.

    Attributes:
        steps: how many steps were timed.
        step_ms: the median step time in milliseconds.
        samples_per_sec: samples divided by the summed step time.
    """

    steps: int
    step_ms: float
    samples_per_sec: float


def summarize_steps(durations: Sequence[float], samples: Sequence[int]) -> StepStats | None:
    """Median step time and throughput of timed steps; ``None`` when nothing was timed.

    Args:
        durations: seconds per step.
        samples: samples per step, in the same order.

    Raises:
        ValueError: if the two sequences differ in length.

    Example:
        >>> summarize_steps([0.1, 0.1, 0.4], [32, 32, 32])
        StepStats(steps=3, step_ms=100.0, samples_per_sec=160.0)
    """
    if len(durations) != len(samples):
        raise ValueError(f"got {len(durations)} durations but {len(samples)} sample counts")
    if not durations:
        return None
    total = sum(durations)
    rate = sum(samples) / total if total > 0 else 0.0
    return StepStats(
        steps=len(durations), step_ms=round(statistics.median(durations) * 1e3, 6), samples_per_sec=round(rate, 6)
    )


def settled_from(times: Sequence[float], minimum: int = 2, tolerance: float = 0.25) -> int | None:
    """Where warm-up ends: the first step, at ``minimum`` or later, whose two steps before agree in time.

    The first steps of a compiled model hold the compiler's work (seconds where a step takes milliseconds), and a
    recompile can follow; two consecutive steps within ``tolerance`` of each other (relative to the shorter) mean the
    compiled graph runs. ``None`` while no step up to ``len(times)`` qualifies: warm up for longer.

    Args:
        times: step times so far, any unit, in order.
        minimum: warm-up steps at least (at least 2: one step alone does not say it is steady).
        tolerance: how far apart two steady steps may be.

    Example:
        >>> settled_from([9000.0, 41.0, 40.0, 40.5], minimum=2)  # compiled in step 0: timed from step 3
        3
        >>> settled_from([9000.0, 3000.0, 41.0], minimum=2) is None  # a recompile in step 1: not yet
        True
    """
    for i in range(max(minimum, 2), len(times) + 1):
        a, b = times[i - 2], times[i - 1]
        if abs(a - b) <= tolerance * min(a, b):
            return i
    return None


def warmup_excess(times: Sequence[float], end: int) -> float:
    """What the warm-up steps ``times[:end]`` took beyond as many steady steps (the median of ``times[end:]``): a
    compiled model's compile time, in the unit of ``times``. 0 when nothing was timed after the warm-up.

    Example:
        >>> warmup_excess([9000.0, 41.0, 40.0, 40.5, 39.5, 40.0], end=3)
        8961.0
    """
    timed = times[end:]
    if not timed:
        return 0.0
    return max(0.0, sum(times[:end]) - end * statistics.median(timed))
