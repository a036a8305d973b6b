"""Searching batch sizes by measuring: a step object that proposes sizes and learns from each trial."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from lightning_memguard.core.epoch import EpochLength
from lightning_memguard.core.spill import Evidence, Verdict, judge

OK, OOM, SPILL, OVER_HEADROOM = "ok", "oom", "spill", "over_headroom"
PREDICTED = "predicted_over"  # not run: the memory line fitted to the measured sizes puts it above the capacity
MODES = ("throughput", "max_fit")


@dataclass(frozen=True)
class TrialResult:
    """One measured trial.

    Attributes:
        size: the batch (or micro-batch) size tried.
        step_ms: median time of one step, None if the trial failed before it was timed.
        peak_bytes: peak memory of the trial (plus other processes' use), None if unknown.
        samples_per_sec: ``size`` over the median step time.
        outcome: ``"ok"``, ``"oom"``, ``"spill"`` or ``"over_headroom"``; ``"predicted_over"`` for a size that was
            not run because :class:`Forecast` put it clearly above the capacity (``peak_bytes`` is the prediction).
        accumulate: gradient-accumulation steps used with this size (1 for a plain batch size).
        compiled: the model ran under ``torch.compile`` (its steps are the compiled graph's, compile time apart).
        compile_s: seconds of the trial's steps in which ``torch.compile`` compiled; not in ``step_ms``.
    """

    size: int
    step_ms: float | None
    peak_bytes: int | None
    samples_per_sec: float | None
    outcome: str
    accumulate: int = 1
    compiled: bool = False
    compile_s: float = 0.0

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
    top = epoch.largest_batch(accumulate)
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


class _Climb:
    """What both searches share: the sizes climbed, the results so far, the size proposed and not yet observed."""

    def __init__(self, candidates: Sequence[int], min_gain: float, tolerance: float, forecast: Forecast | None) -> None:
        if not candidates or any(int(c) != c or c < 1 for c in candidates):
            raise ValueError(f"`candidates` must be positive integers, got {list(candidates)!r}")
        self.candidates = sorted(set(int(c) for c in candidates))
        self.min_gain = min_gain
        self.tolerance = tolerance
        self.forecast = forecast
        self.results: list[TrialResult] = []
        self._next = 0
        self._climbing = True
        self._pending: int | None = None

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


class SizeSearch(_Climb):
    """Tries sizes from small to large and stops as soon as more would not pay.

    ``propose()`` gives the next size to run (None when done), ``observe(result)`` takes its measurement, and
    ``result`` is the choice: in ``"throughput"`` mode the highest measured samples/s among trials that fit
    (within ``tolerance`` of it, the smallest size); in ``"max_fit"`` mode the largest size that fit. It never
    returns a size it did not run.

    Climbing stops at the first trial that does not fit (OOM, spill, or memory within the headroom), and in
    ``"throughput"`` mode also once a step up gained less than ``min_gain`` or lost more than ``tolerance``.
    After a trial that does not fit, one size halfway between the best fit and the failure is tried (``refine``).

    Args:
        candidates: sizes to climb through, e.g. :func:`power_ladder`.
        mode: ``"throughput"`` or ``"max_fit"``.
        min_gain: relative throughput gain below which climbing stops.
        tolerance: sizes within this fraction of the best throughput count as equal (the smaller wins).
        refine: try one size between the best fit and the first failure.
        granularity: refined sizes are multiples of this.
        forecast: sizes it puts clearly above the capacity are not run (a ``"predicted_over"`` row); the largest
            size it predicts to fit is tried instead.

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
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"`mode` must be one of {MODES}, got {mode!r}")
        super().__init__(candidates, min_gain, tolerance, forecast)
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

    @property
    def result(self) -> TrialResult | None:
        fits = [r for r in self.results if r.fits and r.samples_per_sec is not None]
        if not fits:
            return None
        if self.mode == "max_fit":
            return max(fits, key=lambda r: r.size)
        best = max(r.samples_per_sec for r in fits)  # type: ignore[type-var]
        close = [r for r in fits if r.samples_per_sec >= best * (1 - self.tolerance)]  # type: ignore[operator]
        return min(close, key=lambda r: (r.peak_bytes if r.peak_bytes is not None else r.size, r.size))


class AccumulationSearch(_Climb):
    """Tries micro-batches from the smallest up and keeps the one that accumulates least unless another is clearly
    faster.

    Every (micro-batch, accumulation) pair holds the same samples per optimizer step, so they differ in speed and
    memory only; but the direct batch trains exactly as asked (BatchNorm statistics over the whole batch), and each
    halving away from it has to pay for itself. The choice is the largest micro-batch that fits whose throughput,
    raised by ``min_gain``, still reaches the fastest one's within ``tolerance``: a smaller micro-batch is chosen only
    when it is more than ``min_gain`` faster, so two runs whose timings differ by noise choose alike. Climbing stops
    at the first trial that does not fit (OOM, spill, memory within the headroom) and at the first one that could not
    be chosen (slower than the best by more than that margin): larger ones are not expected to be faster again.

    ``propose()``, ``observe(result)``, ``result``, ``results`` and ``best_rate`` as for :class:`SizeSearch`; it
    never returns a size it did not run. With a ``forecast``, a micro-batch it puts clearly above the capacity is
    not run (a ``"predicted_over"`` row), nor any larger one.

    Args:
        candidates: the micro-batches, e.g. from :func:`accumulation_candidates`.
        min_gain: how much faster (a fraction) a micro-batch that accumulates more must be to be chosen.
        tolerance: throughputs within this fraction of each other count as equal.

    Example:
        >>> search = AccumulationSearch([4, 8, 16], min_gain=0.05)
        >>> rates = {4: 600.0, 8: 1016.0, 16: 1000.0}  # 8 x 2 is 1.6 % faster than 16 x 1: noise
        >>> while (size := search.propose()) is not None:
        ...     search.observe(TrialResult(size, 1.0, 0, rates[size], "ok"))
        >>> [r.size for r in search.results], search.result.size
        ([4, 8, 16], 16)
    """

    def __init__(
        self,
        candidates: Sequence[int],
        min_gain: float = 0.05,
        tolerance: float = 0.01,
        forecast: Forecast | None = None,
    ) -> None:
        super().__init__(candidates, min_gain, tolerance, forecast)

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
        return self._pending

    def observe(self, result: TrialResult) -> None:
        self._take(result)
        self._next += 1
        best = self.best_rate
        chooseable = result.fits and result.samples_per_sec is not None
        if not chooseable or (best is not None and not self._choosable(result.samples_per_sec, best)):  # type: ignore[arg-type]
            self._climbing = False

    @property
    def result(self) -> TrialResult | None:
        fits = [r for r in self.results if r.fits and r.samples_per_sec is not None]
        if not fits:
            return None
        best = max(r.samples_per_sec for r in fits)  # type: ignore[type-var]
        return max((r for r in fits if self._choosable(r.samples_per_sec, best)), key=lambda r: r.size)  # type: ignore[arg-type]


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
