"""Make a Linux GPU, or the CPU, behave like a card of a given capacity with the driver's sysmem fallback on."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning_utilities.core.apply_func import apply_to_collection
from typing_extensions import override

from lightning_memguard import _autograd, _compiler
from lightning_memguard._ledger import DEVICE, HOST, Ledger, counting_unseen, storage_nbytes
from lightning_memguard._lightning.privates import model_logging_dropped
from lightning_memguard.core.checks import check_callable, check_greater, check_size
from lightning_memguard.probes.base import MemoryReading

_DEFAULT_BANDWIDTH = 25e9  # bytes/s, about PCIe 4.0 x16 in practice


class _Step:
    """Memory accounting of one training step, in bytes."""

    def __init__(
        self,
        device: torch.device | None,
        base: int,
        transient: int,
        existing: Callable[[], list[torch.Tensor]] | None,
    ) -> None:
        self.device = device
        self.base = base  # held before the step: weights, gradients, optimizer state, the batch
        self.transient = transient  # what the last step needed beyond its saved activations (backward buffers)
        self.spilled_kept = 0  # of the spilled, a compiled graph's on CUDA: a real round trip, still allocated
        self.started = 0.0  # the clock when the step began (the CPU's charge for its spill is relative to its time)
        self.saw_compiled = False  # a compiled graph saved tensors (its parameters at least)
        self.compiles = _compiler.CompileWatch()  # moved by the step's end: the step compiled
        self.knows_model = existing is not None  # False as a context manager: no parameters, buffers, batch known
        self._existing = existing
        self._ledger: Ledger[str] | None = None

    @property
    def ledger(self) -> Ledger[str]:
        """The step's saved tensors, each storage once (made at the first: by then the batch is known)."""
        if self._ledger is None:
            self._ledger = Ledger(self._existing() if self._existing is not None else ())
        return self._ledger

    @property
    def resident(self) -> int:
        """Saved activations kept on the device."""
        return self._ledger.on_device if self._ledger is not None else 0

    @property
    def spilled(self) -> int:
        """Saved activations moved to the host (or, on CUDA, a compiled graph's: see ``_to_host``)."""
        return self._ledger.on_host if self._ledger is not None else 0

    @property
    def on_device(self) -> int:
        return self.base + self.resident + self.transient


class SysmemSpillEmulator(Callback):
    """A card of ``capacity`` bytes whose driver spills into system RAM instead of raising out-of-memory.

    Every activation that autograd saves for the backward pass is counted on top of what the step started with
    (and, on CUDA, on top of what the previous step needed beyond its activations), as the one ledger of saved
    tensors counts it (``lightning_memguard._ledger``, which the planner and the memory report keep too): each
    storage once, whole; the parameters, autocast's copies of them, the buffers and the batch are not activations;
    max-pooling indices, BatchNorm's batch statistics and tensors made in the step are. What is kept for backward
    out of the saved-tensor hooks' sight (the outputs a selective activation checkpoint caches:
    :func:`~lightning_memguard.levers.recompute_pointwise`'s matrix products) is counted too, handed in by the ledger,
    and always as on the card: no hook gets it to move it, so it never spills, yet it fills the card as any
    activation does, and what is saved after it spills sooner. Once the sum would pass ``capacity``, further saved
    activations "spill":

    - on CUDA they really go to pinned host memory and come back for the backward pass, crossing PCIe twice, as
      the Windows driver's fallback does;
    - on the CPU the transfer time of the spilled bytes at ``bandwidth`` is charged (as a sleep) both ways; with
      ``spill_cost``, in proportion to the step's own time instead, at the step's end: each spilled byte, each way,
      costs ``spill_cost`` times what the step spent per byte it saved. At 25 GB/s a spill's time vanishes in a
      CPU's slow compute (a larger batch, spilling, still looks faster); with ``spill_cost=5`` a step that spills
      half of what it saves runs about 6x slower, one that spills all about 11x, however fast this CPU is, as a
      spill shows on a card (7x to 45x seen): ``memguard sweep`` and ``plan`` emulate a card on the CPU so.

    Its :attr:`probe` reports what PyTorch reports on such a card: the step's peak *plus* the spilled bytes, and
    ``capacity`` as the physical memory. Use it as a callback (put it before :class:`~lightning_memguard.MemGuard`)
    or, without Lightning, as a context manager around one step's forward and backward.

    Under ``torch.compile`` (any backend) the tensors a compiled graph saves for its backward pass are counted and
    spill the same way: AOTAutograd saves them through the same hooks, as tensors without autograd history. The
    model's parameters and buffers and the batch, which the graph saves as well, are not activations. A compiled
    ResNet-18 reports 1 % more saved bytes than the same model in eager mode (``aot_eager`` on the CPU), an MLP the
    same bytes. On CUDA a compiled graph's spilled tensors stay allocated (all of them exist when the graph's forward
    returns, moved or not), a copy crosses PCIe both ways, and the probe's figure is the real peak. A step during
    which dynamo compiles (the first step, a recompile for a short last batch) counts what it saved instead of its
    real peak, which holds the compiler's own work. Should a PyTorch release stop passing a compiled graph's saved
    tensors through the hooks, the first step that runs compiled code warns instead of reporting no spill. As a
    context manager the emulator does not know the model nor the batch: every leaf tensor eager ops save (the batch,
    a buffer, but also max-pooling indices) is taken to exist before the step, and a compiled graph's buffers and its
    inputs that do not require grad count as activations.

    Args:
        capacity: the emulated card's memory: bytes or a string such as ``"16GB"``, at most 1 EB (1 byte is
            allowed here: a card on which every activation spills).
        bandwidth: host-device bytes per second for the CPU emulation (default 25 GB/s), or a string ``"25GB"``.
        sleep: the CPU emulation's way to spend time; a test may inject a fake.
        spill_cost: on the CPU, charge a spill relative to the step's own time instead (see above); None: by
            ``bandwidth``.
        clock: the CPU emulation's clock with ``spill_cost``, in seconds (``time.perf_counter``); a test may inject a
            fake.

    Attributes:
        other_processes: bytes another application holds on the emulated card (0 at first); set it in the middle of
            a run, as a browser or a game taking memory would: this process's activations spill sooner, and the
            probe reports it as other processes' memory, as NVML does.
        resident_bytes: the last step's saved activations kept on the card; ``spilled_bytes``, those that spilled.

    Raises:
        TypeError, ValueError: a bad argument, naming it (a size that is not a whole, positive number of bytes).

    Warns:
        RuntimeWarning: once, at the first step that ran compiled code whose saved tensors the emulator did not see.

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

    memguard_keep_in_trials = True  # the tuners' trials run on the emulated card too

    def __init__(
        self,
        capacity: int | str,
        bandwidth: int | float | str = _DEFAULT_BANDWIDTH,
        sleep: Callable[[float], None] = time.sleep,
        spill_cost: float | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.capacity = check_size("capacity", capacity)  # a card of 1 byte is allowed here: everything spills
        self.bandwidth = check_size("bandwidth", bandwidth)
        self.spill_cost = None if spill_cost is None else check_greater("spill_cost", spill_cost, 0)
        check_callable("sleep", sleep, "a callable taking seconds")
        check_callable("clock", clock, "a callable returning seconds")
        self._sleep = sleep
        self._clock = clock
        self._step: _Step | None = None
        self._hooks: Any = None
        self._unseen: Any = None  # the ledger's count of what the hooks do not see
        self._module: LightningModule | None = None
        self._transient = 0
        self._batch: Any = None
        self._warned_unseen = False
        # memory another application holds on the card (a browser, a game, a second notebook): set it in the middle
        # of a run and this process's activations spill sooner, as they would; the probe reports it as other processes'
        self.other_processes = 0
        self.peak = 0  # the highest per-step figure (peak plus spilled) since the probe's last reset
        self.step_base: int | None = None  # what the last step started from: weights, gradients, optimizer, batch
        self.spilled_bytes = 0  # spilled during the last step
        self.total_spilled_bytes = 0
        self.probe = EmulatedProbe(self)

    @property
    def resident_bytes(self) -> int:
        return self._step.resident if self._step is not None else 0

    # ------------------------------------------------------------------ as a context manager

    def __enter__(self) -> SysmemSpillEmulator:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        self._begin(device)
        return self

    def __exit__(self, *exc: object) -> None:
        self._end()

    # ------------------------------------------------------------------ as a callback

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._module = pl_module
        device = trainer.strategy.root_device
        self._begin(device if device.type == "cuda" else None, trainer)
        self._batch = batch  # for the step's existing storages (see _existing_storages)

    @override
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        step = self._step
        if step is None or step.saw_compiled or self._warned_unseen or not _compiler.compiles():
            return
        if _compiler.ran_compiled(loss):  # compiled code ran, and none of its saved tensors reached the hooks
            self._warned_unseen = True
            warnings.warn(
                "SysmemSpillEmulator cannot see the activations of the torch.compile'd part of this model with torch "
                f"{torch.__version__}: none of the tensors its compiled graph saved for the backward pass reached "
                "the emulator, so their spill is not emulated and the emulated card looks larger than it is. Run "
                "the model without torch.compile under the emulator, or use PyTorch's own memory figures "
                "(torch.cuda.max_memory_allocated) against the capacity.",
                RuntimeWarning,
                stacklevel=2,
            )

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._end()

    def memguard_micro_batch_end(self, trainer: Trainer) -> None:
        """A micro-batch's backward is done inside a step that MemGuard split (``on_spill="adapt"``): its saved
        activations are freed, as on a card; the next micro-batch is counted from what the step holds now (its
        gradients included), the batch's peak is the highest of its micro-batches'."""
        if self._step is None:
            return
        batch = self._batch
        self._end()
        device = trainer.strategy.root_device
        self._begin(device if device.type == "cuda" else None, trainer)
        self._batch = batch

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._end()
        self._forget_the_fit()  # Lightning calls no teardown after an exception

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._end()
        self._forget_the_fit()

    def _forget_the_fit(self) -> None:
        """The fit ended: its model (weights, gradients, optimizer state) is not kept; the figures stay."""
        self._module = None
        model_logging_dropped(self)

    # ------------------------------------------------------------------ accounting

    def _cpu_base(self, trainer: Trainer | None) -> int:
        """On the CPU: the bytes of the model's weights, gradients and optimizer state."""
        if self._module is None:
            return 0
        params = list(self._module.parameters())
        total = sum(p.numel() * p.element_size() for p in params)
        total += sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
        for opt in trainer.optimizers if trainer is not None else []:
            for state in opt.state.values():
                total += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
        return total

    def _existing_tensors(self) -> list[torch.Tensor]:
        """The model's parameters and buffers and the batch: they exist before the step (in the base), saved as they
        are by eager ops and by a compiled graph alike, and are not activations."""
        tensors: list[torch.Tensor] = []
        if self._module is not None:
            tensors += list(self._module.parameters()) + list(self._module.buffers())
        apply_to_collection(self._batch, torch.Tensor, tensors.append)
        return tensors

    def _begin(self, device: torch.device | None, trainer: Trainer | None = None) -> None:
        self._end()
        if device is not None:
            base = int(torch.cuda.memory_allocated(device))
            torch.cuda.reset_peak_memory_stats(device)
        else:
            base = self._cpu_base(trainer)
        existing = self._existing_tensors if self._module is not None else None  # None: a context manager
        self._step = _Step(device, base, self._transient, existing)
        self._step.started = self._clock()
        self.step_base = base
        self.spilled_bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        self._unseen = counting_unseen(self._kept_unseen)
        self._unseen.__enter__()

    def _end(self) -> None:
        self._batch = None
        if self._unseen is not None:
            unseen, self._unseen = self._unseen, None
            unseen.__exit__(None, None, None)
        if self._hooks is None:
            return
        self._hooks.__exit__(None, None, None)
        self._hooks = None
        step = self._step
        if step is None:
            return
        if step.device is None:
            self.peak = max(self.peak, step.base + step.resident + step.spilled)
            if self.spill_cost is not None and step.spilled:  # the round trip, relative to the step's own time
                elapsed = max(0.0, self._clock() - step.started)
                self._sleep(2 * self.spill_cost * elapsed * step.spilled / (step.resident + step.spilled))
        elif step.compiles.moved():
            # dynamo compiled during this step (the first step, a recompile for the last short batch): the real peak
            # holds the compiler's work, which training does not repeat, so this step counts what it saved
            self.peak = max(self.peak, step.base + step.resident + step.spilled + step.transient)
        else:
            real_peak = int(torch.cuda.max_memory_allocated(step.device))
            self._transient = max(0, real_peak - step.base - step.resident - step.spilled_kept)
            self.peak = max(self.peak, real_peak + step.spilled - step.spilled_kept)

    def _pack(self, tensor: torch.Tensor) -> Any:
        step = self._step
        if step is None:
            return _autograd.kept(tensor)
        root = _autograd.view_root(tensor)
        # a compiled graph saves leaves only (its activations, parameters, inputs): the frame walk is for those
        compiled = root.is_leaf and _compiler.saved_by_compiled_graph()
        step.saw_compiled |= compiled
        # A compiled graph's own activations are leaves that do not require grad (see _compiler).
        produced_by_graph = compiled and not root.requires_grad
        # Parameters (and autocast's copies of them), buffers and the batch exist before the step: counted in the
        # base, as the ledger knows them. As a context manager the emulator knows no model nor batch: then every leaf
        # eager ops save is taken to exist before the step.
        if (not step.knows_model and root.is_leaf and not produced_by_graph) or step.ledger.exists(tensor):
            return _autograd.kept(tensor)
        entry = step.ledger.entry(tensor)  # the same memory saved twice (e.g. by two ops) is counted once
        new = entry is None
        if entry is None:
            nbytes = storage_nbytes(tensor)
            spill = step.on_device + nbytes + self.other_processes > self.capacity
            entry = step.ledger.save(tensor, "", HOST if spill else DEVICE)
            if spill:
                self.spilled_bytes += nbytes
                self.total_spilled_bytes += nbytes
        if entry is None or entry.where == DEVICE:
            return _autograd.kept(tensor)
        return self._to_host(step, tensor, entry.nbytes if new else 0, keep=produced_by_graph)

    def _kept_unseen(self, tensor: torch.Tensor) -> None:
        """A tensor kept for backward past the hooks (a selective checkpoint's cache): no hook of ours can move it, so
        it is counted on the card, whatever the capacity (where something already saved holds its storage, as that
        is)."""
        step = self._step
        if step is not None:
            step.ledger.save(tensor, "", DEVICE)

    def _to_host(self, step: _Step, tensor: torch.Tensor, nbytes: int, keep: bool) -> Any:
        if tensor.device.type == "cuda":
            host = torch.empty_like(tensor, device="cpu", pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            if not keep:
                return ("spilled", host, tensor.device)
            # A compiled graph's saved tensors are all allocated when its forward returns, whether they move or not:
            # they stay where the allocator has them (the real peak counts them, as the card's would), and the
            # round trip writes them back in place for the backward pass.
            step.spilled_kept += nbytes
            return ("spilled", host, _autograd.kept(tensor))
        if nbytes and self.spill_cost is None:
            self._sleep(nbytes / self.bandwidth)
        return ("spilled", _autograd.kept(tensor), tensor.untyped_storage().nbytes())

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not (isinstance(packed, tuple) and len(packed) == 3 and packed[0] == "spilled"):
            return packed
        _, data, where = packed
        if isinstance(where, torch.device):
            return data.to(where, non_blocking=True)
        if isinstance(where, torch.Tensor):
            with torch.no_grad():
                where.copy_(data, non_blocking=True)
            return where
        if self.spill_cost is None:
            self._sleep(where / self.bandwidth)
        return data


class EmulatedProbe:
    """What PyTorch reports on the emulated card: each step's peak plus the bytes that spilled."""

    def __init__(self, emulator: SysmemSpillEmulator) -> None:
        self._emu = emulator

    def capacity(self) -> int:
        return self._emu.capacity

    def reset_peak(self) -> None:
        self._emu.peak = 0

    def read(self) -> MemoryReading:
        peak = self._emu.peak
        emu = self._emu
        return MemoryReading(peak, peak, emu.capacity, emu.other_processes, allocated_now=emu.step_base)

    def overallocation_succeeds(self) -> bool:
        """On a card with sysmem fallback, allocating more than the card has succeeds."""
        return True
