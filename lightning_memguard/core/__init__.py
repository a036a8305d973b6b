"""Pure logic: numbers in, decisions out. Nothing here imports Lightning."""

from lightning_memguard.core.detector import (
    SpillDetector,
    SpillReport,
    SysmemSpillError,
    Verdict,
    detect_spill,
    fallback_possible,
    format_spill_message,
)
from lightning_memguard.core.report import EpochRecord, format_epoch_table, merge_epoch_records
from lightning_memguard.core.throughput import StepStats, summarize_steps
from lightning_memguard.core.timeline import StepTimeline
from lightning_memguard.core.units import parse_bytes, to_gb

__all__ = [
    "EpochRecord",
    "SpillDetector",
    "SpillReport",
    "StepStats",
    "StepTimeline",
    "SysmemSpillError",
    "Verdict",
    "detect_spill",
    "fallback_possible",
    "format_epoch_table",
    "format_spill_message",
    "merge_epoch_records",
    "parse_bytes",
    "summarize_steps",
    "to_gb",
]
