"""MemGuard's guards before training: the allocator cap (``prevent=True``), the platform notice and the preflight."""

from __future__ import annotations

import platform

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_memguard.core.capacity import allocator_cap
from lightning_memguard.core.messages import FIXES
from lightning_memguard.core.platform import fallback_advice, fallback_possible, is_wsl2
from lightning_memguard.core.units import to_gb
from lightning_memguard.probes import MemoryProbe


class AllocatorCap:
    """PyTorch's CUDA allocator capped at the capacity less what other processes hold and a margin, so that an
    overflow is an immediate out-of-memory error instead of a spill; lifted again at teardown.

    Args:
        margin: bytes left free beyond other processes' use (this process's CUDA context, their growth).
    """

    def __init__(self, margin: int) -> None:
        self.margin = margin
        self.fraction: float | None = None  # of the device's memory, while the cap is set
        self.capacity = 0
        self.others: int | None = None  # what other processes held when it was set (None: unknown)

    def apply(self, device: torch.device, capacity: int, probe: MemoryProbe) -> None:
        total = torch.cuda.get_device_properties(device).total_memory
        others = probe.read().other_processes
        allowed = allocator_cap(capacity, total, others, self.margin)
        if allowed <= 0:
            held = "unknown" if others is None else f"{to_gb(others):.2f} GB"
            raise ValueError(
                f"`prevent=True` leaves no memory: capacity {to_gb(min(capacity, total)):.2f} GB, other processes"
                f" hold {held}, margin {to_gb(self.margin):.2f} GB"
            )
        if others is None:
            rank_zero_warn(
                "MemGuard(prevent=True): other processes' use of this GPU is unknown (NVML unavailable), so the cap"
                f" leaves them only the margin of {to_gb(self.margin):.2f} GB (`prevent_margin`).",
                category=RuntimeWarning,
            )
        self.capacity, self.others, self.fraction = capacity, others, allowed / total
        torch.cuda.set_per_process_memory_fraction(self.fraction, device)
        rank_zero_info(
            f"MemGuard(prevent=True): PyTorch may use {to_gb(allowed):.2f} GB of this GPU's {to_gb(total):.2f} GB"
            f" ({self.fraction:.1%}; other processes hold "
            f"{'an unknown amount' if others is None else f'{to_gb(others):.2f} GB'},"
            f" margin {to_gb(self.margin):.2f} GB)"
        )

    def release(self, device: torch.device) -> None:
        if self.fraction is not None:
            torch.cuda.set_per_process_memory_fraction(1.0, device)
            self.fraction = None

    def explain(self, exception: BaseException) -> None:
        """Add to an out-of-memory error raised under the cap why it was raised and what to do."""
        if self.fraction is None or not isinstance(exception, torch.OutOfMemoryError) or not exception.args:
            return
        others = "use (unknown)" if self.others is None else f"{to_gb(self.others):.2f} GB"
        exception.args = (
            f"{exception.args[0]}\n\nMemGuard(prevent=True) capped PyTorch at {self.fraction:.1%} of"
            f" this GPU ({to_gb(self.capacity):.2f} GB capacity less other processes' {others} and a margin of"
            f" {to_gb(self.margin):.2f} GB) so that this overflow fails now instead of spilling into"
            " system RAM and running many times slower. "
            "Use less memory per step:\n" + FIXES,
            *exception.args[1:],
        )


def notice_platform(probe: MemoryProbe) -> None:
    """Once, where the driver's fallback can exist (WDDM, WSL2): that it can, and how to turn it off."""
    driver = probe.driver_info() if hasattr(probe, "driver_info") else {}
    system, release = platform.system(), platform.release()
    if fallback_possible(system, release, driver.get("driver_model")):
        where = "inside WSL2" if is_wsl2(system, release) else "under a WDDM driver"
        rank_zero_warn(
            f"This GPU runs {where}, where the CUDA Sysmem Fallback Policy can move memory into system RAM instead"
            " of raising out-of-memory. MemGuard watches for it; to rule it out: "
            f"{fallback_advice(system, release)}; or use MemGuard(prevent=True).",
            category=UserWarning,
        )


def run_preflight(probe: MemoryProbe) -> bool | None:
    """Whether allocating more than the card has succeeds (the fallback is on; warns); None where the probe cannot
    try."""
    trial = getattr(probe, "overallocation_succeeds", None)
    if trial is None:
        rank_zero_info(f"MemGuard: no preflight on {type(probe).__name__}: it cannot overallocate")
        return None
    enabled = bool(trial())
    if enabled:
        moved = getattr(probe, "preflight_moved", None)
        counted = f" (Windows counted {to_gb(moved):.2f} GB of it in system RAM)" if moved else ""
        rank_zero_warn(
            f"MemGuard preflight: allocating more GPU memory than the card has succeeded{counted}, so the driver's"
            " sysmem fallback is on and an overflow will slow this run down instead of failing. MemGuard will stop"
            " the run if it spills.\n" + FIXES,
            category=RuntimeWarning,
        )
    return enabled
