"""When to read memory while a run trains, and what the readings say: the spill rule applied step by step."""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence

from lightning_memguard.core.reading import MemoryReading
from lightning_memguard.core.spill import (
    GROWTH,
    Evidence,
    SpillReport,
    Verdict,
    judge,
    shared_baseline,
    shared_threshold,
)


class SpillDetector:
    """Follows a run step by step and says when to read memory and whether it spills.

    Feed it every training step's duration and samples with :meth:`observe_step`, or several steps at once with
    :meth:`observe_steps` (as MemGuard does while :attr:`watching` is False); it answers whether memory should be
    read now: every step while warming up and measuring the reference, then only when the last
    ``read_window`` steps together run ``read_trigger`` times slower than the reference (host-side step times of an
    asynchronous GPU jitter from step to step; their sum over a few steps does not). After a reading far below the
    capacity it rests ``patience - 1`` steps, twice as long after each further such reading, taken while steps are
    slow, that shows no memory growth, up to ``max_rest`` steps; a reading at the capacity ends the rest. Feed the
    reading to :meth:`observe_memory`. A validation loop, a checkpoint or a dataloader stall makes one step slow,
    and one slow step never stops a healthy run.

    Args:
        capacity: physical memory in bytes.
        headroom: fraction of capacity counted as "at the capacity".
        warmup_steps: steps ignored for the reference (cudnn autotuning, allocator growth).
        reference_steps: steps whose median throughput becomes the reference.
        collapse: a step this many times slower than the reference counts as collapsed.
        patience: consecutive collapsed steps needed, with memory at capacity, to call a spill.
        read_trigger: a step this many times slower than the reference is reason enough to read memory.
        read_window: steps whose summed time decides whether memory is read.
        refresh_every: after this many steps with nothing suspect, the reference becomes their throughput
            (the first steps of an asynchronous GPU run look fast on the host while its queue fills up).
        max_rest: the longest rest between readings while memory stays far below the capacity and does not grow:
            it bounds both what a jittery host costs and how late a spill that starts mid-run is seen.
        offload: bytes the run keeps in system RAM on purpose (activation offload, block swap): where the driver
            counts this process's memory in system RAM (Windows), that much is not a spill.

    Example:
        >>> det = SpillDetector(capacity=16 * 10**9, warmup_steps=1, reference_steps=2)
        >>> [det.observe_step(0.1, 100) for _ in range(3)]
        [True, True, True]
        >>> det.reference_rate
        1000.0
        >>> from lightning_memguard.core.reading import MemoryReading
        >>> det.observe_memory(MemoryReading(15_300_000_000, 0, 16 * 10**9)).verdict.value  # fast, near the capacity
        'suspect'
        >>> det.observe_step(0.5, 100), det.observe_step(0.5, 100), det.observe_step(0.5, 100)
        (True, True, True)
        >>> report = det.observe_memory(MemoryReading(15_900_000_000, 0, 16 * 10**9))
        >>> report.verdict.value, report.step, report.slowdown
        ('spill', 6, 5.0)
    """

    def __init__(
        self,
        capacity: int,
        headroom: float = 0.05,
        warmup_steps: int = 3,
        reference_steps: int = 5,
        collapse: float = 2.5,
        patience: int = 3,
        read_trigger: float = 1.5,
        refresh_every: int = 25,
        read_window: int = 5,
        max_rest: int = 16,
        offload: int = 0,
    ) -> None:
        self.capacity = capacity
        self.offload = offload
        self.shared_baseline = 0  # what Windows counted in system RAM before the run (see set_baseline)
        self.read_trigger = read_trigger
        self.headroom = headroom
        self.warmup_steps = warmup_steps
        self.reference_steps = reference_steps
        self.collapse = collapse
        self.patience = patience
        self.steps = 0
        self.reference_rate: float | None = None
        self._reference: list[float] = []
        # the last steps' seconds and samples: the read window, and the last `patience` steps' rates
        self._seconds: deque[float] = deque(maxlen=max(read_window, patience))
        self._samples: deque[int] = deque(maxlen=max(read_window, patience))
        self.read_window = read_window
        self._watch_until = warmup_steps + reference_steps + patience  # every step is read until here
        self._quiet = 0  # steps left before a slow window may trigger another read
        self._at_capacity = False  # the last reading was near the capacity
        self.refresh_every = refresh_every
        self.healthy_used: int | None = None  # the most memory read while no step was slow
        self._since_seconds = 0.0  # steps since the reference was last refreshed: time, samples, count
        self._since_samples = 0
        self._since_steps = 0
        self.max_rest = max_rest
        self._rest = patience - 1  # the next rest after a reading far below the capacity
        self._last_far: int | None = None  # that reading, to tell growth from a stall

    def observe_step(self, seconds: float, samples: int) -> bool:
        """Record one step; return True when memory should be read before the next one."""
        return self.observe_steps((seconds,), (samples,))

    @property
    def watching(self) -> bool:
        """Whether each step should be fed on its own: while warming up and measuring the reference, and while the
        last reading was at the capacity. Otherwise feeding ``read_window`` steps at a time to
        :meth:`observe_steps` decides the same at a fraction of the cost."""
        return not self._steady or self._at_capacity

    @property
    def _steady(self) -> bool:
        """Past warm-up and the reference: steps are judged by the window, no longer each read."""
        return self.reference_rate is not None and self.steps >= self._watch_until

    def observe_steps(self, seconds: Sequence[float], samples: Sequence[int]) -> bool:
        """Record steps (one or several, oldest first); return True when memory should be read now."""
        if self._steady:  # the common case, first
            return self._observe_steady(seconds, samples)
        wants = False
        for i, (s, n) in enumerate(zip(seconds, samples, strict=True)):
            if self._steady:
                return self._observe_steady(seconds[i:], samples[i:]) or wants
            # warming up and measuring the reference: memory is read after every step
            self.steps += 1
            self._seconds.append(s)
            self._samples.append(n)
            if self.reference_rate is None and self.steps > self.warmup_steps:
                self._reference.append(n / s if s > 0 else float("inf"))
                if len(self._reference) >= self.reference_steps:
                    self.reference_rate = statistics.median(self._reference)
            wants = True
        return wants

    def _observe_steady(self, seconds: Sequence[float], samples: Sequence[int]) -> bool:
        count = len(seconds)
        if count != len(samples):
            raise ValueError(f"{count} step times but {len(samples)} sample counts")
        self.steps += count
        self._seconds.extend(seconds)
        self._samples.extend(samples)
        total, done = sum(seconds), sum(samples)
        self._since_seconds += total
        self._since_samples += done
        self._since_steps += count
        if self._since_steps >= self.refresh_every:
            if self._since_seconds > 0:  # the steps' own throughput: host-side jitter averages out
                self.reference_rate = self._since_samples / self._since_seconds
            self._forget_since_refresh()
        if self._quiet >= count:
            self._quiet -= count
            return False
        self._quiet = 0
        # fed a window at a time (as MemGuard does), its sums are at hand
        return self._window_slow((total, done) if count == self.read_window else None)

    def _forget_since_refresh(self) -> None:
        self._since_seconds, self._since_samples, self._since_steps = 0.0, 0, 0

    def _recent_rates(self) -> list[float]:
        pairs = list(zip(self._seconds, self._samples, strict=True))[-self.patience :]
        return [n / s if s > 0 else float("inf") for s, n in pairs]

    def _window_slow(self, sums: tuple[float, int] | None = None) -> bool:
        """Whether the last ``read_window`` steps (their summed seconds and samples, if given) ran slow."""
        if self.reference_rate is None:
            return False
        if sums is None:
            sums = sum(list(self._seconds)[-self.read_window :]), sum(list(self._samples)[-self.read_window :])
        total, samples = sums
        return total > 0 and samples / total < self.reference_rate / self.read_trigger

    def observe_memory(self, reading: MemoryReading) -> SpillReport:
        """Judge the latest steps against a memory reading by the spill rule (``core.spill.judge``)."""
        recent = self._recent_rates()
        evidence = Evidence(
            reading,
            self.capacity,
            self.headroom,
            self.reference_rate,
            recent,
            self.collapse,
            self.patience,
            self.healthy_used,
            self.shared_baseline,
            self.offload,
        )
        judgement = judge(evidence)
        used_bytes = evidence.used
        ref = self.reference_rate
        fast = bool(ref and recent) and min(recent[-1], statistics.median(recent)) >= ref / self.collapse  # type: ignore[operator]
        if judgement.verdict is not Verdict.SPILL and fast:
            self.healthy_used = max(self.healthy_used or 0, used_bytes)
        moved = evidence.in_system_ram or 0
        if evidence.near or moved > shared_threshold(self.capacity) // 2:
            self._quiet = 0  # memory at the capacity: look at every step until it is decided
            self._at_capacity = True
            self._forget_since_refresh()  # and take no new reference from these steps
            self._rest, self._last_far = self.patience - 1, None
        else:  # slow steps far below the capacity are stalls, not a spill; while memory does not grow, rest longer
            self._at_capacity = False
            grew = self._last_far is None or used_bytes > self._last_far + self.capacity * GROWTH
            stalled = self._window_slow() and not grew
            self._rest = min(2 * max(self._rest, 1), self.max_rest) if stalled else self.patience - 1
            self._last_far = used_bytes
            self._quiet = self._rest
        return SpillReport(
            verdict=judgement.verdict,
            reason=judgement.reason,
            step=self.steps,
            used_bytes=used_bytes,
            capacity=self.capacity,
            reference_rate=self.reference_rate,
            current_rate=recent[-1] if recent else None,
            other_bytes=reading.other_processes,
            in_system_ram=evidence.in_system_ram,
        )

    def set_baseline(self, reading: MemoryReading) -> None:
        """Take this reading, at the start of a run, as what Windows counted in system RAM before it: only growth
        past it (beyond what is pinned) is judged."""
        self.shared_baseline = shared_baseline(reading)

    def state_dict(self) -> dict[str, float | None]:
        return {"reference_rate": self.reference_rate, "healthy_used_bytes": self.healthy_used}

    def load_state_dict(self, state: dict[str, float | None]) -> None:
        if state.get("reference_rate") is not None:
            self.reference_rate = float(state["reference_rate"])  # type: ignore[arg-type]
        if state.get("healthy_used_bytes") is not None:
            self.healthy_used = int(state["healthy_used_bytes"])  # type: ignore[arg-type]
