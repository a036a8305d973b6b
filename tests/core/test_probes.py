"""Memory readers on the CPU, and the CUDA reader's NVML fallback with a fake, broken NVML."""

from __future__ import annotations

import sys
import types
import warnings

import pytest
import torch

from lightning_memguard.probes import CpuProbe, CudaProbe, MemoryProbe, probe_for


def test_cpu_probe_peak_tracks_a_large_allocation():
    probe = CpuProbe()
    probe.reset_peak()
    before = probe.read().peak_allocated
    block = torch.ones(200 * 2**20, dtype=torch.uint8)  # 200 MiB, touched
    after = probe.read().peak_allocated
    del block
    assert after - before > 150 * 2**20
    assert after <= probe.capacity()


def test_probe_for_picks_by_device():
    assert isinstance(probe_for(torch.device("cpu")), CpuProbe)
    assert isinstance(probe_for(torch.device("cuda", 0)), CudaProbe)  # built lazily: no CUDA call yet
    assert isinstance(CpuProbe(), MemoryProbe)


def _fake_cuda(monkeypatch, allocated=3 * 10**9, reserved=4 * 10**9):
    stats = {
        "allocated_bytes": {"all": {"peak": allocated, "current": allocated}},
        "reserved_bytes": {"all": {"peak": reserved, "current": reserved}},
    }
    props = types.SimpleNamespace(total_memory=16 * 10**9, pci_bus_id=1, pci_domain_id=0, pci_device_id=0)
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda device=None: stats)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_broken_nvml_falls_back_to_pytorch_with_one_warning(monkeypatch):
    _fake_cuda(monkeypatch)
    broken = types.ModuleType("pynvml")

    def fail():
        raise RuntimeError("NVML Shared Library Not Found")

    broken.nvmlInit = fail
    monkeypatch.setitem(sys.modules, "pynvml", broken)
    probe = CudaProbe(0)
    with pytest.warns(RuntimeWarning, match="NVML is unavailable.*NVML Shared Library Not Found") as record:
        readings = [probe.read() for _ in range(5)]
    assert len([w for w in record if "NVML" in str(w.message)]) == 1
    assert readings[0].peak_allocated == 3 * 10**9
    assert readings[0].peak_reserved == 4 * 10**9
    assert readings[0].capacity == 16 * 10**9
    assert readings[0].other_processes is None  # unknown, not 0


def test_missing_nvml_module_falls_back(monkeypatch):
    _fake_cuda(monkeypatch)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import raises ImportError
    probe = CudaProbe(0)
    with pytest.warns(RuntimeWarning, match="NVML is unavailable \\(ModuleNotFoundError"):
        assert probe.read().other_processes is None


def test_nvml_counts_other_processes(monkeypatch):
    _fake_cuda(monkeypatch, reserved=4 * 10**9)
    nvml = types.ModuleType("pynvml")
    nvml.nvmlInit = lambda: None
    nvml.nvmlDeviceGetHandleByPciBusId = lambda bus: ("handle", bus)
    proc = types.SimpleNamespace
    # pids as a container sees them: ours is not in the list, the closest to our 4 GB is taken as us
    nvml.nvmlDeviceGetComputeRunningProcesses = lambda h: [
        proc(pid=11, usedGpuMemory=int(4.3e9)),
        proc(pid=12, usedGpuMemory=int(2e9)),
        proc(pid=13, usedGpuMemory=0),
    ]
    nvml.nvmlDeviceGetGraphicsRunningProcesses = lambda h: []
    nvml.nvmlDeviceGetDriverModel = lambda h: (_ for _ in ()).throw(RuntimeError("Not Supported"))  # as on Linux
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    probe = CudaProbe(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert probe.read().other_processes == 2 * 10**9
    assert probe._handle == ("handle", "00000000:01:00.0")


def test_overallocation_probe_reads_oom_as_no_fallback(monkeypatch):
    """CPU twin of the preflight: a normal driver refuses more than the card has; a spilling one does not. The size
    asked for does not depend on the free figure, which under WDDM can be wrong."""
    _fake_cuda(monkeypatch)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * 2**30, 16 * 2**30))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    asked = []
    real_empty = torch.empty

    def refusing(size, dtype=None, device=None):
        asked.append(size)
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(torch, "empty", refusing)
    assert CudaProbe(0).overallocation_succeeds() is False
    assert asked == [16 * 10**9 + 256 * 2**20]  # the physical total (16 GB) and more, whatever is free
    monkeypatch.setattr(torch, "empty", lambda size, dtype=None, device=None: real_empty(1))
    assert CudaProbe(0).overallocation_succeeds() is True
