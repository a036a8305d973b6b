"""`memguard doctor`: one screen about this machine's risk of the silent sysmem spill."""

from __future__ import annotations

import platform
from typing import Any

import lightning
import torch

from lightning_memguard.core.detector import fallback_advice, fallback_possible, is_wsl2

CANNOT = "cannot happen here"
CUDA_INSTALL = (
    "pip install --force-reinstall torch torchvision --index-url https://download.pytorch.org/whl/cu130"
    " (or the CUDA version https://pytorch.org/get-started/locally/ gives for your driver)"
)


def verdict(
    system: str,
    release: str,
    driver_model: str | None,
    cuda: bool,
    probe: bool | None,
    *,
    nvml_gpu: str | None = None,
    cuda_build: bool = True,
) -> str:
    """The plain answer: can an overflow silently spill into system RAM here?

    Args:
        system: ``platform.system()``.
        release: ``platform.release()`` (names WSL2's kernel).
        driver_model: NVML's driver model (``"WDDM"``, ``"TCC"``, ``"MCDM"``) or None.
        cuda: whether PyTorch can use a CUDA GPU.
        probe: the active probe's answer (True: an overallocation succeeded), or None if it did not run.
        nvml_gpu: the name of a GPU that NVML sees although PyTorch cannot use it.
        cuda_build: whether this PyTorch was built with CUDA.

    Example:
        >>> verdict("Linux", "6.8.0", None, True, None)
        'cannot happen here'
        >>> verdict("Windows", "11", "WDDM", True, True).startswith("ON: allocating")
        True
        >>> print(verdict("Windows", "11", "WDDM", False, None, nvml_gpu="GeForce RTX 4080", cuda_build=False)[:76])
        unknown: this PyTorch is a CPU-only build, but NVML sees a GeForce RTX 4080.
    """
    advice = f"{fallback_advice(system, release)}, or train with MemGuard(prevent=True)"
    if probe is True:
        return f"ON: allocating more than the GPU's memory succeeded, so overflows spill. Turn it off: {advice}"
    if probe is False:
        return "off: allocating more than the GPU's memory failed at once with out-of-memory, as it should"
    if not cuda and nvml_gpu is not None:
        if not cuda_build:
            return (
                f"unknown: this PyTorch is a CPU-only build, but NVML sees a {nvml_gpu}. Install a CUDA build to"
                f" train on it: {CUDA_INSTALL}"
            )
        return (
            f"unknown: NVML sees a {nvml_gpu}, but this PyTorch (built for CUDA {torch.version.cuda}) cannot use it;"
            " update the NVIDIA driver or install a PyTorch built for an older CUDA"
        )
    if not cuda:
        return CANNOT + " (no CUDA GPU)"
    return f"possible: turn it off with {advice}" if fallback_possible(system, release, driver_model) else CANNOT


def collect(probe: bool = False) -> dict[str, Any]:
    """What this machine is, as a dict (the ``--json`` output); ``other_processes_gb`` is None where unknown."""
    system, release = platform.system(), platform.release()
    wsl2 = is_wsl2(system, release)
    info: dict[str, Any] = {
        "os": f"{system} {release}" + (" (WSL2)" if wsl2 else ""),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "cuda": torch.version.cuda,
        "gpu": None,
        "driver_version": None,
        "driver_model": "WDDM, through the Windows host" if wsl2 else None,
        "memory_gb": None,
        "other_processes_gb": None,
        "pcie": None,
        "probe": None,
    }
    if system == "Linux" and not wsl2:
        info["driver_model"] = "not applicable"
    cuda = torch.cuda.is_available()
    nvml_gpu = None
    if cuda:
        from lightning_memguard.probes import CudaProbe

        dev = CudaProbe(torch.cuda.current_device())
        info["gpu"] = torch.cuda.get_device_name(dev.index)
        driver = dev.driver_info()
        info["driver_version"] = driver["driver_version"]
        if driver["driver_model"] is not None:
            info["driver_model"] = driver["driver_model"]
        info["memory_gb"] = round(dev.capacity() / 1e9, 2)
        others = dev.other_processes()
        info["other_processes_gb"] = None if others is None else round(others / 1e9, 2)
        link = dev.pcie_link()
        if link["generation"] is not None:
            info["pcie"] = f"gen {link['generation']} x{link['width']}"
        if probe:
            info["probe"] = dev.overallocation_succeeds()
    else:
        from lightning_memguard.probes.cuda import nvml_gpus

        gpus = nvml_gpus()
        if gpus:
            first = gpus[0]
            nvml_gpu = first["name"]
            info["gpu"] = f"{nvml_gpu} (seen by NVML; PyTorch cannot use it)"
            info["driver_version"] = first["driver_version"]
            info["driver_model"] = first["driver_model"] or info["driver_model"]
            info["memory_gb"] = round(first["memory"] / 1e9, 2)
            info["other_processes_gb"] = round(first["used"] / 1e9, 2)  # nothing of this process is on it
    model = info["driver_model"] if info["driver_model"] in ("WDDM", "TCC", "MCDM") else None
    info["verdict"] = verdict(
        system, release, model, cuda, info["probe"], nvml_gpu=nvml_gpu, cuda_build=torch.version.cuda is not None
    )
    return info


def format_report(info: dict[str, Any]) -> str:
    others = info["other_processes_gb"]
    rows = [
        ("OS", info["os"]),
        ("GPU", info["gpu"] or "none"),
        ("driver", info["driver_version"] or "-"),
        ("driver model", info["driver_model"] or "-"),
        ("GPU memory", f"{info['memory_gb']} GB" if info["memory_gb"] is not None else "-"),
        ("other processes", "-" if info["gpu"] is None else "unknown" if others is None else f"{others} GB"),
        ("PCIe", info["pcie"] or "-"),
        ("torch / lightning / CUDA", f"{info['torch']} / {info['lightning']} / {info['cuda'] or 'CPU-only build'}"),
        ("sysmem fallback", info["verdict"]),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
