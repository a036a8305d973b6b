"""Windows' own count of a process's GPU memory: the "Dedicated" and "Shared GPU memory" of Task Manager.

Under WDDM the driver's sysmem fallback moves GPU memory into system RAM, and Windows counts it, per process and
per adapter, in its performance counters (PDH): ``\\GPU Process Memory(pid_<pid>_luid_0x<high>_0x<low>_phys_<n>)``
with ``Dedicated Usage`` and ``Shared Usage``, and ``\\GPU Adapter Memory(luid_..._phys_<n>)`` for the adapter. They
are read through pywin32's ``win32pdh`` (a dependency on Windows only), by their English names
(``PdhAddEnglishCounter``), so that a localized Windows reads them too. The adapter is matched to the CUDA device by
its LUID, which the CUDA driver gives on Windows (``cuDeviceGetLuid``); where it cannot, the adapter on which this
process holds the most dedicated memory is taken.

Nothing here raises where the counters cannot be read (WSL2, Linux, a locked-down machine, an old Windows):
:func:`open_counters` returns the reason instead.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
from dataclasses import dataclass
from typing import Any

ON_WINDOWS = sys.platform == "win32"
PROCESS = "\\GPU Process Memory(pid_{pid}_*)\\{counter}"
ADAPTER = "\\GPU Adapter Memory(*)\\{counter}"
_LUID = re.compile(r"luid_0x([0-9a-f]{8})_0x([0-9a-f]{8})", re.IGNORECASE)


@dataclass(frozen=True)
class WddmUsage:
    """What Windows counts on one adapter, in bytes.

    Attributes:
        dedicated: this process's memory on the card itself.
        shared: this process's GPU memory in system RAM (Task Manager's "Shared GPU memory"): what the fallback
            moved there, and host memory pinned for the GPU (pinned loaders, offloading).
        adapter_dedicated: every process's memory on the card.
        adapter_shared: every process's GPU memory in system RAM.
    """

    dedicated: int
    shared: int
    adapter_dedicated: int | None = None
    adapter_shared: int | None = None


def luid_of(index: int) -> tuple[int, int] | None:
    """The LUID (high part, low part) of CUDA device ``index`` from the CUDA driver (``nvcuda.dll``); None where it
    cannot say (not Windows, no driver, an error)."""
    if not ON_WINDOWS:
        return None
    try:
        driver = ctypes.WinDLL("nvcuda.dll")  # type: ignore[attr-defined,unused-ignore]
        device = ctypes.c_int()
        luid = (ctypes.c_ubyte * 8)()
        mask = ctypes.c_uint()
        if driver.cuInit(0) or driver.cuDeviceGet(ctypes.byref(device), index):
            return None
        if driver.cuDeviceGetLuid(luid, ctypes.byref(mask), device):
            return None
    except (OSError, AttributeError):
        return None
    raw = bytes(luid)  # a Windows LUID: LowPart (DWORD), then HighPart (LONG), little-endian
    return int.from_bytes(raw[4:], "little"), int.from_bytes(raw[:4], "little")


class WddmCounters:
    """This process's dedicated and shared GPU memory on one adapter, from Windows' performance counters.

    One PDH query holds four counters; :meth:`read` collects it once (about a millisecond: it is read at MemGuard's
    cadence, never every step).

    Args:
        pdh: the ``win32pdh`` module (tests pass a fake).
        luid: the adapter's LUID (high, low), None to take the adapter where this process holds the most.
        pid: the process (default: this one).
    """

    def __init__(self, pdh: Any, luid: tuple[int, int] | None, pid: int | None = None) -> None:
        self._pdh = pdh
        self.luid = luid
        self.pid = os.getpid() if pid is None else pid
        self._query = pdh.OpenQuery()
        try:
            paths = {
                "dedicated": PROCESS.format(pid=self.pid, counter="Dedicated Usage"),
                "shared": PROCESS.format(pid=self.pid, counter="Shared Usage"),
                "adapter_dedicated": ADAPTER.format(counter="Dedicated Usage"),
                "adapter_shared": ADAPTER.format(counter="Shared Usage"),
            }
            self._counters = {key: pdh.AddEnglishCounter(self._query, path) for key, path in paths.items()}
        except Exception:
            pdh.CloseQuery(self._query)
            raise

    def read(self) -> WddmUsage | None:
        """The figures now; None while Windows lists no instance of this process (before its first allocation)."""
        pdh = self._pdh
        pdh.CollectQueryData(self._query)
        values = {key: self._array(counter) for key, counter in self._counters.items()}
        luid = self.luid if self.luid is not None else _busiest(values["dedicated"])
        if luid is None:
            return None
        mine = {key: _on_adapter(array, luid) for key, array in values.items()}
        if mine["dedicated"] is None and mine["shared"] is None:
            return None
        return WddmUsage(mine["dedicated"] or 0, mine["shared"] or 0, mine["adapter_dedicated"], mine["adapter_shared"])

    def close(self) -> None:
        self._pdh.CloseQuery(self._query)

    def _array(self, counter: Any) -> dict[str, int]:
        try:
            items = self._pdh.GetFormattedCounterArray(counter, self._pdh.PDH_FMT_LARGE)
        except Exception:  # no instance matches yet (PDH_NO_DATA): nothing to count
            return {}
        return {str(name): int(value) for name, value in items.items()}


def _luid_in(instance: str) -> tuple[int, int] | None:
    found = _LUID.search(instance)
    return (int(found.group(1), 16), int(found.group(2), 16)) if found else None


def _on_adapter(array: dict[str, int], luid: tuple[int, int]) -> int | None:
    """The sum over the instances of one adapter (its physical parts, ``phys_<n>``); None where it has none."""
    values = [value for name, value in array.items() if _luid_in(name) == luid]
    return sum(values) if values else None


def _busiest(dedicated: dict[str, int]) -> tuple[int, int] | None:
    """The adapter on which this process holds the most dedicated memory: its CUDA device, where the LUID is
    unknown."""
    if not dedicated:
        return None
    return _luid_in(max(dedicated, key=lambda name: dedicated[name]))


def open_counters(index: int, pdh: Any = None) -> tuple[WddmCounters | None, str]:
    """Windows' counters for CUDA device ``index`` of this process, or None and why they cannot be read.

    Example:
        >>> counters, why = open_counters(0)  # on Linux
        >>> counters is None, why
        (True, 'not Windows')
    """
    if pdh is None:
        if not ON_WINDOWS:
            return None, "not Windows"
        try:
            import win32pdh as pdh  # type: ignore[import-not-found,no-redef,unused-ignore]
        except ImportError:
            return None, "pywin32 is not installed (`pip install pywin32`)"
    try:
        return WddmCounters(pdh, luid_of(index)), ""
    except Exception as err:  # pywin32's error, or PDH's: the counters are missing or not readable here
        return None, f"Windows' GPU memory counters cannot be read ({type(err).__name__}: {err})"
