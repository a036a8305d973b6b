"""What a user reads when a run spills: the figures, then the fixes; and the error that stops the run."""

from __future__ import annotations

from lightning_memguard.core.platform import CONTROL_PANEL, WSL2_SETTING
from lightning_memguard.core.spill import SpillReport
from lightning_memguard.core.units import size_formatter

_DRIVER_FIXES = (
    f"  - Windows: {CONTROL_PANEL} (then an overflow raises a real OOM at once);\n  - WSL2: {WSL2_SETTING};\n"
)
_BATCH_FIXES = (
    "  - keep the effective batch with less memory: `AccumulationTuner(effective_batch_size=...)`;\n"
    "  - activation checkpointing: `ActivationCheckpointing()` or `checkpoint_resnet(model)`;\n"
    "  - a smaller batch size (`BatchSizeTuner()` measures the fastest one that fits);\n"
)
_PREVENT = "  - `MemGuard(prevent=True)` turns any future overflow into an immediate out-of-memory error."
FIXES = "Fixes, most direct first:\n" + _DRIVER_FIXES + _BATCH_FIXES + _PREVENT
# where what a step starts from, or other processes' memory, leaves no room for one sample: no batch fix can help
HELD_FIXES = (
    "Fixes, most direct first (no batch size or checkpointing can fit here: see below):\n" + _DRIVER_FIXES + _PREVENT
)


def format_spill_message(
    report: SpillReport, batch_size: int | None, checkpoint_path: str | None = None, batch_helps: bool = True
) -> str:
    """The message a user sees when a run is stopped for spilling: the numbers, then the fixes (``batch_helps``
    False: without those of the batch, where the run's readings say no batch fits). Sizes are in the card's unit: GB,
    or MB on a small or emulated card.

    Example:
        >>> from lightning_memguard.core.spill import Verdict
        >>> r = SpillReport(Verdict.SPILL, "peak memory above the physical capacity", 12, 18_900_000_000,
        ...                 16_000_000_000, 1094.0, 24.0)
        >>> message = format_spill_message(r, 448)
        >>> print(message.splitlines()[0][:75])
        GPU memory is spilling into system RAM at training step 12 (batch size 448)
        >>> "peak 18.90 GB against 16.00 GB of physical memory;" in message
        True
        >>> "(45.6x slower)" in message, "Prefer No Sysmem Fallback" in message
        (True, True)
        >>> small = SpillReport(Verdict.SPILL, "peak memory above the physical capacity", 3, 160_296_440, 150_000_000)
        >>> "peak 160.3 MB against 150.0 MB of physical memory" in format_spill_message(small, 16)
        True
    """
    size = size_formatter(report.capacity, gb_digits=2)  # every figure in the card's unit: GB, or MB on a small card
    parts = [f"GPU memory is spilling into system RAM at training step {report.step}"]
    if batch_size is not None:
        parts.append(f" (batch size {batch_size})")
    parts.append(f": peak {size(report.used_bytes)} against {size(report.capacity)} of physical memory")
    if report.other_bytes is None:
        parts.append(" (other processes' use unknown, not counted)")
    elif report.other_bytes:
        parts.append(f" (counting {size(report.other_bytes)} that other processes hold)")
    if report.in_system_ram:
        parts.append(f"; {size(report.in_system_ram)} of this run's GPU memory is in system RAM (Windows' count)")
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
        lines.append(
            f"Nothing is lost: a checkpoint was saved to {checkpoint_path}, holding every batch trained so far; resume"
            " with ckpt_path=... to go on with the next batch."
        )
    lines.append(FIXES if batch_helps else HELD_FIXES)
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
