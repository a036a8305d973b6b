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
