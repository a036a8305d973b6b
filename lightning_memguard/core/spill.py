"""The spill rule: a memory reading, with what is known of the run, in; a verdict and its reasons out.

MemGuard judges every reading of a fit by it (through :class:`~lightning_memguard.core.detector.SpillDetector`,
which decides when to read), and the tuners judge each trial by it (:func:`trial_outcome`). Each signal is a small
rule of its own: a function from :class:`Evidence` to a :class:`Finding`, or None where it has nothing to say.
Adding a signal is a field of :class:`~lightning_memguard.core.reading.MemoryReading` (filled by the probes), a
rule here, listed in :data:`RULES`, and its test.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

from lightning_memguard.core.reading import MemoryReading

GROWTH = 0.005  # memory that rose by less than this fraction of the capacity has not grown


class Verdict(str, Enum):
    """How a reading looks. ``SPILL`` is acted on; ``SUSPECT`` only makes the detector look closer."""

    OK = "ok"
    SUSPECT = "suspect"
    SPILL = "spill"


@dataclass(frozen=True)
class Evidence:
    """One reading and what is known of the run when it was taken.

    Attributes:
        reading: the probe's reading, whole.
        capacity: the memory judged against: the device's, or the one the user set.
        headroom: the fraction of ``capacity`` a healthy run leaves free.
        reference_rate: samples/s of the run while healthy (MemGuard: the run's own after warm-up; a trial: the
            best of the smaller sizes), None before it is known.
        recent_rates: samples/s of the latest steps, oldest first.
        collapse: a step this many times slower than the reference has collapsed.
        patience: how many of the latest steps must all have collapsed.
        healthy_used: the most memory (as :attr:`MemoryReading.used`) read while the run was fast; None where
            there was no such reading.
        shared_baseline: this process's shared GPU memory at the start, less what it had pinned then (Windows
            counts only; 0 elsewhere).
        offload: bytes this run keeps in system RAM on purpose (activation offload, block swap), as the user said.
    """

    reading: MemoryReading
    capacity: int
    headroom: float = 0.05
    reference_rate: float | None = None
    recent_rates: Sequence[float] = ()
    collapse: float = 2.5
    patience: int = 1
    healthy_used: int | None = None
    shared_baseline: int = 0
    offload: int = 0

    @property
    def used(self) -> int:
        return self.reading.used

    @property
    def near(self) -> bool:
        """Memory leaves less than the headroom free.

        Example:
            >>> Evidence(MemoryReading(15 * 10**9, 0, 0), 16 * 10**9).near
            False
            >>> Evidence(MemoryReading(15_300_000_000, 0, 0), 16 * 10**9).near
            True
        """
        return self.used > self.capacity * (1.0 - self.headroom)

    @property
    def in_system_ram(self) -> int | None:
        """This run's GPU memory that the driver moved into system RAM, as Windows counts it: the shared figure
        less what was there at the start, what is pinned on purpose and the offload the user chose; None where the
        driver's count is not read.

        Example:
            >>> reading = MemoryReading(8 * 10**9, 0, 0, shared=3_500_000_000, pinned=2 * 10**9)
            >>> Evidence(reading, 16 * 10**9, shared_baseline=200_000_000).in_system_ram
            1300000000
        """
        shared = self.reading.shared
        if shared is None:
            return None
        return max(0, shared - (self.reading.pinned or 0) - self.shared_baseline - self.offload)

    @property
    def slow(self) -> list[bool]:
        """For each of the last ``patience`` steps, whether it collapsed (empty without a reference)."""
        ref = self.reference_rate
        return [r < ref / self.collapse for r in list(self.recent_rates)[-self.patience :]] if ref else []

    @property
    def collapsed(self) -> bool:
        """The last ``patience`` steps all collapsed."""
        slow = self.slow
        return len(slow) >= self.patience and all(slow)


@dataclass(frozen=True)
class Finding:
    """What one rule saw."""

    verdict: Verdict
    reason: str


Rule = Callable[[Evidence], "Finding | None"]


def above_capacity(e: Evidence) -> Finding | None:
    """More memory than the device has is impossible without spilling: decisive on its own."""
    if e.used > e.capacity:
        return Finding(Verdict.SPILL, "peak memory above the physical capacity")
    return None


def collapsed_at_capacity(e: Evidence) -> Finding | None:
    """Memory at the capacity and the last steps collapsed: a spill, provided memory has grown past the most the
    run used while it was fast (the same memory that ran fast before cannot be what slows it now; a busy host can,
    and without a fast reading there is nothing to compare with)."""
    if not (e.near and e.collapsed):
        return None
    if e.healthy_used is None or e.used <= e.healthy_used + GROWTH * e.capacity:
        return Finding(Verdict.SUSPECT, "slow steps, memory no higher than when the run was fast")
    return Finding(Verdict.SPILL, "throughput collapsed with memory at the capacity")


def shared_baseline(reading: MemoryReading) -> int:
    """What a reading taken before a run counts in system RAM that the run did not put there (its shared figure
    less what is pinned then); 0 where it is not counted.

    Example:
        >>> shared_baseline(MemoryReading(0, 0, 0, shared=900, pinned=600)), shared_baseline(MemoryReading(0, 0, 0))
        (300, 0)
    """
    return 0 if reading.shared is None else max(0, reading.shared - (reading.pinned or 0))


def shared_threshold(capacity: int) -> int:
    """Memory in system RAM beyond which the driver's count is a spill on its own: 1 % of the capacity, at least
    256 MiB (what Windows itself moves about for a process is far less).

    Example:
        >>> shared_threshold(16 * 10**9), shared_threshold(80 * 10**9)
        (268435456, 800000000)
    """
    return max(256 * 2**20, capacity // 100)


def counted_in_system_ram(e: Evidence) -> Finding | None:
    """Windows counts this run's GPU memory in system RAM beyond what it pins or offloads on purpose: the fallback
    at work, seen where it happens, whatever PyTorch's own figures say. Decisive above a small threshold; collapsed
    steps are named as confirmation."""
    moved = e.in_system_ram
    if moved is None or moved <= shared_threshold(e.capacity):
        return None
    reason = f"Windows counts {moved / 1e9:.2f} GB of this run's GPU memory in system RAM (Shared GPU memory)"
    return Finding(Verdict.SPILL, reason + (", and the steps slowed down" if e.collapsed else ""))


def at_capacity(e: Evidence) -> Finding | None:
    """Memory at the capacity, alone, is only suspect: a full card that runs fast is a healthy run."""
    return Finding(Verdict.SUSPECT, "memory at the capacity") if e.near else None


def slow_steps(e: Evidence) -> Finding | None:
    """Slow steps far from the capacity are suspect at most: a stall, a busy host or a validation loop."""
    if not e.near and any(e.slow):
        return Finding(Verdict.SUSPECT, "slow steps, memory below the capacity")
    return None


RULES: tuple[Rule, ...] = (above_capacity, counted_in_system_ram, collapsed_at_capacity, at_capacity, slow_steps)
"""The signals, in order: the first spill found decides; else the first suspicion."""


@dataclass(frozen=True)
class Judgement:
    """The verdict, the reason that decided it (``""`` when ok) and every rule's finding."""

    verdict: Verdict
    reason: str
    findings: tuple[Finding, ...] = ()


def judge(evidence: Evidence, rules: Sequence[Rule] = RULES) -> Judgement:
    """Judge one reading by every rule.

    Example:
        >>> GB = 10**9
        >>> judge(Evidence(MemoryReading(17 * GB, 0, 0), 16 * GB)).reason
        'peak memory above the physical capacity'
        >>> at_cap = MemoryReading(15_500_000_000, 0, 0)
        >>> judge(Evidence(at_cap, 16 * GB, 0.05, 1000.0, [300.0, 290.0], patience=2, healthy_used=12 * GB)).verdict
        <Verdict.SPILL: 'spill'>
        >>> judge(Evidence(at_cap, 16 * GB, 0.05, 1000.0, [990.0, 300.0], patience=2, healthy_used=12 * GB)).reason
        'memory at the capacity'
        >>> judge(Evidence(MemoryReading(8 * GB, 0, 0), 16 * GB, 0.05, 1000.0, [300.0, 290.0], patience=2)).reason
        'slow steps, memory below the capacity'
        >>> judge(Evidence(MemoryReading(8 * GB, 0, 0), 16 * GB, 0.05, 1000.0, [990.0, 980.0], patience=2)).verdict
        <Verdict.OK: 'ok'>
    """
    findings = tuple(f for rule in rules if (f := rule(evidence)) is not None)
    for wanted in (Verdict.SPILL, Verdict.SUSPECT):
        for finding in findings:
            if finding.verdict is wanted:
                return Judgement(wanted, finding.reason, findings)
    return Judgement(Verdict.OK, "", findings)


@dataclass(frozen=True)
class SpillReport:
    """A verdict on a run and the figures behind it.

    Attributes:
        verdict: ok, suspect or spill.
        reason: what decided it, in words ("" when ok).
        step: the training step (counted by the detector) the verdict belongs to.
        used_bytes: peak memory plus other processes' use.
        capacity: the memory judged against, in bytes.
        reference_rate: the run's own samples/s after warm-up, or None before it is known.
        current_rate: samples/s of the latest step, or None.
        other_bytes: the part of ``used_bytes`` that other processes hold (None: unknown, not counted).
        in_system_ram: this run's GPU memory in system RAM as Windows counts it (None where not counted).
    """

    verdict: Verdict
    reason: str
    step: int
    used_bytes: int
    capacity: int
    reference_rate: float | None = None
    current_rate: float | None = None
    other_bytes: int | None = 0
    in_system_ram: int | None = None

    @property
    def slowdown(self) -> float | None:
        """How many times slower the latest step ran than the reference (e.g. 7.0)."""
        if not self.reference_rate or not self.current_rate:
            return None
        return self.reference_rate / self.current_rate
