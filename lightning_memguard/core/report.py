"""What MemGuard remembers of each epoch, and the table it prints at the end of a run."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class EpochRecord:
    """One epoch's memory against throughput. Memory in decimal GB, time in ms."""

    epoch: int
    step_ms: float
    peak_allocated_gb: float
    peak_reserved_gb: float
    capacity_gb: float
    samples_per_sec: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def format_epoch_table(records: Sequence[EpochRecord]) -> str:
    """A fixed-width table, one row per epoch.

    Example:
        >>> print(format_epoch_table([EpochRecord(0, 54.3, 11.8, 12.4, 150.0, 4712.0)]))
        epoch  step ms  peak GB / capacity GB  samples/s
            0     54.3         11.80 / 150.00     4712.0
    """
    lines = [f"{'epoch':>5}  {'step ms':>7}  {'peak GB / capacity GB':>21}  {'samples/s':>9}"]
    for r in records:
        memory = f"{r.peak_allocated_gb:.2f} / {r.capacity_gb:.2f}"
        lines.append(f"{r.epoch:>5}  {r.step_ms:>7.1f}  {memory:>21}  {r.samples_per_sec:>9.1f}")
    return "\n".join(lines)
