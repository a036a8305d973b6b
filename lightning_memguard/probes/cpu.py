"""Host memory: process peak resident set size against system RAM."""

from __future__ import annotations

import os
import resource
import sys

from lightning_memguard.probes.base import MemoryReading

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


def _system_ram() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - platforms without sysconf
        import psutil  # type: ignore[import-not-found]

        return int(psutil.virtual_memory().total)


class CpuProbe:
    """Peak resident set size of this process; capacity is the system's RAM.

    On Linux the peak is reset per window through ``/proc/self/clear_refs``; elsewhere it is the peak since the
    process started.

    Example:
        >>> probe = CpuProbe()
        >>> probe.reset_peak()
        >>> reading = probe.read()
        >>> 0 < reading.peak_allocated <= reading.capacity
        True
    """

    def __init__(self) -> None:
        self._can_reset = sys.platform.startswith("linux") and os.path.exists(_CLEAR_REFS)

    def capacity(self) -> int:
        return _system_ram()

    def reset_peak(self) -> None:
        if not self._can_reset:
            return
        try:
            with open(_CLEAR_REFS, "w") as f:
                f.write("5")  # 5: reset the peak resident set size to the current one
        except OSError:
            self._can_reset = False

    def read(self) -> MemoryReading:
        peak = self._peak_rss()
        return MemoryReading(peak_allocated=peak, peak_reserved=peak, capacity=self.capacity())

    @staticmethod
    def _peak_rss() -> int:
        try:
            with open(_STATUS) as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return rss if sys.platform == "darwin" else rss * 1024
