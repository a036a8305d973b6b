"""Step times and samples in, median step time and throughput out: a run's (MemGuard) and a tuner trial's."""

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


@dataclass(frozen=True)
class TrialTiming:
    """What a tuner's trial says of its timed optimizer steps.

    Attributes:
        step_ms: the median time of one whole optimizer step (``per_step`` samples: the micro-batch times the
            accumulation), in milliseconds.
        samples_per_sec: ``per_step`` over ``step_ms``: ``samples_per_sec * step_ms / 1000 == per_step``.
        spread: half the range of the timed steps' times, as a fraction of ``step_ms``: the throughput is known to
            about ± this much. None with one timed step (nothing to compare it with).
        steps: how many steps were timed.
    """

    step_ms: float
    samples_per_sec: float
    spread: float | None
    steps: int


def group_steps(epochs: Sequence[Sequence[tuple[float, int, bool]]], accumulate: int) -> list[tuple[float, int, bool]]:
    """Each optimizer step as Lightning runs them: ``accumulate`` batches, and whatever is left at an epoch's end
    (Lightning steps the optimizer there, whatever the accumulation).

    Args:
        epochs: each epoch's batches as ``(seconds, samples, compiled)``.
        accumulate: batches per optimizer step.

    Returns:
        ``(seconds, samples, compiled)`` of each step: the sums of its batches, and whether any of them compiled.

    Example:
        >>> group_steps([[(1.0, 32, False), (1.0, 32, True), (0.5, 8, False)], [(1.0, 32, False)]], 2)
        [(2.0, 64, True), (0.5, 8, False), (1.0, 32, False)]
    """
    steps = []
    for batches in epochs:
        for i in range(0, len(batches), accumulate):
            group = batches[i : i + accumulate]
            steps.append((sum(s for s, _, _ in group), sum(n for _, n, _ in group), any(c for _, _, c in group)))
    return steps


def time_trial(steps: Sequence[tuple[float, int]], per_step: int, warmup: int = 0) -> TrialTiming | None:
    """The timing of a trial from its optimizer steps: :class:`TrialTiming`, or None when nothing was timed.

    The first ``warmup`` steps are not timed, unless no other is left (a trial cut after its first step: that one).
    Of the rest only whole steps count (``per_step`` samples): a shorter step at an epoch's end holds fewer samples
    for the same fixed costs. Where no step is whole, each step's time is scaled to ``per_step`` samples.

    Args:
        steps: ``(seconds, samples)`` of each optimizer step, in order (steps in which ``torch.compile`` compiled
            already left out).
        per_step: samples of a whole optimizer step: the micro-batch times the accumulation.
        warmup: untimed steps at the start.

    Example:
        >>> time_trial([(9.0, 64), (0.2, 64), (0.2, 64), (0.3, 64), (0.1, 16)], per_step=64, warmup=1)
        TrialTiming(step_ms=200.0, samples_per_sec=320.0, spread=0.25, steps=3)
        >>> time_trial([(0.5, 64)], per_step=64, warmup=2)  # cut after its first step
        TrialTiming(step_ms=500.0, samples_per_sec=128.0, spread=None, steps=1)
    """
    timed = list(steps[warmup:]) or list(steps)
    whole = [s for s, n in timed if n == per_step]
    times = whole or [s * per_step / n for s, n in timed if n > 0]
    if not times:
        return None
    median = statistics.median(times)
    spread = (max(times) - min(times)) / 2 / median if len(times) > 1 and median > 0 else None
    return TrialTiming(
        step_ms=round(median * 1e3, 4),
        samples_per_sec=round(per_step / median, 3) if median > 0 else 0.0,
        spread=None if spread is None else round(spread, 4),
        steps=len(times),
    )
