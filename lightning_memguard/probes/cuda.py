"""NVIDIA GPUs: PyTorch's allocator counters, plus NVML for what other processes hold."""

from __future__ import annotations

import contextlib
import os
import platform
import time
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn

from lightning_memguard.core.platform import fallback_possible
from lightning_memguard.probes.base import MemoryReading
from lightning_memguard.probes.wddm import WddmCounters, WddmUsage, open_counters


class CudaProbe:
    """Peak allocated and reserved memory from PyTorch; other processes' use from NVML (``nvidia-ml-py``).

    If NVML is missing or fails, the probe warns once and goes on with PyTorch alone (other processes' use is then
    unknown: ``None``). Nothing here synchronises the device.

    Other processes' use changes slowly and listing them through NVML costs far more than PyTorch's counters, so it
    is asked for at most every ``others_every_s`` seconds.

    Args:
        device: the CUDA device to watch (index, string or ``torch.device``); default: the current one.
        others_every_s: how long a reading of other processes' use is reused.
    """

    def __init__(self, device: int | str | torch.device | None = None, others_every_s: float = 5.0) -> None:
        self._device = device
        self._others_every_s = others_every_s
        self._others: tuple[float, int | None] | None = None  # (time read, bytes or None where unknown)
        self._index: int | None = None
        self._nvml: Any = None
        self._handle: Any = None
        self._nvml_state = "untried"  # "untried" | "ok" | "failed"
        self._capacity: int | None = None
        self._device_wide: bool | None = None  # others' use from the device-wide figure (WDDM), not per process
        self._wddm: WddmCounters | None = None  # Windows' own count of this process's GPU memory
        self._wddm_state = "untried"  # "untried" | "ok" | "failed"
        self.wddm_unavailable = ""  # why Windows' counters cannot be read, once tried and failed
        self.preflight_moved: int | None = None  # what Windows counted in system RAM during the preflight

    @property
    def index(self) -> int:
        if self._index is None:
            if self._device is None:
                self._index = torch.cuda.current_device()
            else:
                dev = torch.device(f"cuda:{self._device}" if isinstance(self._device, int) else self._device)
                self._index = dev.index if dev.index is not None else torch.cuda.current_device()
        return self._index

    def capacity(self) -> int:
        if self._capacity is None:
            self._capacity = int(torch.cuda.get_device_properties(self.index).total_memory)
        return self._capacity

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.index)

    def read(self) -> MemoryReading:
        # the nested form: `memory_stats()` flattens and sorts every counter in Python, several times the cost
        stats = torch.cuda.memory_stats_as_nested_dict(self.index)
        allocated = stats.get("allocated_bytes", {}).get("all", {})
        reserved = stats.get("reserved_bytes", {}).get("all", {})
        usage = self.wddm_usage()
        return MemoryReading(
            peak_allocated=int(allocated.get("peak", 0)),
            peak_reserved=int(reserved.get("peak", 0)),
            capacity=self.capacity(),
            other_processes=self.other_processes(int(reserved.get("current", 0))),
            allocated_now=int(allocated.get("current", 0)),
            shared=None if usage is None else usage.shared,
            pinned=None if usage is None else _pinned(),
            alloc_retries=int(stats.get("num_alloc_retries", 0)),
        )

    def wddm_usage(self) -> WddmUsage | None:
        """This process's dedicated and shared memory on this device's adapter as Windows counts it (Task Manager's
        figures); None where they cannot be read: off Windows, or (with one notice, where the driver's fallback can
        exist: Windows, WSL2) where the counters are missing or locked, and MemGuard infers a spill as before."""
        if self._wddm_state == "untried":
            self._wddm, self.wddm_unavailable = open_counters(self.index)
            self._wddm_state = "ok" if self._wddm is not None else "failed"
            if self._wddm is None and fallback_possible(platform.system(), platform.release(), None):
                rank_zero_warn(
                    f"{self.wddm_unavailable}: MemGuard cannot read how much of this run's GPU memory Windows has"
                    " moved into system RAM, and infers a spill from PyTorch's and NVML's figures instead.",
                    category=RuntimeWarning,
                )
        if self._wddm is None:
            return None
        try:
            return self._wddm.read()
        except Exception as err:  # a counter that disappears (a driver reset): the other signals remain
            self._wddm, self._wddm_state = None, "failed"
            self.wddm_unavailable = f"Windows' GPU memory counters stopped answering ({type(err).__name__}: {err})"
            rank_zero_warn(self.wddm_unavailable, category=RuntimeWarning)
            return None

    def other_processes(self, own_reserved: int | None = None) -> int | None:
        """Bytes that other processes hold on this device, from NVML; None where NVML cannot say.

        Where NVML names each process's use (Linux), the others' figures are summed. Where it lists processes without
        their use (Windows and WSL2 under WDDM, where nvidia-ml-py gives ``usedGpuMemory=None``), the device's used
        memory less this process's PyTorch memory (``own_reserved``; default: read now) is taken instead: it counts
        the desktop, other applications and this process's own CUDA context.
        """
        now = time.monotonic()
        if self._others is not None and now - self._others[0] < self._others_every_s:
            return self._others[1]
        others = self._query_other_processes(own_reserved)
        self._others = (now, others)
        return others

    def _query_other_processes(self, own_reserved: int | None) -> int | None:
        handle = self._nvml_handle()
        if handle is None:
            return None
        nvml = self._nvml
        own = torch.cuda.memory_reserved(self.index) if own_reserved is None else own_reserved
        try:
            if self._device_wide is None:
                model = self.driver_info()["driver_model"]
                self._device_wide = fallback_possible(platform.system(), platform.release(), model)
            procs = [*nvml.nvmlDeviceGetComputeRunningProcesses(handle)]
            with contextlib.suppress(Exception):  # a desktop's compositor is a graphics process; optional
                procs += nvml.nvmlDeviceGetGraphicsRunningProcesses(handle)
            if self._device_wide or any(p.usedGpuMemory is None for p in procs):
                # WDDM lists processes without their use (or not at all): the device's own count, less ours
                return max(0, int(nvml.nvmlDeviceGetMemoryInfo(handle).used) - own)
        except Exception as err:  # NVML raises its own error classes; any failure means: fall back
            self._fail(err)
            return None
        used: dict[int, int] = {}
        for p in procs:  # a process can be listed as both compute and graphics
            used[p.pid] = max(used.get(p.pid, 0), int(p.usedGpuMemory))
        if os.getpid() in used:
            used.pop(os.getpid())
        elif used:
            # In a container NVML reports host pids: take the process closest to our own use as ourselves.
            used.pop(min(used, key=lambda pid: abs(used[pid] - own)))
        return sum(used.values())

    def overallocation_succeeds(self, extra: int = 256 * 2**20) -> bool:
        """Try to allocate ``extra`` bytes more than the device's physical memory; True means the driver spills.

        The size does not depend on the free figure (``cudaMemGetInfo``), which under WDDM can be off by hundreds of
        MB either way: no normal driver can place more than the whole card, only the sysmem fallback accepts it. A
        plain device allocation (never managed memory): on a normal driver it fails at once with out-of-memory. On
        Windows the driver's own count confirms it: what went to system RAM is kept in ``preflight_moved``.
        """
        before = self.wddm_usage()
        try:
            block = torch.empty(self.capacity() + extra, dtype=torch.uint8, device=torch.device("cuda", self.index))
        except torch.OutOfMemoryError:
            return False
        else:
            after = self.wddm_usage()
            if before is not None and after is not None:  # Windows' own count of what went to system RAM
                self.preflight_moved = max(0, after.shared - before.shared)
            del block
            return True
        finally:
            torch.cuda.empty_cache()

    def pcie_link(self) -> dict[str, int | None]:
        """Current PCIe generation and width from NVML (None where unavailable)."""
        handle = self._nvml_handle()
        link: dict[str, int | None] = {"generation": None, "width": None}
        if handle is None:
            return link
        names = {"generation": "nvmlDeviceGetCurrPcieLinkGeneration", "width": "nvmlDeviceGetCurrPcieLinkWidth"}
        for key, fn in names.items():
            with contextlib.suppress(Exception):  # an optional detail
                link[key] = int(getattr(self._nvml, fn)(handle))
        return link

    def driver_info(self) -> dict[str, Any]:
        """Driver version and driver model (WDDM / TCC / MCDM, or None where NVML does not say, as on Linux)."""
        handle = self._nvml_handle()
        if handle is None:
            return {"driver_version": None, "driver_model": None}
        return _driver_info(self._nvml, handle)

    def _nvml_handle(self) -> Any:
        if self._nvml_state == "untried":
            try:
                import pynvml

                pynvml.nvmlInit()
                self._nvml = pynvml
                bus_id = self._pci_bus_id()
                self._handle = (
                    pynvml.nvmlDeviceGetHandleByPciBusId(bus_id)
                    if bus_id is not None
                    else pynvml.nvmlDeviceGetHandleByIndex(self.index)
                )
                self._nvml_state = "ok"
            except Exception as err:  # ImportError, NVMLError_*, or anything a broken driver raises
                self._fail(err)
        return self._handle if self._nvml_state == "ok" else None

    def _pci_bus_id(self) -> str | None:
        # NVML numbers devices without regard to CUDA_VISIBLE_DEVICES; the PCI address names the same card.
        props = torch.cuda.get_device_properties(self.index)
        bus = getattr(props, "pci_bus_id", None)
        if bus is None:
            return None
        return f"{getattr(props, 'pci_domain_id', 0):08X}:{bus:02X}:{getattr(props, 'pci_device_id', 0):02X}.0"

    def _fail(self, err: BaseException) -> None:
        if self._nvml_state != "failed":
            rank_zero_warn(
                f"NVML is unavailable ({type(err).__name__}: {err}); memguard reads memory from PyTorch alone and"
                " cannot see other processes on this GPU. Install `nvidia-ml-py` for the full picture.",
                category=RuntimeWarning,
            )
        self._nvml_state = "failed"
        self._handle = None


def _pinned() -> int:
    """Host memory PyTorch holds pinned (its pinned allocator's blocks, in use or cached)."""
    return int(torch.cuda.host_memory_stats_as_nested_dict().get("allocated_bytes", {}).get("current", 0))


def nvml_gpus() -> list[dict[str, Any]] | None:
    """The NVIDIA GPUs that NVML sees, without CUDA (so also under a CPU-only PyTorch); None where NVML cannot load.

    Each entry: ``name``, ``memory`` and ``used`` (device-wide bytes), ``driver_version``, ``driver_model``.
    """
    try:
        import pynvml

        pynvml.nvmlInit()
        count = int(pynvml.nvmlDeviceGetCount())
    except Exception:  # no library, no driver, or no NVIDIA GPU
        return None
    gpus = []
    for index in range(count):
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        except Exception:  # noqa: S112 - a device NVML cannot describe is left out
            continue
        gpus.append(
            {
                "name": name.decode() if isinstance(name, bytes) else str(name),
                "memory": int(memory.total),
                "used": int(memory.used),
                **_driver_info(pynvml, handle),
            }
        )
    return gpus


def _driver_info(nvml: Any, handle: Any) -> dict[str, Any]:
    info: dict[str, Any] = {"driver_version": None, "driver_model": None}
    try:
        version = nvml.nvmlSystemGetDriverVersion()
        info["driver_version"] = version.decode() if isinstance(version, bytes) else version
    except Exception:  # noqa: S110 - optional detail
        pass
    try:
        current, _pending = nvml.nvmlDeviceGetDriverModel(handle)
        names = {
            getattr(nvml, "NVML_DRIVER_WDDM", 0): "WDDM",
            getattr(nvml, "NVML_DRIVER_WDM", 1): "TCC",
            getattr(nvml, "NVML_DRIVER_MCDM", 2): "MCDM",
        }
        info["driver_model"] = names.get(current, str(current))
    except Exception:  # noqa: S110 - "not supported" on Linux
        pass
    return info
