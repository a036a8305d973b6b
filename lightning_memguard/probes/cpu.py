"""Host memory: this process's peak resident memory against system RAM, on Linux, Windows and macOS."""

from __future__ import annotations

import os
import sys

import psutil

from lightning_memguard.probes.base import MemoryReading

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


def _system_ram() -> int:
    return int(psutil.virtual_memory().total)


def _linux_peak() -> int | None:
    """VmHWM, the peak resident set size since the last reset through ``clear_refs``."""
    try:
        with open(_STATUS, encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def _process_peak() -> int:
    """The peak resident memory since the process started, where the platform keeps one."""
    if sys.platform == "win32":
        return int(psutil.Process().memory_info().peak_wset)  # the peak working set
    if sys.platform == "darwin":
        import resource  # Unix only: imported where it exists

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)  # bytes on macOS
    return int(psutil.Process().memory_info().rss)  # no peak kept: the current resident set


class CpuProbe:
    """Peak resident memory of this process; capacity is the system's RAM (through ``psutil``).

    Linux: ``VmHWM``, reset per window through ``/proc/self/clear_refs``. Windows: the peak working set, macOS: the
    peak resident set size, both since the process started (neither can be reset). Elsewhere: the highest resident
    set size seen at reads since the last reset.

    Example:
        >>> probe = CpuProbe()
        >>> probe.reset_peak()
        >>> reading = probe.read()
        >>> 0 < reading.peak_allocated <= reading.capacity
        True
    """

    def __init__(self) -> None:
        self._linux = sys.platform.startswith("linux") and os.path.exists(_STATUS)
        self._can_reset = self._linux and os.path.exists(_CLEAR_REFS)
        self._seen = 0  # the highest reading since the last reset, where the platform keeps no peak

    def capacity(self) -> int:
        return _system_ram()

    def reset_peak(self) -> None:
        self._seen = 0
        if not self._can_reset:
            return
        try:
            with open(_CLEAR_REFS, "w", encoding="ascii") as f:
                f.write("5")  # 5: reset the peak resident set size to the current one
        except OSError:
            self._can_reset = False

    def read(self) -> MemoryReading:
        peak = (_linux_peak() if self._linux else None) or _process_peak()
        self._seen = peak = max(self._seen, peak)
        return MemoryReading(peak_allocated=peak, peak_reserved=peak, capacity=self.capacity())
