"""pywin32's ``win32pdh`` faked for CPU tests, answering as Windows does for its GPU memory counters.

Windows keeps ``\\GPU Process Memory(pid_<pid>_luid_0x<high>_0x<low>_phys_<n>)\\Shared Usage`` (and ``Dedicated
Usage``) per process and adapter, and ``\\GPU Adapter Memory(luid_..._phys_<n>)`` per adapter. Counter paths name
objects and counters in the system's language; ``PdhAddEnglishCounter`` takes the English names everywhere. An
instance wildcard (``pid_42_*``) matches every instance it names; a counter array with no instance fails
(PDH_NO_DATA).
"""

from __future__ import annotations

import fnmatch
import re
import types

GERMAN = {  # what a German Windows calls these objects and counters
    "GPU Process Memory": "GPU-Prozessspeicher",
    "GPU Adapter Memory": "GPU-Adapterspeicher",
    "Dedicated Usage": "Dedizierte Nutzung",
    "Shared Usage": "Freigegebene Nutzung",
}
_PATH = re.compile(r"^\\(?P<object>[^(]+)\((?P<instance>[^)]*)\)\\(?P<counter>.+)$")


class PdhError(Exception):
    """What pywin32 raises (``pywintypes.error``): the function and the system's message."""


def instance(pid: int | None, luid: tuple[int, int], phys: int = 0) -> str:
    """An instance name as Windows writes it."""
    name = f"luid_0x{luid[0]:08X}_0x{luid[1]:08X}_phys_{phys}"
    return name if pid is None else f"pid_{pid}_{name}"


class FakePdh(types.ModuleType):
    """The counters of one machine; a test sets ``process[(pid, luid)]`` and ``adapter[luid]`` as ``(dedicated,
    shared)`` byte pairs and changes them as the run goes.

    Args:
        language: ``{english: local}`` names of the system's language (``GERMAN``), or None for English.
        available: False: no GPU counters at all (an old Windows, a machine with them disabled).
    """

    PDH_FMT_LARGE = 0x400

    def __init__(self, language: dict[str, str] | None = None, available: bool = True) -> None:
        super().__init__("win32pdh")
        self.language = language or {}
        self.available = available
        self.process: dict[tuple[int, tuple[int, int]], tuple[int, int]] = {}
        self.adapter: dict[tuple[int, int], tuple[int, int]] = {}
        self.collections = 0
        self.open_queries = 0

    def local(self, english: str) -> str:
        return self.language.get(english, english)

    # ------------------------------------------------------------------ win32pdh's functions
    def OpenQuery(self, source=None, user_data=0):  # noqa: N802 - pywin32's names
        self.open_queries += 1
        return object()

    def CloseQuery(self, query):  # noqa: N802
        self.open_queries -= 1

    def AddEnglishCounter(self, query, path, user_data=0):  # noqa: N802
        return self._counter(path, english=True)

    def AddCounter(self, query, path, user_data=0):  # noqa: N802
        return self._counter(path, english=False)

    def CollectQueryData(self, query):  # noqa: N802
        self.collections += 1

    def GetFormattedCounterArray(self, counter, fmt):  # noqa: N802
        obj, pattern, which = counter
        rows: dict[str, int] = {}
        if obj == "GPU Process Memory":
            for (pid, luid), pair in self.process.items():
                rows[instance(pid, luid)] = pair[which]
        else:
            for luid, pair in self.adapter.items():
                rows[instance(None, luid)] = pair[which]
        found = {name: value for name, value in rows.items() if fnmatch.fnmatchcase(name, pattern)}
        if not found:
            raise PdhError("GetFormattedCounterArray", "The data is not valid.")
        return found

    def _counter(self, path: str, english: bool) -> tuple[str, str, int]:
        parts = _PATH.match(path)
        if not self.available or parts is None:
            raise PdhError("PdhAddCounter", "The specified object was not found on the computer.")
        names = {self.local(k) if not english else k: k for k in ("GPU Process Memory", "GPU Adapter Memory")}
        counters = {self.local(k) if not english else k: k for k in ("Dedicated Usage", "Shared Usage")}
        obj, counter = names.get(parts["object"]), counters.get(parts["counter"])
        if obj is None or counter is None:
            raise PdhError("PdhAddCounter", "The specified object was not found on the computer.")
        return obj, parts["instance"], 0 if counter == "Dedicated Usage" else 1
