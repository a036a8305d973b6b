"""`memguard doctor`: one screen about this machine's risk of the silent sysmem spill."""

from __future__ import annotations

import platform
from typing import Any

import lightning
import torch

from lightning_memguard.core.detector import fallback_possible

CANNOT = "cannot happen here"
POSSIBLE = (
    "possible: turn it off in NVIDIA Control Panel -> Manage 3D Settings -> CUDA - Sysmem Fallback Policy -> "
    "Prefer No Sysmem Fallback, or train with MemGuard(prevent=True)"
)


def verdict(system: str, release: str, driver_model: str | None, cuda: bool, probe: bool | None) -> str:
    """The plain answer: can an overflow silently spill into system RAM here?

    Example:
        >>> verdict("Linux", "6.8.0", None, True, None)
        'cannot happen here'
        >>> verdict("Windows", "11", "WDDM", True, True).startswith("ON: allocating")
        True
    """
    if probe is True:
        return (
            "ON: allocating more than the free GPU memory succeeded, so overflows spill. " + POSSIBLE.split(": ", 1)[1]
        )
    if probe is False:
        return "off: allocating more than the free GPU memory failed at once with out-of-memory, as it should"
    if not cuda:
        return CANNOT + " (no CUDA GPU)"
    return POSSIBLE if fallback_possible(system, release, driver_model) else CANNOT


def collect(probe: bool = False) -> dict[str, Any]:
    """What this machine is, as a dict (the ``--json`` output)."""
    info: dict[str, Any] = {
        "os": f"{platform.system()} {platform.release()}",
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "cuda": torch.version.cuda,
        "gpu": None,
        "driver_version": None,
        "driver_model": "not applicable" if platform.system() == "Linux" else None,
        "memory_gb": None,
        "other_processes_gb": None,
        "pcie": None,
        "probe": None,
    }
    cuda = torch.cuda.is_available()
    if cuda:
        from lightning_memguard.probes import CudaProbe

        dev = CudaProbe(torch.cuda.current_device())
        info["gpu"] = torch.cuda.get_device_name(dev.index)
        driver = dev.driver_info()
        info["driver_version"] = driver["driver_version"]
        if driver["driver_model"] is not None:
            info["driver_model"] = driver["driver_model"]
        info["memory_gb"] = round(dev.capacity() / 1e9, 2)
        info["other_processes_gb"] = round(dev.other_processes() / 1e9, 2)
        link = dev.pcie_link()
        if link["generation"] is not None:
            info["pcie"] = f"gen {link['generation']} x{link['width']}"
        if probe:
            info["probe"] = dev.overallocation_succeeds()
    model = info["driver_model"] if info["driver_model"] != "not applicable" else None
    info["verdict"] = verdict(platform.system(), platform.release(), model, cuda, info["probe"])
    return info


def format_report(info: dict[str, Any]) -> str:
    rows = [
        ("OS", info["os"]),
        ("GPU", info["gpu"] or "none"),
        ("driver", info["driver_version"] or "-"),
        ("driver model", info["driver_model"] or "-"),
        ("GPU memory", f"{info['memory_gb']} GB" if info["memory_gb"] is not None else "-"),
        ("other processes", f"{info['other_processes_gb']} GB" if info["other_processes_gb"] is not None else "-"),
        ("PCIe", info["pcie"] or "-"),
        ("torch / lightning / CUDA", f"{info['torch']} / {info['lightning']} / {info['cuda'] or '-'}"),
        ("sysmem fallback", info["verdict"]),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
