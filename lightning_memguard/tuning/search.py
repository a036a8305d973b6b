"""Searching batch sizes by measuring: a step object that proposes sizes and learns from each trial."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from lightning_memguard.core.spill import Evidence, Verdict, judge
from lightning_memguard.tuning.epoch import EpochLength

OK, OOM, SPILL, OVER_HEADROOM = "ok", "oom", "spill", "over_headroom"
PREDICTED = "predicted_over"  # not run: the memory line fitted to the measured sizes puts it above the capacity
MODES = ("throughput", "max_fit")


@dataclass(frozen=True)
class TrialResult:
    """One measured trial.

    A step is an optimizer step: ``accumulate`` batches of ``size``, ``size * accumulate`` samples. Only whole steps
    are timed (see :func:`~lightning_memguard.core.throughput.time_trial`), so a row that fits holds
    ``samples_per_sec * step_ms / 1000 == size * accumulate`` (to rounding).

    Attributes:
        size: the batch (or micro-batch) size tried.
        step_ms: the median time of one optimizer step (``size * accumulate`` samples), in milliseconds; None if
            the trial failed before it was timed.
        peak_bytes: peak memory of the trial (plus other processes' use), None if unknown.
        samples_per_sec: the samples of one optimizer step (``size * accumulate``) over ``step_ms``, per second.
        outcome: ``"ok"``, ``"oom"``, ``"spill"`` or ``"over_headroom"``; ``"predicted_over"`` for a size that was
            not run because :class:`Forecast` put it clearly above the capacity (``peak_bytes`` is the prediction).
        accumulate: gradient-accumulation steps used with this size (1 for a plain batch size).
        compiled: the model ran under ``torch.compile`` (its steps are the compiled graph's, compile time apart).
        compile_s: seconds of the trial's steps in which ``torch.compile`` compiled; not in ``step_ms``.
        spread: the measurement's noise: half the range of the timed steps' times, as a fraction of ``step_ms``
            (the throughput is known to about ± this much); None with one timed step, or not timed.
    """

    size: int
    step_ms: float | None
    peak_bytes: int | None
    samples_per_sec: float | None
    outcome: str
    accumulate: int = 1
    compiled: bool = False
    compile_s: float = 0.0
    spread: float | None = None

    @property
    def fits(self) -> bool:
        return self.outcome == OK

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def trial_outcome(evidence: Evidence) -> str:
    """What the spill rule says of a trial's reading: ``"spill"`` as MemGuard would judge a run (above the
    capacity; or within the headroom of it with the trial's throughput collapsed against the best of the smaller
    sizes, which ran on less memory); ``"over_headroom"`` for any other reading within the headroom; else ``"ok"``.
    Throughput alone never makes a spill: far from the capacity a slow trial is just slow.

    Example:
        >>> from lightning_memguard.core.reading import MemoryReading
        >>> def trial(peak, rate=None, best=None):
        ...     evidence = Evidence(MemoryReading(peak, 0, 0), 16 * 10**9, 0.05, best, [rate] if rate else [])
        ...     return trial_outcome(evidence)
        >>> trial(17 * 10**9), trial(15_500_000_000, 3400.0, 3500.0), trial(15_500_000_000, 1000.0, 3500.0)
        ('spill', 'over_headroom', 'spill')
        >>> trial(12 * 10**9, 1000.0, 3500.0)
        'ok'
    """
    if evidence.healthy_used is None:  # the reference is the smaller sizes': they ran on less memory than this one
        evidence = replace(evidence, healthy_used=0)
    if judge(evidence).verdict is Verdict.SPILL:
        return SPILL
    return OVER_HEADROOM if evidence.near else OK


@dataclass(frozen=True)
class Forecast:
    """Peak memory predicted from the sizes measured so far, so that a size that would clearly spill is not run.

    Peak memory is close to affine in the batch size: the resting model plus a part per sample. The line through
    the two largest sizes that fit (their peaks) predicts the next; a size whose predicted peak is above the
    capacity by more than ``margin`` (a fraction of it) is not run, and the largest size predicted to leave the
    ``headroom`` is tried in its place. One trial of a spilling size can cost more than all the others together.

    Example:
        >>> forecast = Forecast(capacity=16 * 10**9, headroom=0.05)
        >>> fits = [TrialResult(64, 1.0, 5 * 10**9, 1.0, "ok"), TrialResult(128, 1.0, 9 * 10**9, 1.0, "ok")]
        >>> forecast.peak(fits, 256) / 1e9, forecast.clearly_over(fits, 256), forecast.largest_fit(fits, 8)
        (17.0, False, 224)
        >>> forecast.clearly_over(fits, 512)
        True
    """

    capacity: int
    headroom: float
    margin: float = 0.1

    @staticmethod
    def _line(results: Sequence[TrialResult]) -> tuple[float, float] | None:
        """(resting bytes, bytes per sample) through the two largest sizes that fit, if they rise."""
        peaks = {r.size: r.peak_bytes for r in results if r.fits and r.peak_bytes}
        if len(peaks) < 2:
            return None
        small, large = sorted(peaks)[-2:]
        per_sample = (peaks[large] - peaks[small]) / (large - small)  # type: ignore[operator]
        return (peaks[large] - per_sample * large, per_sample) if per_sample > 0 else None  # type: ignore[operator]

    def peak(self, results: Sequence[TrialResult], size: int) -> float | None:
        line = self._line(results)
        return None if line is None else line[0] + line[1] * size

    def clearly_over(self, results: Sequence[TrialResult], size: int) -> bool:
        peak = self.peak(results, size)
        return peak is not None and peak > self.capacity * (1 + self.margin)

    def largest_fit(self, results: Sequence[TrialResult], granularity: int = 1) -> int | None:
        """The largest multiple of ``granularity`` predicted to leave the headroom free (None without a line)."""
        line = self._line(results)
        if line is None:
            return None
        base, per_sample = line
        size = int((self.capacity * (1 - self.headroom) - base) // per_sample)
        return size // granularity * granularity or None

    def skipped(self, results: Sequence[TrialResult], size: int, accumulate: int = 1) -> TrialResult:
        """The row of a size not run: its predicted peak, no timing."""
        return TrialResult(size, None, int(self.peak(results, size) or 0), None, PREDICTED, accumulate)


def power_ladder(start: int, stop: int, factor: int = 2) -> list[int]:
    """``start``, ``start * factor``, ... up to ``stop``.

    Example:
        >>> power_ladder(32, 2048)
        [32, 64, 128, 256, 512, 1024, 2048]
    """
    if start < 1 or stop < start:
        raise ValueError(f"need 1 <= start <= stop, got start={start}, stop={stop}")
    sizes = []
    size = start
    while size <= stop:
        sizes.append(size)
        size *= factor
    return sizes


def capped_ladder(sizes: Sequence[int], deliverable: int | EpochLength | None, accumulate: int = 1) -> list[int]:
    """The sizes one epoch can really run a whole optimizer step of (``accumulate`` full batches): those above it
    are dropped, and the largest size that still can takes their place (at ``accumulate`` 1 with no batch limit,
    the whole epoch as one batch). ``deliverable``: the epoch as :class:`EpochLength`, or its samples (an int);
    None: a loader without length, nothing capped.

    Example:
        >>> capped_ladder([16, 32, 64, 128, 256, 512], 100)
        [16, 32, 64, 100]
        >>> capped_ladder([32, 64], 20)
        [20]
        >>> capped_ladder([32, 64], None)
        [32, 64]
        >>> capped_ladder([16, 32, 64, 128], EpochLength(100, limit=0.25))  # 0.25 of 2 batches of 64 is none
        [16, 32, 33]
        >>> capped_ladder([16, 32, 64], EpochLength(100), accumulate=4)
        [16, 25]
    """
    epoch = deliverable if isinstance(deliverable, EpochLength) else EpochLength(deliverable)
    top = epoch.stand_in(accumulate)
    if top is None:
        return list(sizes)
    if epoch.samples is not None and epoch.samples < 1:
        raise ValueError(f"the train loader delivers no samples (an epoch of {epoch.samples}); nothing can be measured")
    if top < 1:
        raise ValueError(
            f"one epoch ({epoch}) runs no whole optimizer step of {accumulate} batches at any batch size; nothing can"
            " be measured"
        )
    kept = [s for s in sizes if s <= top]
    if len(kept) < len(sizes) and top not in kept:
        kept.append(top)
    return kept


_WORST = (OK, OVER_HEADROOM, SPILL, OOM, PREDICTED)


def combine(rows: Sequence[TrialResult]) -> TrialResult:
    """One size measured more than once, as one row: the mean of its throughputs and of its step times, the largest
    peak; a size that did not fit once does not fit (its worst row). Its spread is the smaller of the trials' own,
    and no less than half the gap between their throughputs: measurements of one size that disagree are noisy,
    however steady each was.

    Example:
        >>> a = TrialResult(64, 100.0, 10, 640.0, "ok", spread=0.02)
        >>> b = TrialResult(64, 110.0, 12, 560.0, "ok", spread=0.03)
        >>> both = combine([a, b])
        >>> both.samples_per_sec, both.step_ms, both.peak_bytes, both.spread
        (600.0, 105.0, 12, 0.0667)
    """
    if len(rows) == 1:
        return rows[0]
    worst = max(rows, key=lambda r: _WORST.index(r.outcome))
    rates = [r.samples_per_sec for r in rows]
    if not worst.fits or any(rate is None for rate in rates):
        return worst
    rate = statistics.fmean(rates)  # type: ignore[arg-type]
    times = [r.step_ms for r in rows if r.step_ms is not None]
    spreads = [r.spread for r in rows if r.spread is not None]
    gap = (max(rates) - min(rates)) / 2 / rate if rate > 0 else 0.0  # type: ignore[type-var, operator]
    return replace(
        rows[0],
        step_ms=round(statistics.fmean(times), 4) if times else None,
        peak_bytes=max((r.peak_bytes for r in rows if r.peak_bytes is not None), default=None),
        samples_per_sec=round(rate, 3),
        compiled=any(r.compiled for r in rows),
        compile_s=round(sum(r.compile_s for r in rows), 3),
        spread=round(max(min(spreads, default=0.0), gap), 4),
    )


@dataclass(frozen=True)
class Margin:
    """How far a search's choice stood from the fastest other size that fit: what the cache keeps with a choice.

    Attributes:
        size, accumulate: the choice.
        runner_up, runner_up_accumulate: the fastest other size that fit, and its accumulation (where BatchNorm
            makes the micro-batch matter and the choice accumulates more: the largest micro-batch that fit).
        gap: the choice's throughput less the runner-up's, as a fraction of the faster of the two (negative: the
            choice is the slower one, taken by the search's rule: less memory, or less accumulation).
        noise: the larger of the two measurements' spreads (0.0 where neither is known: one timed step each); where
            BatchNorm makes the micro-batch matter, the machine's: the largest spread of any size the search measured.
        remeasured: both were measured once more, and are compared on their combined measurements.

    Example:
        >>> Margin(32, 2, 64, 1, gap=-0.012, noise=0.04).within_noise
        True
        >>> Margin(32, 2, 64, 1, gap=0.09, noise=0.04).within_noise, Margin(32, 2, 64, 1, 0.0, 0.0).within_noise
        (False, False)
    """

    size: int
    accumulate: int
    runner_up: int
    runner_up_accumulate: int
    gap: float
    noise: float
    remeasured: bool = False

    @property
    def within_noise(self) -> bool:
        """The two throughputs differ by no more than the noise: the measurements cannot tell them apart."""
        return self.noise > 0 and abs(self.gap) <= self.noise

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def describe_margin(margin: Margin, tie_rule: str | None = None) -> str:
    """The margin in words: which two sizes, how far apart, against which noise; with ``tie_rule``, what decided
    where the measurements could not.

    Example:
        >>> within = Margin(64, 1, 32, 2, gap=0.012, noise=0.04, remeasured=True)
        >>> print(*describe_margin(within, "the larger micro-batch").split("; "), sep="\\n")  # one line, split here
        64 x 1 and 32 x 2 are within the measurement's noise (±4.0 %: 1.2 % apart, each measured twice)
        chose 64 x 1 by the larger micro-batch
        >>> print(describe_margin(Margin(128, 1, 64, 1, gap=0.15, noise=0.04)))
        128 is 15.0 % faster than 64, beyond the measurement's noise (±4.0 %)
    """

    def shape(size: int, accumulate: int) -> str:
        return f"{size} x {accumulate}" if margin.accumulate > 1 or margin.runner_up_accumulate > 1 else str(size)

    chosen, other = shape(margin.size, margin.accumulate), shape(margin.runner_up, margin.runner_up_accumulate)
    noise, apart = f"±{margin.noise * 100:.1f} %", f"{abs(margin.gap) * 100:.1f} %"
    if margin.within_noise:
        twice = ", each measured twice" if margin.remeasured else ""
        said = f"{chosen} and {other} are within the measurement's noise ({noise}: {apart} apart{twice})"
    else:
        faster = f"{chosen} is {apart} {'faster' if margin.gap >= 0 else 'slower'} than {other}"
        again = ", measured again" if margin.remeasured else ""
        beyond = f"beyond the measurement's noise ({noise})" if margin.noise else "the noise unknown (one timed step)"
        said = f"{faster}{again}, {beyond}"
    if tie_rule is not None and (margin.within_noise or margin.gap < 0):
        said += f"; chose {chosen} by {tie_rule}"
    return said


class _Climb:
    """What both searches share: the sizes climbed, the results so far, the size proposed and not yet observed, and
    the decision between the choice and the fastest other size that fit (:class:`Margin`): when the two are within
    the measurement's noise, both are measured again (``remeasures`` times at most), and if they still are, the
    search's tie rule (``tie_rule``) decides between them."""

    tie_rule = ""  # how the search decides between two sizes within the noise, in words

    def __init__(
        self,
        candidates: Sequence[int],
        min_gain: float,
        tolerance: float,
        forecast: Forecast | None,
        remeasures: int = 1,
    ) -> None:
        if not candidates or any(int(c) != c or c < 1 for c in candidates):
            raise ValueError(f"`candidates` must be positive integers, got {list(candidates)!r}")
        if isinstance(remeasures, bool) or not isinstance(remeasures, int) or remeasures < 0:
            raise ValueError(f"`remeasures` must be an int >= 0, got {remeasures!r}")
        self.candidates = sorted(set(int(c) for c in candidates))
        self.min_gain = min_gain
        self.tolerance = tolerance
        self.forecast = forecast
        self.remeasures = remeasures
        self.results: list[TrialResult] = []
        self.remeasured: list[tuple[int, int]] = []  # the pairs measured again, in order
        self._next = 0
        self._climbing = True
        self._pending: int | None = None
        self._again: list[int] = []  # sizes still to measure again

    @property
    def best_rate(self) -> float | None:
        rates = [r.samples_per_sec for r in self.results if r.fits and r.samples_per_sec is not None]
        return max(rates) if rates else None

    def _take(self, result: TrialResult) -> None:
        """Record the measurement of the size proposed."""
        if self._pending is None or result.size != self._pending:
            raise ValueError(f"observed size {result.size}, but the search proposed {self._pending}")
        self._pending = None
        self.results.append(result)

    # ---------------------------------------------------------------- the decision

    def _decides_by_throughput(self) -> bool:
        return True

    def _rule(self, fits: list[TrialResult]) -> TrialResult:
        """The search's choice among the sizes that fit (each one row, measurements combined)."""
        raise NotImplementedError

    def _tie(self, a: TrialResult, b: TrialResult) -> TrialResult:
        """Of two sizes within the noise, the one the tie rule takes."""
        raise NotImplementedError

    def _runner_up(self, choice: TrialResult, others: list[TrialResult]) -> TrialResult:
        """What the choice is weighed against: the fastest other size that fit."""
        return max(others, key=lambda r: (r.samples_per_sec, -r.size))

    def _noise(self, choice: TrialResult, other: TrialResult) -> float:
        """How well two throughputs are known: the larger of the two measurements' spreads."""
        return max(choice.spread or 0.0, other.spread or 0.0)

    def measured(self) -> list[TrialResult]:
        """One row per size run, its measurements combined (:func:`combine`), in the order first measured."""
        by_size: dict[int, list[TrialResult]] = {}
        for r in self.results:
            if r.outcome != PREDICTED:
                by_size.setdefault(r.size, []).append(r)
        return [combine(rows) for rows in by_size.values()]

    def _margin(self, choice: TrialResult, other: TrialResult) -> Margin:
        a, b = choice.samples_per_sec or 0.0, other.samples_per_sec or 0.0
        runs = [r.size for r in self.results if r.outcome != PREDICTED]
        return Margin(
            choice.size,
            choice.accumulate,
            other.size,
            other.accumulate,
            gap=round((a - b) / max(a, b), 4) if max(a, b) > 0 else 0.0,
            noise=self._noise(choice, other),
            remeasured=runs.count(choice.size) > 1 and runs.count(other.size) > 1,
        )

    def _decision(self) -> tuple[TrialResult | None, Margin | None]:
        fits = [r for r in self.measured() if r.fits and r.samples_per_sec is not None]
        if not fits:
            return None, None
        choice = self._rule(fits)
        others = [r for r in fits if r.size != choice.size]
        if not others or not self._decides_by_throughput():
            return choice, None
        other = self._runner_up(choice, others)
        margin = self._margin(choice, other)
        if margin.within_noise:
            chosen = self._tie(choice, other)
            if chosen is not choice:
                choice, margin = chosen, self._margin(chosen, choice)
        return choice, margin

    @property
    def result(self) -> TrialResult | None:
        """The choice: each size's measurements combined; between two within the noise, by the tie rule."""
        return self._decision()[0]

    @property
    def margin(self) -> Margin | None:
        """How far the choice stands from the fastest other size that fit; None with no other, or no throughput
        decision (``"max_fit"``)."""
        return self._decision()[1]

    def _measure_again(self) -> int | None:
        """The next size to measure once more: both of the decisive pair while they are within the noise."""
        if not self._again and len(self.remeasured) < self.remeasures:
            margin = self.margin
            if margin is not None and margin.within_noise:
                pair = (min(margin.size, margin.runner_up), max(margin.size, margin.runner_up))
                self.remeasured.append(pair)
                self._again = list(pair)
        return self._again.pop(0) if self._again else None


class SizeSearch(_Climb):
    """Tries sizes from small to large and stops as soon as more would not pay.

    ``propose()`` gives the next size to run (None when done), ``observe(result)`` takes its measurement, and
    ``result`` is the choice: in ``"throughput"`` mode the highest measured samples/s among trials that fit
    (within ``tolerance`` of it, the one with the smaller peak memory); in ``"max_fit"`` mode the largest size that
    fit. It never returns a size it did not run.

    Climbing stops at the first trial that does not fit (OOM, spill, or memory within the headroom), and in
    ``"throughput"`` mode also once a step up gained less than ``min_gain`` or lost more than ``tolerance``.
    After a trial that does not fit, one size halfway between the best fit and the failure is tried (``refine``).

    In ``"throughput"`` mode, when the choice and the fastest other size that fit are within the measurement's
    noise (their throughputs differ by no more than the larger of their ``spread``; see :attr:`margin`), both are
    measured again, smaller first, and the choice is made on the combined measurements (:func:`combine`). If they
    are still within the noise, the one with the smaller peak memory is taken (``tie_rule``): the measurements
    cannot tell them apart, and the smaller leaves more memory free, as within ``tolerance``.

    Args:
        candidates: sizes to climb through, e.g. :func:`power_ladder`.
        mode: ``"throughput"`` or ``"max_fit"``.
        min_gain: relative throughput gain below which climbing stops.
        tolerance: sizes within this fraction of the best throughput count as equal (the smaller wins).
        refine: try one size between the best fit and the first failure.
        granularity: refined sizes are multiples of this.
        forecast: sizes it puts clearly above the capacity are not run (a ``"predicted_over"`` row); the largest
            size it predicts to fit is tried instead.
        remeasures: how many times at most a pair within the noise is measured again.

    Example:
        >>> search = SizeSearch([32, 64, 128, 256])
        >>> rates = {32: 1000.0, 64: 1800.0, 128: 1850.0}
        >>> while (size := search.propose()) is not None:
        ...     search.observe(TrialResult(size, 1.0, 0, rates[size], "ok"))
        >>> [r.size for r in search.results], search.result.size
        ([32, 64, 128], 128)
    """

    def __init__(
        self,
        candidates: Sequence[int],
        mode: str = "throughput",
        min_gain: float = 0.05,
        tolerance: float = 0.01,
        refine: bool = True,
        granularity: int = 8,
        forecast: Forecast | None = None,
        remeasures: int = 1,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"`mode` must be one of {MODES}, got {mode!r}")
        super().__init__(candidates, min_gain, tolerance, forecast, remeasures)
        self.mode = mode
        self.refine = refine
        self.granularity = granularity
        self._refined = False

    def propose(self) -> int | None:
        if self._pending is not None:
            return self._pending
        if self._climbing and self._next < len(self.candidates):
            size = self.candidates[self._next]
            if not self._predicted_over(size):
                self._pending = size
                return self._pending
            self._climbing = False  # larger sizes are further above; the largest predicted to fit instead
            instead = self.forecast.largest_fit(self.results, self.granularity) if self.forecast else None
            if instead is not None and self._untried_fit_between(instead, size):
                self._pending = instead
                return self._pending
        self._climbing = False
        midpoint = self._refinement()
        if midpoint is not None:
            self._refined = True
            if not self._predicted_over(midpoint, record=False):
                self._pending = midpoint
        if self._pending is None:
            self._pending = self._measure_again()
        return self._pending

    def _predicted_over(self, size: int, record: bool = True) -> bool:
        """Whether the forecast rules ``size`` out (a size of the ladder gets a row saying so)."""
        if self.forecast is None or not self.forecast.clearly_over(self.results, size):
            return False
        if record:
            self.results.append(self.forecast.skipped(self.results, size))
        return True

    def _untried_fit_between(self, size: int, above: int) -> bool:
        fits = [r.size for r in self.results if r.fits]
        return size not in {r.size for r in self.results} and max(fits, default=0) < size < above

    def observe(self, result: TrialResult) -> None:
        previous = [r for r in self.results if r.fits]
        self._take(result)
        if not self._climbing:
            return
        self._next += 1
        if not result.fits:
            self._climbing = False
        elif self.mode == "throughput" and previous and result.samples_per_sec is not None:
            last = previous[-1].samples_per_sec or 0.0
            best = max(r.samples_per_sec or 0.0 for r in previous)
            if result.samples_per_sec < last * (1 + self.min_gain) or result.samples_per_sec < best * (
                1 - self.tolerance
            ):
                self._climbing = False

    def _refinement(self) -> int | None:
        if not self.refine or self._refined:
            return None
        fits = [r.size for r in self.results if r.fits]
        fails = [r.size for r in self.results if not r.fits]
        if not fits or not fails:
            return None
        low, high = max(fits), min(f for f in fails)
        if high < low:
            return None
        mid = (low + high) // 2 // self.granularity * self.granularity
        tried = {r.size for r in self.results}
        return mid if low < mid < high and mid not in tried else None

    tie_rule = "the smaller peak memory"

    def _decides_by_throughput(self) -> bool:
        return self.mode == "throughput"

    def _rule(self, fits: list[TrialResult]) -> TrialResult:
        if self.mode == "max_fit":
            return max(fits, key=lambda r: r.size)
        best = max(r.samples_per_sec for r in fits)  # type: ignore[type-var]
        close = [r for r in fits if r.samples_per_sec >= best * (1 - self.tolerance)]  # type: ignore[operator]
        return min(close, key=self._memory)

    def _tie(self, a: TrialResult, b: TrialResult) -> TrialResult:
        return min((a, b), key=self._memory)

    @staticmethod
    def _memory(r: TrialResult) -> tuple[int, int]:
        return (r.peak_bytes if r.peak_bytes is not None else r.size, r.size)


class AccumulationSearch(_Climb):
    """Measures every micro-batch from the smallest up, the direct batch included, and keeps the one that
    accumulates least unless another is clearly faster.

    Every (micro-batch, accumulation) pair holds the same samples per optimizer step, so they differ in speed and
    memory only; but the direct batch trains exactly as asked (BatchNorm statistics over the whole batch), and each
    halving away from it has to pay for itself. The choice is the largest micro-batch that fits whose throughput,
    raised by ``min_gain``, still reaches the fastest one's within ``tolerance``: a smaller micro-batch is chosen only
    when it is more than ``min_gain`` faster.

    Throughput is not monotonic in the micro-batch (on some cards accumulating is faster, on others the direct
    batch), so a slower micro-batch does not end the search: each candidate is measured up to the first that does
    not fit (OOM, spill, memory within the headroom), larger ones needing more memory still. With a ``forecast``, a
    micro-batch it puts clearly above the capacity is not run (a ``"predicted_over"`` row), nor any larger one.

    When the choice and the fastest other micro-batch are within the measurement's noise (their throughputs differ
    by no more than the larger of their ``spread``; see :attr:`margin`), both are measured again, smaller first,
    and the choice is made on the combined measurements; if they still are, the larger micro-batch is taken
    (``tie_rule``): it is the nearer to the direct batch, and the rule within ``min_gain`` already prefers it.

    With ``batch_statistics`` (the model has BatchNorm layers, whose statistics a micro-batch changes), a choice that
    accumulates more than the largest micro-batch that fit is weighed against that one instead, and against the
    machine's noise: the largest ``spread`` of any micro-batch measured in the search, not only of the two (on a busy
    machine one quiet trial can look steady and fast). Within it, both are measured again and, still within it, the
    larger micro-batch is taken: a gain the machine cannot tell from its noise does not change what training sees.

    ``propose()``, ``observe(result)``, ``result``, ``results`` and ``best_rate`` as for :class:`SizeSearch`; it
    never returns a size it did not run.

    Args:
        candidates: the micro-batches, e.g. from :func:`accumulation_candidates`.
        min_gain: how much faster (a fraction) a micro-batch that accumulates more must be to be chosen.
        tolerance: throughputs within this fraction of each other count as equal.
        forecast: micro-batches it puts clearly above the capacity are not run.
        remeasures: how many times at most a pair within the noise is measured again.
        batch_statistics: the model's training depends on the micro-batch (BatchNorm): a choice that accumulates more
            must stand beyond the machine's noise against the largest micro-batch that fit.

    Example:
        >>> def search(rates):
        ...     search = AccumulationSearch(sorted(rates), min_gain=0.05)
        ...     while (size := search.propose()) is not None:
        ...         search.observe(TrialResult(size, 1.0, 0, rates[size], "ok"))
        ...     return [r.size for r in search.results], search.result.size
        >>> search({4: 600.0, 8: 1016.0, 16: 1000.0})  # 8 x 2 is 1.6 % faster than 16 x 1: not enough
        ([4, 8, 16], 16)
        >>> search({4: 1000.0, 8: 900.0, 16: 1200.0})  # 8 was slower than 4; the direct batch is still measured
        ([4, 8, 16], 16)
    """

    tie_rule = "the larger micro-batch (the nearer to the direct batch)"

    def __init__(
        self,
        candidates: Sequence[int],
        min_gain: float = 0.05,
        tolerance: float = 0.01,
        forecast: Forecast | None = None,
        remeasures: int = 1,
        batch_statistics: bool = False,
    ) -> None:
        super().__init__(candidates, min_gain, tolerance, forecast, remeasures)
        self.batch_statistics = batch_statistics

    def _runner_up(self, choice: TrialResult, others: list[TrialResult]) -> TrialResult:
        largest = max(others, key=lambda r: r.size)
        if self.batch_statistics and largest.size > choice.size:
            return largest  # the micro-batch nearest to the direct batch that fit, which the choice changes
        return super()._runner_up(choice, others)

    def _noise(self, choice: TrialResult, other: TrialResult) -> float:
        if not self.batch_statistics:
            return super()._noise(choice, other)
        fits = [r for r in self.measured() if r.fits and r.samples_per_sec is not None]
        return max((r.spread or 0.0 for r in fits), default=0.0)  # the machine's: the noisiest trial's

    def _choosable(self, rate: float, best: float) -> bool:
        return rate * (1 + self.min_gain) >= best * (1 - self.tolerance)

    def propose(self) -> int | None:
        if self._pending is None and self._climbing and self._next < len(self.candidates):
            size = self.candidates[self._next]
            if self.forecast is not None and self.forecast.clearly_over(self.results, size):
                self.results.append(self.forecast.skipped(self.results, size))  # not run; nor larger ones
                self._climbing = False
            else:
                self._pending = size
        if self._pending is None:
            self._climbing = False
            self._pending = self._measure_again()
        return self._pending

    def observe(self, result: TrialResult) -> None:
        self._take(result)
        if not self._climbing:
            return
        self._next += 1
        if not result.fits:  # larger micro-batches need more memory still
            self._climbing = False

    def _rule(self, fits: list[TrialResult]) -> TrialResult:
        best = max(r.samples_per_sec for r in fits)  # type: ignore[type-var]
        return max((r for r in fits if self._choosable(r.samples_per_sec, best)), key=lambda r: r.size)  # type: ignore[arg-type]

    def _tie(self, a: TrialResult, b: TrialResult) -> TrialResult:
        return max((a, b), key=lambda r: r.size)


def accumulation_candidates(per_device_batch: int, min_micro_batch: int = 1) -> list[tuple[int, int]]:
    """(micro-batch, accumulation steps) pairs that keep ``per_device_batch``: halving while it divides evenly.

    Example:
        >>> accumulation_candidates(256, min_micro_batch=32)
        [(32, 8), (64, 4), (128, 2), (256, 1)]
        >>> accumulation_candidates(96)
        [(3, 32), (6, 16), (12, 8), (24, 4), (48, 2), (96, 1)]
        >>> accumulation_candidates(256, min_micro_batch=512)
        Traceback (most recent call last):
        ...
        ValueError: the smallest micro-batch, 512, is larger than the per-device batch, 256
    """
    if per_device_batch < 1:
        raise ValueError(f"the per-device batch must be >= 1, got {per_device_batch}")
    if min_micro_batch > per_device_batch:
        raise ValueError(
            f"the smallest micro-batch, {min_micro_batch}, is larger than the per-device batch, {per_device_batch}"
        )
    pairs = []
    steps = 1
    while per_device_batch % steps == 0 and per_device_batch // steps >= max(1, min_micro_batch):
        pairs.append((per_device_batch // steps, steps))
        steps *= 2
    return sorted(pairs)
