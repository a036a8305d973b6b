"""Apple GPUs through ``torch.mps``."""

from __future__ import annotations

import torch

from lightning_memguard.probes.base import MemoryReading


class MpsProbe:
    """Apple MPS memory. ``torch.mps`` keeps no peak, so the peak is the highest value seen at reads.

    Capacity is ``torch.mps.recommended_max_memory()``, the working-set size Metal recommends.
    """

    def __init__(self) -> None:
        self._peak_allocated = 0
        self._peak_reserved = 0

    def capacity(self) -> int:
        return int(torch.mps.recommended_max_memory())

    def reset_peak(self) -> None:
        self._peak_allocated = int(torch.mps.current_allocated_memory())
        self._peak_reserved = int(torch.mps.driver_allocated_memory())

    def read(self) -> MemoryReading:
        self._peak_allocated = max(self._peak_allocated, int(torch.mps.current_allocated_memory()))
        self._peak_reserved = max(self._peak_reserved, int(torch.mps.driver_allocated_memory()))
        return MemoryReading(self._peak_allocated, self._peak_reserved, self.capacity())
