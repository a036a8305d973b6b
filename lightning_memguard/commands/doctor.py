"""`memguard doctor`: one screen about this machine's risk of the silent sysmem spill."""

from __future__ import annotations

import platform
import re
from typing import Any

import lightning
import torch

from lightning_memguard.core.platform import fallback_advice, fallback_possible, is_wsl2

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


def triton_pairing(torch_requires: list[str] | None) -> str | None:
    """The Triton series the installed torch was built with (``"3.8"``), from its own metadata; None where it names
    none (a CPU build, a source build).

    Example:
        >>> triton_pairing(['triton~=3.8.0; platform_system == "Linux"', "sympy>=1.13.3"])
        '3.8'
        >>> triton_pairing(["pytorch-triton==3.3.0+git96316ce5; platform_system == 'Linux'"]), triton_pairing(None)
        ('3.3', None)
    """
    for requirement in torch_requires or []:
        found = re.match(r"\s*(?:pytorch-)?triton\s*(?:==|~=|>=)\s*(\d+)\.(\d+)", requirement)
        if found:
            return f"{found.group(1)}.{found.group(2)}"
    return None


def triton_advice(system: str, installed: str | None, pairing: str | None, works: bool) -> str:
    """Whether Triton works here for the rebuild's kernel and ``torch.compile``, and the pip line that fixes it.

    Example:
        >>> triton_advice("Windows", None, "3.7", False)
        'missing: pip install -U "triton-windows>=3.7,<3.8"'
        >>> triton_advice("Windows", "3.8.0", "3.7", True)
        '3.8.0, but this torch pairs with 3.7: pip install -U "triton-windows>=3.7,<3.8"'
        >>> triton_advice("Linux", "3.7.1", "3.7", True)
        '3.7.1 (works)'
    """
    package = "triton-windows" if system == "Windows" else "triton"
    line = f'pip install -U "{package}"'
    if pairing is not None:
        major, minor = pairing.split(".")
        line = f'pip install -U "{package}>={pairing},<{major}.{int(minor) + 1}"'
    if installed is None:
        return f"missing: {line}"
    if pairing is not None and not installed.startswith(pairing + "."):
        return f"{installed}, but this torch pairs with {pairing}: {line}"
    if not works:
        return f"{installed}, but it does not load: {line}"
    return f"{installed} (works)"


def _triton(system: str) -> str:
    from importlib import metadata

    try:
        requires = metadata.requires("torch")
    except metadata.PackageNotFoundError:
        requires = None
    installed, works = None, False
    try:
        import triton  # type: ignore[import-not-found,unused-ignore]

        installed, works = str(triton.__version__), True
    except ImportError:
        pass
    except Exception as err:  # a build for another torch or CUDA fails as it loads
        installed = f"{type(err).__name__} on import"
    return triton_advice(system, installed, triton_pairing(requires), works)


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
        "windows_counters": None,
        "triton": None,
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
        if system == "Windows" or wsl2:
            info["windows_counters"] = _windows_counters(dev.index)
        info["triton"] = _triton(system)
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


def _windows_counters(index: int) -> dict[str, float | None] | str:
    """This process's and the adapter's dedicated and shared GPU memory as Windows counts it (GB), or why it cannot
    be read here."""
    from lightning_memguard.probes.wddm import open_counters

    counters, why = open_counters(index)
    if counters is None:
        return why
    try:
        usage = counters.read()
    finally:
        counters.close()
    if usage is None:
        return "no figure for this process yet"

    def gb(value: int | None) -> float | None:
        return None if value is None else round(value / 1e9, 2)

    return {
        "dedicated_gb": gb(usage.dedicated),
        "shared_gb": gb(usage.shared),
        "adapter_dedicated_gb": gb(usage.adapter_dedicated),
        "adapter_shared_gb": gb(usage.adapter_shared),
    }


def _counters_row(counters: dict[str, float | None] | str | None) -> str:
    """The doctor's line for Windows' counters.

    Example:
        >>> figures = {"dedicated_gb": 0.4, "shared_gb": 0.1, "adapter_dedicated_gb": 2.0, "adapter_shared_gb": 0.3}
        >>> _counters_row(figures)
        'this process 0.4 GB dedicated, 0.1 GB shared; the adapter 2.0 / 0.3 GB'
        >>> _counters_row("not Windows"), _counters_row(None)
        ('cannot be read: not Windows', '-')
    """
    if counters is None:
        return "-"
    if isinstance(counters, str):
        return f"cannot be read: {counters}"
    return (
        f"this process {counters['dedicated_gb']} GB dedicated, {counters['shared_gb']} GB shared;"
        f" the adapter {counters['adapter_dedicated_gb']} / {counters['adapter_shared_gb']} GB"
    )


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
        ("Windows GPU memory", _counters_row(info.get("windows_counters"))),
        ("Triton", info.get("triton") or "-"),
        ("torch / lightning / CUDA", f"{info['torch']} / {info['lightning']} / {info['cuda'] or 'CPU-only build'}"),
        ("sysmem fallback", info["verdict"]),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
