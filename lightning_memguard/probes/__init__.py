"""Memory readers: one interface (:class:`MemoryProbe`), one reader per kind of device."""

from __future__ import annotations

import torch

from lightning_memguard.probes.base import MemoryProbe, MemoryReading
from lightning_memguard.probes.cpu import CpuProbe
from lightning_memguard.probes.cuda import CudaProbe
from lightning_memguard.probes.mps import MpsProbe

__all__ = ["CpuProbe", "CudaProbe", "MemoryProbe", "MemoryReading", "MpsProbe", "probe_for"]


def probe_for(device: torch.device) -> MemoryProbe:
    """The reader for ``device``: CUDA, MPS, or the host's memory for anything else.

    Example:
        >>> type(probe_for(torch.device("cpu"))).__name__
        'CpuProbe'
    """
    if device.type == "cuda":
        return CudaProbe(device)
    if device.type == "mps":
        return MpsProbe()
    return CpuProbe()
