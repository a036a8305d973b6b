"""The memory report: which modules hold a step's memory, and the fix that targets them.

- :mod:`.attribution` (torch only): one forward and backward measured under saved-tensor hooks, every saved tensor
  charged to the innermost module running (``measure_step``, ``SavedTensorRecorder``);
- :mod:`.fixes` (pure): the fix, as rules on the measured figures;
- :mod:`.memory_report`: :class:`~.memory_report.MemoryReport`, its verdict, JSON and self-contained HTML page,
  written atomically.

MemGuard writes one on a spill, an out-of-memory error, allocator thrash and each adaptation
(``lightning_memguard/callbacks/_reporting.py``); ``memguard sweep --report`` and ``memguard plan --report``
for each configuration they try.
"""

from lightning_memguard.forensics.attribution import SavedTensorRecorder, StepMemory, measure_step
from lightning_memguard.forensics.memory_report import MemoryReport

__all__ = ["MemoryReport", "SavedTensorRecorder", "StepMemory", "measure_step"]
