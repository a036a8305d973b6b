"""Spill detection: per-step figures in, ok / suspect / spill out, with the evidence."""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from lightning_memguard.core.units import to_gb

GROWTH = 0.005  # memory that rose by less than this fraction of the capacity has not grown


class Verdict(str, Enum):
    """How a window looks. ``SPILL`` is acted on; ``SUSPECT`` only makes the detector look closer."""

    OK = "ok"
    SUSPECT = "suspect"
    SPILL = "spill"


@dataclass(frozen=True)
class SpillReport:
    """A verdict and the figures behind it.

    Attributes:
        verdict: ok, suspect or spill.
        reason: what decided it, in words ("" when ok).
        step: the training step (counted by the detector) the verdict belongs to.
        used_bytes: peak memory plus other processes' use.
        capacity: the device's physical memory, in bytes.
        reference_rate: the run's own samples/s after warm-up, or None before it is known.
        current_rate: samples/s of the latest step, or None.
        other_bytes: the part of ``used_bytes`` that other processes hold (None: unknown, not counted).
    """

    verdict: Verdict
    reason: str
    step: int
    used_bytes: int
    capacity: int
    reference_rate: float | None = None
    current_rate: float | None = None
    other_bytes: int | None = 0

    @property
    def slowdown(self) -> float | None:
        """How many times slower the latest step ran than the reference (e.g. 7.0)."""
        if not self.reference_rate or not self.current_rate:
            return None
        return self.reference_rate / self.current_rate


def detect_spill(
    used_bytes: int,
    capacity: int,
    headroom: float,
    reference_rate: float | None,
    recent_rates: list[float],
    collapse: float,
    patience: int,
    healthy_used: int | None = None,
) -> tuple[Verdict, str]:
    """Judge one window from plain numbers.

    Signals, in order: (a) memory above the physical capacity, impossible without spill, is decisive;
    (b) memory within ``headroom`` of capacity *and* the last ``patience`` steps each ``collapse`` times slower
    than the reference is a spill, provided memory has grown (by more than 0.5 % of capacity) past
    ``healthy_used``, the most the run used while it was fast: the same memory that ran fast before cannot be
    what slows it down now (a busy host can), and without a fast reading there is nothing to compare with.
    Either half alone is only suspect.

    Example:
        >>> detect_spill(17 * 10**9, 16 * 10**9, 0.05, None, [], 2.5, 2)
        (<Verdict.SPILL: 'spill'>, 'peak memory above the physical capacity')
        >>> detect_spill(15_500_000_000, 16 * 10**9, 0.05, 1000.0, [300.0, 290.0], 2.5, 2, 12 * 10**9)[0].value
        'spill'
        >>> detect_spill(15_500_000_000, 16 * 10**9, 0.05, 1000.0, [990.0, 300.0], 2.5, 2, 12 * 10**9)[0].value
        'suspect'
        >>> detect_spill(8 * 10**9, 16 * 10**9, 0.05, 1000.0, [300.0, 290.0], 2.5, 2)[0].value
        'suspect'
        >>> detect_spill(15_500_000_000, 16 * 10**9, 0.05, 1000.0, [300.0, 290.0], 2.5, 2, 15_500_000_000)
        (<Verdict.SUSPECT: 'suspect'>, 'slow steps, memory no higher than when the run was fast')
    """
    if used_bytes > capacity:
        return Verdict.SPILL, "peak memory above the physical capacity"
    near = used_bytes >= capacity * (1.0 - headroom)
    slow = [r < reference_rate / collapse for r in recent_rates[-patience:]] if reference_rate else []
    collapsed = len(slow) >= patience and all(slow)
    if near and collapsed:
        if healthy_used is None or used_bytes <= healthy_used + GROWTH * capacity:
            return Verdict.SUSPECT, "slow steps, memory no higher than when the run was fast"
        return Verdict.SPILL, "throughput collapsed with memory at the capacity"
    if near or any(slow):
        return Verdict.SUSPECT, "memory at the capacity" if near else "slow steps, memory below the capacity"
    return Verdict.OK, ""


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

    Example:
        >>> det = SpillDetector(capacity=16 * 10**9, warmup_steps=1, reference_steps=2)
        >>> [det.observe_step(0.1, 100) for _ in range(3)]
        [True, True, True]
        >>> det.reference_rate
        1000.0
        >>> det.observe_memory(15_300_000_000).verdict.value  # fast, and near the capacity
        'suspect'
        >>> det.observe_step(0.5, 100), det.observe_step(0.5, 100), det.observe_step(0.5, 100)
        (True, True, True)
        >>> report = det.observe_memory(15_900_000_000)
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
    ) -> None:
        self.capacity = capacity
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

    def observe_memory(self, used_bytes: int, other_bytes: int | None = 0) -> SpillReport:
        """Judge the latest steps against a memory reading: ``used_bytes`` is this run's peak plus other processes'
        use, ``other_bytes`` the latter alone (None where it cannot be known), reported with the verdict."""
        recent = self._recent_rates()
        verdict, reason = detect_spill(
            used_bytes,
            self.capacity,
            self.headroom,
            self.reference_rate,
            recent,
            self.collapse,
            self.patience,
            self.healthy_used,
        )
        ref = self.reference_rate
        fast = bool(ref and recent) and min(recent[-1], statistics.median(recent)) >= ref / self.collapse  # type: ignore[operator]
        if verdict is not Verdict.SPILL and fast:
            self.healthy_used = max(self.healthy_used or 0, used_bytes)
        if used_bytes >= self.capacity * (1.0 - self.headroom):
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
            verdict=verdict,
            reason=reason,
            step=self.steps,
            used_bytes=used_bytes,
            capacity=self.capacity,
            reference_rate=self.reference_rate,
            current_rate=recent[-1] if recent else None,
            other_bytes=other_bytes,
        )

    def state_dict(self) -> dict[str, float | None]:
        return {"reference_rate": self.reference_rate, "healthy_used_bytes": self.healthy_used}

    def load_state_dict(self, state: dict[str, float | None]) -> None:
        if state.get("reference_rate") is not None:
            self.reference_rate = float(state["reference_rate"])  # type: ignore[arg-type]
        if state.get("healthy_used_bytes") is not None:
            self.healthy_used = int(state["healthy_used_bytes"])  # type: ignore[arg-type]


CONTROL_PANEL = (
    "NVIDIA Control Panel -> Manage 3D Settings -> CUDA - Sysmem Fallback Policy -> Prefer No Sysmem Fallback"
)
WSL2_SETTING = (
    "the Windows host's NVIDIA Control Panel -> Manage 3D Settings -> Global Settings -> CUDA - Sysmem Fallback"
    " Policy -> Prefer No Sysmem Fallback (WSL2 runs on the host's driver, and Program Settings lists only Windows"
    " programs)"
)

FIXES = (
    "Fixes, most direct first:\n"
    f"  - Windows: {CONTROL_PANEL} (then an overflow raises a real OOM at once);\n"
    f"  - WSL2: {WSL2_SETTING};\n"
    "  - keep the effective batch with less memory: `AccumulationTuner(effective_batch_size=...)`;\n"
    "  - activation checkpointing: `ActivationCheckpointing()` or `checkpoint_resnet(model)`;\n"
    "  - a smaller batch size (`BatchSizeTuner()` measures the fastest one that fits);\n"
    "  - `MemGuard(prevent=True)` turns any future overflow into an immediate out-of-memory error."
)


def format_spill_message(report: SpillReport, batch_size: int | None, checkpoint_path: str | None = None) -> str:
    """The message a user sees when a run is stopped for spilling: the numbers, then the fixes.

    Example:
        >>> r = SpillReport(Verdict.SPILL, "peak memory above the physical capacity", 12, 18_900_000_000,
        ...                 16_000_000_000, 1094.0, 24.0)
        >>> message = format_spill_message(r, 448)
        >>> print(message.splitlines()[0][:75])
        GPU memory is spilling into system RAM at training step 12 (batch size 448)
        >>> "peak 18.90 GB against 16.00 GB of physical memory;" in message
        True
        >>> "(45.6x slower)" in message, "Prefer No Sysmem Fallback" in message
        (True, True)
    """
    parts = [f"GPU memory is spilling into system RAM at training step {report.step}"]
    if batch_size is not None:
        parts.append(f" (batch size {batch_size})")
    parts.append(f": peak {to_gb(report.used_bytes):.2f} GB against {to_gb(report.capacity):.2f} GB of physical memory")
    if report.other_bytes is None:
        parts.append(" (other processes' use unknown, not counted)")
    elif report.other_bytes:
        parts.append(f" (counting {to_gb(report.other_bytes):.2f} GB that other processes hold)")
    if report.reference_rate and report.current_rate:
        parts.append(
            f"; throughput {report.current_rate:.1f} samples/s against {report.reference_rate:.1f} at the start"
            f" of the run ({report.slowdown:.1f}x slower)"
        )
    parts.append(".")
    lines = ["".join(parts), f"Detected by: {report.reason}."]
    lines.append(
        "The driver's sysmem fallback keeps such a run alive at a fraction of its speed instead of raising an"
        " out-of-memory error."
    )
    if checkpoint_path:
        lines.append(f"Nothing is lost: a checkpoint was saved to {checkpoint_path} (resume with ckpt_path=...).")
    lines.append(FIXES)
    return "\n".join(lines)


class SysmemSpillError(RuntimeError):
    """Raised when a run is aborted because GPU memory spilled into system RAM.

    Attributes:
        report: the :class:`SpillReport` behind the decision (None on ranks that only heard of it).
        checkpoint_path: where the run was saved before aborting, if it was.
    """

    def __init__(self, message: str, report: SpillReport | None = None, checkpoint_path: str | None = None):
        super().__init__(message)
        self.report = report
        self.checkpoint_path = checkpoint_path


def fallback_possible(system: str, release: str, driver_model: str | None) -> bool:
    """Whether the driver's sysmem fallback can exist here: Windows with WDDM, or WSL2 (always WDDM underneath).

    Example:
        >>> fallback_possible("Windows", "10", "WDDM"), fallback_possible("Windows", "10", "TCC")
        (True, False)
        >>> fallback_possible("Linux", "5.15.90.1-microsoft-standard-WSL2", None)
        True
        >>> fallback_possible("Linux", "6.8.0-generic", None)
        False
    """
    if system == "Windows":
        return driver_model in (None, "WDDM")
    return is_wsl2(system, release)


def is_wsl2(system: str, release: str) -> bool:
    """Whether this is Linux inside WSL2, whose kernel release names Microsoft.

    Example:
        >>> is_wsl2("Linux", "5.15.153.1-microsoft-standard-WSL2"), is_wsl2("Linux", "6.8.0-generic")
        (True, False)
    """
    return system == "Linux" and "microsoft" in release.lower()


def fallback_advice(system: str, release: str) -> str:
    """How to turn the fallback off on this platform.

    Example:
        >>> fallback_advice("Windows", "11").startswith("NVIDIA Control Panel")
        True
        >>> "Global Settings" in fallback_advice("Linux", "5.15.153.1-microsoft-standard-WSL2")
        True
    """
    return WSL2_SETTING if is_wsl2(system, release) else CONTROL_PANEL


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
