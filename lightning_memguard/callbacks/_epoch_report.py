"""MemGuard's epoch report: one record per epoch from the timeline and the reading, all ranks merged, logged."""

from __future__ import annotations

import math

from lightning.pytorch import LightningModule, Trainer

from lightning_memguard._lightning.agreement import gather_rows
from lightning_memguard.core.epoch_record import EpochRecord, merge_epoch_records
from lightning_memguard.core.reading import MemoryReading
from lightning_memguard.core.throughput import StepStats
from lightning_memguard.core.units import to_gb

PREFIX = "memguard/"


def epoch_record(trainer: Trainer, stats: StepStats | None, reading: MemoryReading, capacity: int) -> EpochRecord:
    """This epoch as every rank saw it together: each figure gathered from all ranks and merged as declared in
    :class:`EpochRecord` (the table shows what the logged keys show)."""
    mine = EpochRecord(
        epoch=trainer.current_epoch,
        step_ms=stats.step_ms if stats else math.nan,
        peak_allocated_gb=round(to_gb(reading.peak_allocated), 6),
        peak_reserved_gb=round(to_gb(reading.peak_reserved), 6),
        capacity_gb=round(to_gb(capacity), 6),
        samples_per_sec=stats.samples_per_sec if stats else math.nan,
    )
    if trainer.world_size <= 1:
        return mine
    names = EpochRecord.figure_names()
    rows = gather_rows(trainer, list(mine.figures().values()))
    return merge_epoch_records([EpochRecord(mine.epoch, **dict(zip(names, row, strict=True))) for row in rows])


def log_epoch(trainer: Trainer, pl_module: LightningModule, record: EpochRecord) -> None:
    """Each figure as ``memguard/<name>`` through the Trainer's loggers, and the progress bar's ``peak/cap`` and
    ``samples/s``: epoch figures, so that no step pays for logging. Not under ``barebones`` (Lightning warns at
    every ``log`` there): the table at fit end remains."""
    if trainer.barebones:
        return
    # every rank holds the same merged figures: "max" of equal values passes them on exactly
    sync = trainer.world_size > 1
    for name, value in record.figures().items():
        pl_module.log(PREFIX + name, value, on_step=False, on_epoch=True, sync_dist=sync, reduce_fx="max", batch_size=1)
    bar = {"peak/cap": round(record.peak_allocated_gb / record.capacity_gb, 3), "samples/s": record.samples_per_sec}
    for key, value in bar.items():
        pl_module.log(key, value, on_step=False, on_epoch=True, prog_bar=True, logger=False, batch_size=1,
                      sync_dist=sync, reduce_fx="max")  # fmt: skip
