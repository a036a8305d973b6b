"""Make a Linux GPU, or the CPU, behave like a card of a given capacity with the driver's sysmem fallback on."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_memguard.core.units import parse_bytes
from lightning_memguard.probes.base import MemoryReading

_DEFAULT_BANDWIDTH = 25e9  # bytes/s, about PCIe 4.0 x16 in practice


class _Step:
    """Memory accounting of one training step."""

    def __init__(self, base: int) -> None:
        self.base = base
        self.resident = 0
        self.spilled = 0
        self.seen: dict[tuple[int, int], bool] = {}  # storage -> spilled?

    @property
    def total(self) -> int:
        return self.base + self.resident + self.spilled


class SysmemSpillEmulator(Callback):
    """A card of ``capacity`` bytes whose driver spills into system RAM instead of raising out-of-memory.

    Activations that autograd saves for the backward pass are counted on top of the memory allocated when the
    step starts; once the sum passes ``capacity``, further saved activations "spill":

    - on CUDA they really go to pinned host memory and come back for the backward pass, crossing PCIe twice, as
      the Windows driver's fallback does;
    - on the CPU the transfer time of the spilled bytes at ``bandwidth`` is charged (as a sleep) both ways.

    Its :attr:`probe` reports what PyTorch reports on such a card: allocated memory *plus* the spilled bytes, and
    ``capacity`` as the physical memory. Use it as a callback (put it before :class:`~lightning_memguard.MemGuard`)
    or, without Lightning, as a context manager around one step's forward and backward.

    Args:
        capacity: the emulated card's memory: bytes or a string such as ``"16GB"``.
        bandwidth: host-device bytes per second for the CPU emulation (default 25 GB/s), or a string ``"25GB"``.
        sleep: the CPU emulation's way to spend time; a test may inject a fake.

    Example:
        >>> import torch
        >>> emu = SysmemSpillEmulator(capacity="1MB")
        >>> x = torch.randn(512, 1024, requires_grad=True)
        >>> with emu:
        ...     y = x * 2  # an activation of 2 MB, saved twice by the product below
        ...     (y * y).sum().backward()
        >>> reading = emu.probe.read()
        >>> reading.capacity, reading.peak_allocated > reading.capacity, emu.spilled_bytes > 0
        (1000000, True, True)
    """

    def __init__(
        self,
        capacity: int | str,
        bandwidth: int | float | str = _DEFAULT_BANDWIDTH,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.capacity = parse_bytes(capacity, "capacity")
        self.bandwidth = parse_bytes(bandwidth, "bandwidth")
        self._sleep = sleep
        self._step: _Step | None = None
        self._hooks: Any = None
        self._module: torch.nn.Module | None = None
        self._peak = 0
        self._peak_spilled = 0
        self.spilled_bytes = 0  # spilled during the last step
        self.total_spilled_bytes = 0
        self.probe = EmulatedProbe(self)

    # ------------------------------------------------------------------ as a context manager

    def __enter__(self) -> SysmemSpillEmulator:
        self._begin(self._base_bytes())
        return self

    def __exit__(self, *exc: object) -> None:
        self._end()

    # ------------------------------------------------------------------ as a callback

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._module = pl_module
        self._begin(self._base_bytes(trainer))

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._end()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._end()

    # ------------------------------------------------------------------ accounting

    def _base_bytes(self, trainer: Trainer | None = None) -> int:
        """Memory held before the step's activations: the allocator's count on CUDA, the model's state on the CPU."""
        if torch.cuda.is_available() and (trainer is None or trainer.strategy.root_device.type == "cuda"):
            return int(torch.cuda.memory_allocated())
        if self._module is None:
            return 0
        params = [p for p in self._module.parameters()]
        total = sum(p.numel() * p.element_size() for p in params)
        total += sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
        if trainer is not None:
            for opt in trainer.optimizers:
                for state in opt.state.values():
                    total += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
        return total

    def _begin(self, base: int) -> None:
        self._end()
        self._step = _Step(base)
        self.spilled_bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        self._peak = max(self._peak, base)

    def _end(self) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None

    def _pack(self, tensor: torch.Tensor) -> Any:
        step = self._step
        root = tensor._base if tensor._base is not None else tensor
        if step is None or root.is_leaf:
            return tensor  # parameters, inputs and views of them exist before the step: counted in the base
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        new = key not in step.seen  # the same memory saved twice (e.g. by two ops) is counted once
        if new:
            nbytes = storage.nbytes()
            spill = step.total + nbytes > self.capacity
            if spill:
                step.spilled += nbytes
                self.spilled_bytes += nbytes
                self.total_spilled_bytes += nbytes
            else:
                step.resident += nbytes
            step.seen[key] = spill
            self._peak = max(self._peak, step.total)
            self._peak_spilled = max(self._peak_spilled, step.spilled)
        if not step.seen[key]:
            return tensor
        return self._to_host(tensor, storage.nbytes() if new else 0)

    def _to_host(self, tensor: torch.Tensor, nbytes: int) -> Any:
        if tensor.device.type == "cuda":
            host = torch.empty_like(tensor, device="cpu", pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            return ("spilled", host, tensor.device)
        if nbytes:
            self._sleep(nbytes / self.bandwidth)
        return ("spilled", tensor, tensor.untyped_storage().nbytes())

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not (isinstance(packed, tuple) and len(packed) == 3 and packed[0] == "spilled"):
            return packed
        _, data, where = packed
        if isinstance(where, torch.device):
            return data.to(where, non_blocking=True)
        self._sleep(where / self.bandwidth)
        return data


class EmulatedProbe:
    """What PyTorch reports on the emulated card: real allocated memory plus the bytes that spilled."""

    def __init__(self, emulator: SysmemSpillEmulator) -> None:
        self._emu = emulator

    def capacity(self) -> int:
        return self._emu.capacity

    def reset_peak(self) -> None:
        emu = self._emu
        emu._peak = emu._step.total if emu._step is not None else 0
        emu._peak_spilled = 0
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    def read(self) -> MemoryReading:
        emu = self._emu
        if torch.cuda.is_available() and torch.cuda.memory_allocated() > 0:
            stats = torch.cuda.memory_stats()
            allocated = int(stats["allocated_bytes.all.peak"]) + emu._peak_spilled
            reserved = int(stats["reserved_bytes.all.peak"]) + emu._peak_spilled
            return MemoryReading(max(allocated, emu._peak), max(reserved, emu._peak), emu.capacity)
        return MemoryReading(emu._peak, emu._peak, emu.capacity)

    def overallocation_succeeds(self) -> bool:
        """On a card with sysmem fallback, allocating more than is free succeeds."""
        return True
