"""The one interface every memory reader implements."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from lightning_memguard.core.reading import MemoryReading

__all__ = ["MemoryProbe", "MemoryReading"]


@runtime_checkable
class MemoryProbe(Protocol):
    """Reads a device's memory. Implementations must not synchronise the device."""

    def capacity(self) -> int:
        """The device's physical memory in bytes."""
        ...

    def reset_peak(self) -> None:
        """Start a new peak: later readings report the highest use from now on."""
        ...

    def read(self) -> MemoryReading:
        """The peak since the last reset, the capacity and other processes' use."""
        ...
