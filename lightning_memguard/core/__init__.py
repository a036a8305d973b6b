"""Pure logic: numbers in, decisions out. Nothing here imports Lightning."""

from lightning_memguard.core.detector import SpillDetector
from lightning_memguard.core.epoch_record import EpochRecord, format_epoch_table, merge_epoch_records
from lightning_memguard.core.messages import SysmemSpillError, format_spill_message
from lightning_memguard.core.platform import fallback_possible
from lightning_memguard.core.reading import MemoryReading
from lightning_memguard.core.spill import Evidence, Judgement, SpillReport, Verdict, judge
from lightning_memguard.core.throughput import StepStats, summarize_steps
from lightning_memguard.core.timeline import StepTimeline
from lightning_memguard.core.units import parse_bytes, to_gb

__all__ = [
    "EpochRecord",
    "Evidence",
    "Judgement",
    "MemoryReading",
    "SpillDetector",
    "SpillReport",
    "StepStats",
    "StepTimeline",
    "SysmemSpillError",
    "Verdict",
    "fallback_possible",
    "format_epoch_table",
    "format_spill_message",
    "judge",
    "merge_epoch_records",
    "parse_bytes",
    "summarize_steps",
    "to_gb",
]
