"""What a memory probe reads: one value, judged by the spill rule and reported by the callbacks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MemoryReading:
    """What a probe saw since its last ``reset_peak()``, in bytes.

    Attributes:
        peak_allocated: the highest memory held by tensors.
        peak_reserved: the highest memory held by the allocator (tensors plus its cache).
        capacity: the device's physical memory.
        other_processes: memory that other processes hold on the same device now; None where it cannot be known
            (NVML unavailable). Under WDDM it is the device's used memory less this process's PyTorch memory, so it
            also counts this process's CUDA context.
        allocated_now: memory held by tensors when read; between steps, what a step starts from (the weights,
            gradients and optimizer state); None where the probe cannot say.
        shared: this process's GPU memory in system RAM as the driver counts it (Windows' "Shared GPU memory" of
            this process on the device's adapter); None where it is not counted (every platform but Windows).
        pinned: host memory this process pinned on purpose (PyTorch's pinned allocator: ``pin_memory=True``
            loaders, pinned tensors), which that count includes; None where unknown.
        alloc_retries: how many times PyTorch's CUDA allocator has freed its cache to retry an allocation that did
            not fit, since the process started (``num_alloc_retries``): growing between readings, the allocator
            thrashes; None where the probe cannot say.
    """

    peak_allocated: int
    peak_reserved: int
    capacity: int
    other_processes: int | None = 0
    allocated_now: int | None = None
    shared: int | None = None
    pinned: int | None = None
    alloc_retries: int | None = None

    @property
    def used(self) -> int:
        """What this reading puts on the device: the higher peak plus other processes' use (0 where unknown).

        Example:
            >>> MemoryReading(3, 4, 16, 2).used, MemoryReading(3, 4, 16, None).used
            (6, 4)
        """
        return max(self.peak_allocated, self.peak_reserved) + (self.other_processes or 0)
