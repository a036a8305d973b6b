"""What MemGuard remembers of each epoch, and the table it prints at the end of a run."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from lightning_memguard.core.units import GB, size_unit


def figure(merge: Callable[[Sequence[float]], float], unit: str) -> Any:
    """A logged figure of :class:`EpochRecord`: how ranks merge it (``max``, ``min``, ``sum``) and its unit. Its
    default (NaN: not measured) lets checkpoints written before it existed load."""
    return field(default=math.nan, metadata={"merge": merge, "unit": unit})


@dataclass(frozen=True)
class EpochRecord:
    """One epoch's memory against throughput. Memory in decimal GB, time in ms.

    Every field after ``epoch`` is a figure: MemGuard logs it as ``memguard/<name>``, gathers it from every rank and
    merges it by its ``merge`` (peaks and step time the largest of any rank, capacity the smallest, samples/s the sum:
    every rank trains its own samples at the same time). A new logged key is one line here.
    """

    epoch: int
    step_ms: float = figure(max, "ms")
    peak_allocated_gb: float = figure(max, "GB")
    peak_reserved_gb: float = figure(max, "GB")
    capacity_gb: float = figure(min, "GB")
    samples_per_sec: float = figure(sum, "samples/s")

    @staticmethod
    def figure_names() -> tuple[str, ...]:
        return tuple(f.name for f in fields(EpochRecord) if "merge" in f.metadata)

    def figures(self) -> dict[str, float]:
        """Each figure by name, in the order declared."""
        return {name: getattr(self, name) for name in self.figure_names()}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> EpochRecord:
        """A record from :meth:`to_dict`'s output; figures it lacks (an older checkpoint) are NaN, unknown keys (a
        newer one) are left out.

        Example:
            >>> EpochRecord.from_dict({"epoch": 2, "step_ms": 10.0, "dropped": 1}).step_ms
            10.0
        """
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in row.items() if k in names})


def merge_epoch_records(records: Sequence[EpochRecord]) -> EpochRecord:
    """One epoch as all ranks saw it, each figure merged as declared (see :class:`EpochRecord`).

    Example:
        >>> ranks = [EpochRecord(3, 50.0, 2.0, 2.5, 16.0, 80.0), EpochRecord(3, 60.0, 3.0, 3.5, 15.0, 40.0)]
        >>> print(format_epoch_table([merge_epoch_records(ranks)]))
        epoch  step ms  peak GB / capacity GB  samples/s
            3     60.0           3.00 / 15.00      120.0
    """
    if not records:
        raise ValueError("no epoch records to merge")
    merged = {
        f.name: f.metadata["merge"]([getattr(r, f.name) for r in records])
        for f in fields(EpochRecord)
        if "merge" in f.metadata
    }
    return EpochRecord(records[0].epoch, **merged)


def _memory_unit(capacities_gb: Sequence[float | None], peaks_gb: Sequence[float | None]) -> tuple[str, float, int]:
    """The unit a table's memory columns are written in (its name, GB per unit, decimals): the one that fits the
    capacity (else the largest peak), as :func:`~lightning_memguard.core.units.size_formatter` picks it, so that a
    small or emulated card reads "70.3 / 150.0" in MB, not "0.07 / 0.15" in GB."""
    known = [c for c in capacities_gb if c is not None and math.isfinite(c) and c > 0]
    peaks = [p for p in peaks_gb if p is not None and math.isfinite(p)]
    reference = min(known) if known else max(peaks, default=1.0)
    unit, scale, digits = size_unit(reference * GB, gb_digits=2)
    return unit, scale / GB, digits


def format_epoch_table(records: Sequence[EpochRecord]) -> str:
    """A fixed-width table, one row per epoch; memory in the unit that fits the capacity, named in the header.

    Example:
        >>> print(format_epoch_table([EpochRecord(0, 54.3, 11.8, 12.4, 150.0, 4712.0)]))
        epoch  step ms  peak GB / capacity GB  samples/s
            0     54.3         11.80 / 150.00     4712.0
        >>> print(format_epoch_table([EpochRecord(0, 8.1, 0.0703, 0.08, 0.15, 990.0)]))  # an emulated 150 MB card
        epoch  step ms  peak MB / capacity MB  samples/s
            0      8.1           70.3 / 150.0      990.0
    """
    unit, scale, digits = _memory_unit([r.capacity_gb for r in records], [r.peak_allocated_gb for r in records])
    lines = [f"{'epoch':>5}  {'step ms':>7}  {f'peak {unit} / capacity {unit}':>21}  {'samples/s':>9}"]
    for r in records:
        memory = f"{r.peak_allocated_gb / scale:.{digits}f} / {r.capacity_gb / scale:.{digits}f}"
        lines.append(f"{r.epoch:>5}  {r.step_ms:>7.1f}  {memory:>21}  {r.samples_per_sec:>9.1f}")
    return "\n".join(lines)


@dataclass(frozen=True)
class SweepRow:
    """One batch size of a sweep: the write-up's table row, with what happened.

    ``compiled`` is the ``torch.compile`` backend the row ran under (``None``: eager) and ``compile_s`` the time of
    its steps in which Dynamo compiled, kept out of ``step_ms`` and ``samples_per_sec``.
    """

    batch: int
    step_ms: float | None
    peak_gb: float | None
    samples_per_sec: float | None
    status: str  # "ok" | "spill" | "oom"
    compiled: str | None = None
    compile_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def format_sweep_table(rows: Sequence[SweepRow], capacity_gb: float | None = None) -> str:
    """Batch, step time, peak memory, throughput and status, one line per batch size; where rows were compiled, the
    compile time and the backend too. Memory in the unit that fits the capacity, named in the header.

    Example:
        >>> rows = [SweepRow(256, 234.0, 10.9, 1094.0, "ok"), SweepRow(448, None, None, None, "oom")]
        >>> print(format_sweep_table(rows))
        batch    step ms    peak GB    samples/s  status
          256      234.0      10.90       1094.0  ok
          448          -          -            -  oom
        >>> print(format_sweep_table([SweepRow(256, 150.0, 10.4, 1706.7, "ok", "inductor", 41.2)]))
        batch    step ms    peak GB    samples/s  compile s  compiled  status
          256      150.0      10.40       1706.7       41.2  inductor  ok
        >>> print(format_sweep_table([SweepRow(8, 5.2, 0.0412, 1538.5, "ok")], capacity_gb=0.1))  # 100 MB emulated
        batch    step ms    peak MB    samples/s  status
            8        5.2       41.2       1538.5  ok
        capacity: 100.0 MB
    """
    unit, scale, digits = _memory_unit([capacity_gb], [r.peak_gb for r in rows])

    def cell(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    compiled = any(r.compiled for r in rows)
    width = max([len("compiled"), *(len(r.compiled or "") for r in rows)])
    extra = f"  {'compile s':>9}  {'compiled':<{width}}" if compiled else ""
    lines = [f"{'batch':>5}  {'step ms':>9}  {f'peak {unit}':>9}  {'samples/s':>11}{extra}  status"]
    for r in rows:
        extra = f"  {cell(r.compile_s, '.1f'):>9}  {r.compiled or 'eager':<{width}}" if compiled else ""
        peak = None if r.peak_gb is None else r.peak_gb / scale
        lines.append(
            f"{r.batch:>5}  {cell(r.step_ms, '.1f'):>9}  {cell(peak, f'.{digits}f'):>9}  "
            f"{cell(r.samples_per_sec, '.1f'):>11}{extra}  {r.status}"
        )
    if capacity_gb is not None:
        lines.append(f"capacity: {capacity_gb / scale:.{digits}f} {unit}")
    return "\n".join(lines)
