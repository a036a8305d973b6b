"""Where the driver's sysmem fallback can exist, and how to turn it off there."""

from __future__ import annotations

CONTROL_PANEL = (
    "NVIDIA Control Panel -> Manage 3D Settings -> CUDA - Sysmem Fallback Policy -> Prefer No Sysmem Fallback"
)
WSL2_SETTING = (
    "the Windows host's NVIDIA Control Panel -> Manage 3D Settings -> Global Settings -> CUDA - Sysmem Fallback"
    " Policy -> Prefer No Sysmem Fallback (WSL2 runs on the host's driver, and Program Settings lists only Windows"
    " programs)"
)


def fallback_possible(system: str, release: str, driver_model: str | None) -> bool:
    """Whether the driver's sysmem fallback can exist here: Windows with WDDM, or WSL2 (always WDDM underneath).

    Example:
        >>> fallback_possible("Windows", "10", "WDDM"), fallback_possible("Windows", "10", "TCC")
        (True, False)
        >>> fallback_possible("Linux", "5.15.90.1-microsoft-standard-WSL2", None)
        True
        >>> fallback_possible("Linux", "6.8.0-generic", None)
        False
    """
    if system == "Windows":
        return driver_model in (None, "WDDM")
    return is_wsl2(system, release)


def is_wsl2(system: str, release: str) -> bool:
    """Whether this is Linux inside WSL2, whose kernel release names Microsoft.

    Example:
        >>> is_wsl2("Linux", "5.15.153.1-microsoft-standard-WSL2"), is_wsl2("Linux", "6.8.0-generic")
        (True, False)
    """
    return system == "Linux" and "microsoft" in release.lower()


def fallback_advice(system: str, release: str) -> str:
    """How to turn the fallback off on this platform.

    Example:
        >>> fallback_advice("Windows", "11").startswith("NVIDIA Control Panel")
        True
        >>> "Global Settings" in fallback_advice("Linux", "5.15.153.1-microsoft-standard-WSL2")
        True
    """
    return WSL2_SETTING if is_wsl2(system, release) else CONTROL_PANEL
