"""MemGuard's step timeline: batch starts in, timed steps for the detector and each epoch's figures out."""

from __future__ import annotations

from dataclasses import replace

from lightning_memguard.core.detector import SpillDetector
from lightning_memguard.core.reading import MemoryReading
from lightning_memguard.core.spill import SpillReport, Verdict
from lightning_memguard.core.throughput import StepStats, summarize_steps


class StepTimeline:
    """One fit's training steps, each timed from its batch's start to the next batch's start, fed to a detector.

    Everything MemGuard learns during one ``fit`` lives here, so a new fit starts from a new timeline: the open step,
    the epoch's step times and samples, the steps not yet given to the detector, and the spill once one is found.
    The caller reads the clock and memory; the timeline only says when memory should be read (the detector asks, or
    every ``read_every`` steps of an epoch), and judges a reading with :meth:`judge`.

    A step that validation, a checkpoint or the epoch's end interrupts (:meth:`interrupt`) has no clean interval:
    it is timed up to the interruption and kept aside, used only when the epoch has no complete interval (one batch
    per epoch, ``fast_dev_run``). So is a step in which ``torch.compile`` compiled: it neither sets the reference
    nor looks like a spill.

    Args:
        detector: judges the steps and the memory readings; its reference may come from a checkpoint.
        read_every: read memory at least every this many steps of an epoch.

    Example:
        >>> timeline = StepTimeline(detector=SpillDetector(16 * 10**9, warmup_steps=0, reference_steps=1))
        >>> timeline.batch_start(0.0, samples=8), timeline.batch_start(0.1, samples=8)  # the second closes a step
        (False, True)
        >>> def read(used): return MemoryReading(used, 0, 16 * 10**9)
        >>> timeline.judge(read(10**9), step=1) is None, timeline.judge(read(17 * 10**9), step=1).reason
        (True, 'peak memory above the physical capacity')
        >>> timeline.interrupt(0.3)
        >>> timeline.epoch_stats()
        StepStats(steps=1, step_ms=100.0, samples_per_sec=80.0)
    """

    def __init__(self, *, detector: SpillDetector, read_every: int = 50) -> None:
        if read_every < 1:
            raise ValueError(f"`read_every` must be >= 1, got {read_every!r}")
        self.detector = detector
        self.read_every = read_every
        self.spill: SpillReport | None = None
        self.batch = 0  # samples of the batch in flight (or the last one)
        self.start_epoch()

    def start_epoch(self) -> None:
        """Forget the last epoch's steps: each epoch's figures are its own."""
        self.durations: list[float] = []
        self.samples: list[int] = []
        self.full_batch = 0  # the largest batch of the epoch so far, the one in flight included
        self.open_steps: list[tuple[float, int]] = []
        self._start: float | None = None
        self._unfed = 0  # steps timed but not yet given to the detector
        self._feed_every = 1  # give them over once this many have gathered

    @property
    def step_open(self) -> bool:
        """Whether a batch has started and nothing has ended it yet."""
        return self._start is not None

    def batch_start(self, now: float, samples: int, compiled: bool = False) -> bool:
        """A training batch of ``samples`` starts at ``now``, closing the step before it; True: read memory now.
        ``compiled``: ``torch.compile`` compiled during the step it closes (the first steps, a last short batch):
        compile time, not a slowdown, so that step is kept aside like an interrupted one.

        This runs on every training step: a subtraction and two appends; the detector takes the steps a few at a
        time (every step while it watches closely)."""
        start = self._start
        self._start = now
        wants = False
        if start is not None and compiled:
            self.open_steps.append((now - start, self.batch))
        elif start is not None:
            seconds = now - start
            self.durations.append(seconds)
            self.samples.append(self.batch)
            self._unfed += 1
            # the steps go over a window at a time; a step this slow goes over at once (its window is judged)
            ref = self.detector.reference_rate
            if self._unfed >= self._feed_every or (ref and seconds * ref > self.batch * self.detector.read_trigger):
                wants = self.feed()
        self.batch = samples
        self.full_batch = max(self.full_batch, samples)
        return wants

    def interrupt(self, now: float) -> None:
        """Validation, a checkpoint or the epoch's end comes before the next batch: the open step is timed up to
        ``now`` and kept aside."""
        if self._start is not None:
            self.open_steps.append((now - self._start, self.batch))
            self._start = None

    def feed(self) -> bool:
        """Give the detector the steps it has not seen; True when memory should be read now."""
        count, self._unfed = self._unfed, 0
        if count == 0 or self.spill is not None:
            return False
        detector = self.detector
        wants = detector.observe_steps(self.durations[-count:], self.samples[-count:])
        self._feed_every = 1 if detector.watching else detector.read_window
        return wants or len(self.durations) % self.read_every < count

    def judge(self, reading: MemoryReading, step: int) -> SpillReport | None:
        """Judge the latest steps against a memory reading; return the spill, numbered with the training ``step``,
        the first time one is found, else None."""
        if self.spill is not None:
            return None
        detector = self.detector
        report = detector.observe_memory(reading)
        self._feed_every = 1 if detector.watching else detector.read_window
        if report.verdict is not Verdict.SPILL:
            return None
        self.spill = replace(report, step=step)
        return self.spill

    def epoch_stats(self) -> StepStats | None:
        """Median step time and throughput of the epoch's complete steps, else of its interrupted ones."""
        stats = summarize_steps(self.durations, self.samples)
        if stats is None and self.open_steps:
            stats = summarize_steps([d for d, _ in self.open_steps], [n for _, n in self.open_steps])
        return stats
