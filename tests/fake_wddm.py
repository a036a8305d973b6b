"""A CUDA card on a Windows desktop, faked for CPU tests: PyTorch's counters and an NVML that answers as WDDM does.

Under WDDM, NVML lists processes but gives ``usedGpuMemory=None`` for every one of them (nvidia-ml-py's reading of
NVML_VALUE_NOT_AVAILABLE), reports driver model 0 (``NVML_DRIVER_WDDM``), and its device-wide used memory counts
everything on the card: the desktop's share plus this process's.
"""

from __future__ import annotations

import sys
import types

import torch

GB = 10**9


class FakeWddmCard:
    """A 16 GB card of which the desktop holds 1.5 GB; ``reserved`` is what this process's PyTorch holds."""

    def __init__(self, total: int = 16 * GB, desktop: int = 1_500_000_000) -> None:
        self.total = total
        self.desktop = desktop
        self.reserved = 0
        self.peak = 0
        self.fractions: list[float] = []

    # ---------------------------------------------------------------- what PyTorch reports
    def hold(self, nbytes: int) -> None:
        self.reserved = nbytes
        self.peak = max(self.peak, nbytes)

    def stats(self, device=None) -> dict:
        return {
            "allocated_bytes": {"all": {"peak": self.peak, "current": self.reserved}},
            "reserved_bytes": {"all": {"peak": self.peak, "current": self.reserved}},
        }

    def props(self, device=None) -> types.SimpleNamespace:
        return types.SimpleNamespace(
            total_memory=self.total, name="NVIDIA GeForce RTX 4080 SUPER", pci_bus_id=1, pci_domain_id=0,
            pci_device_id=0,
        )  # fmt: skip

    # ---------------------------------------------------------------- what NVML reports under WDDM
    def nvml(self) -> types.ModuleType:
        nvml = types.ModuleType("pynvml")
        nvml.NVML_DRIVER_WDDM, nvml.NVML_DRIVER_WDM, nvml.NVML_DRIVER_MCDM = 0, 1, 2
        nvml.nvmlInit = lambda: None
        nvml.nvmlDeviceGetCount = lambda: 1
        nvml.nvmlDeviceGetHandleByPciBusId = lambda bus: "gpu0"
        nvml.nvmlDeviceGetHandleByIndex = lambda index: "gpu0"
        nvml.nvmlDeviceGetName = lambda handle: "NVIDIA GeForce RTX 4080 SUPER"
        nvml.nvmlSystemGetDriverVersion = lambda: "566.36"
        nvml.nvmlDeviceGetDriverModel = lambda handle: (0, 0)
        proc = types.SimpleNamespace
        nvml.nvmlDeviceGetComputeRunningProcesses = lambda handle: [proc(pid=4242, usedGpuMemory=None)]
        nvml.nvmlDeviceGetGraphicsRunningProcesses = lambda handle: [
            proc(pid=1, usedGpuMemory=None),  # dwm.exe
            proc(pid=2, usedGpuMemory=None),  # a browser
        ]
        used = lambda: self.desktop + self.reserved  # noqa: E731
        nvml.nvmlDeviceGetMemoryInfo = lambda handle: types.SimpleNamespace(
            total=self.total, used=used(), free=self.total - used()
        )
        return nvml

    def install(self, monkeypatch, cuda_available: bool = True) -> FakeWddmCard:
        """Patch torch.cuda and ``pynvml`` so that the library sees this card."""
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "is_available", lambda: cuda_available)
        monkeypatch.setattr(cuda, "current_device", lambda: 0)
        monkeypatch.setattr(cuda, "device_count", lambda: 1 if cuda_available else 0)
        monkeypatch.setattr(cuda, "get_device_properties", self.props)
        monkeypatch.setattr(cuda, "get_device_name", lambda device=None: self.props().name)
        monkeypatch.setattr(cuda, "memory_stats_as_nested_dict", self.stats)
        monkeypatch.setattr(cuda, "memory_reserved", lambda device=None: self.reserved)
        monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda device=None: setattr(self, "peak", self.reserved))
        monkeypatch.setattr(cuda, "set_per_process_memory_fraction", lambda f, device=None: self.fractions.append(f))
        monkeypatch.setitem(sys.modules, "pynvml", self.nvml())
        return self
