"""Overlapped activation offload: the tensors a chosen block saves for its backward wait in pinned host memory.

While a chosen block's forward runs, ``saved_tensors_hooks`` copy each activation it saves (not parameters, not
their autocast copies, nothing under ``min_bytes``, nothing that is not dense) into a pinned host buffer on a side
stream; the forward goes on meanwhile, and when the next block ends the compute stream waits for those copies and
their device memory is given back (stream-ordered: reused at once). When the gradient reaches a block's output (just
before that block's backward), its tensors are brought back if they are not yet, and the block before it is
prefetched on a second side stream, so each block's copies back run under the next block's backward. The compute
stream waits on the copy's event before it uses a tensor; the gradients are the plain model's, bit for bit.

It pays where the copies hide behind compute: :func:`exposed_transfer_ms` says how much of them would not, from
each block's measured compute time and the link's bandwidth (``benchmarks/offload.py`` measures both). Eager mode
only; on the CPU it does nothing and says so.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import psutil
import torch
from torch import nn

from lightning_memguard._autograd import Hooks, hand_on, handed_back, hooks_around, version, view_root
from lightning_memguard.core.checks import check_callable, check_fraction, check_size
from lightning_memguard.core.units import format_size

ON_FULL = ("reduce", "refuse")

MIN_BYTES = 2**20
"""Tensors smaller than this stay on the device by default (``min_bytes``): their copies would cost more in calls
than they free."""


class CopyStreams(Protocol):
    """The copies between the device and host memory, queued off the compute stream (:class:`CudaCopyStreams` on a
    GPU; a test injects one that records the calls)."""

    def to_host(self, tensor: torch.Tensor, host: torch.Tensor) -> None:
        """Queue ``host.copy_(tensor)`` behind the compute stream's work so far. The caller keeps ``tensor`` until the
        compute stream waited (:meth:`wait`) for a later :meth:`to_host_event`: its memory is then given back in the
        compute stream's order, and reused at once."""

    def to_host_event(self) -> Any:
        """An event that completes once every copy to the host queued so far is done."""

    def to_device(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], after: Any) -> Any:
        """Queue ``device.copy_(host)`` for each ``(host, device)`` pair once ``after`` completed; return an event
        that completes when they are done."""

    def wait(self, event: Any) -> None:
        """The compute stream waits for ``event`` before its next work."""


class CudaCopyStreams:
    """:class:`CopyStreams` on a CUDA device: one side stream for the copies to the host, one for the copies back
    (two copy engines), events from ``event``.

    Args:
        device: the CUDA device.
        to_host_stream: the side stream of the copies to the host (default: a new one).
        to_device_stream: the side stream of the copies back (default: a new one).
        event: makes an event (``torch.cuda.Event``).
    """

    def __init__(
        self,
        device: torch.device,
        to_host_stream: Any = None,
        to_device_stream: Any = None,
        event: Callable[[], Any] = torch.cuda.Event,
    ) -> None:
        self.device = device
        self.to_host_stream = torch.cuda.Stream(device) if to_host_stream is None else to_host_stream
        self.to_device_stream = torch.cuda.Stream(device) if to_device_stream is None else to_device_stream
        self._event = event

    def _compute(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def to_host(self, tensor: torch.Tensor, host: torch.Tensor) -> None:
        self.to_host_stream.wait_stream(self._compute())  # the values are written
        with torch.cuda.stream(self.to_host_stream):
            host.copy_(tensor, non_blocking=True)

    def to_host_event(self) -> Any:
        event = self._event()
        event.record(self.to_host_stream)
        return event

    def to_device(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], after: Any) -> Any:
        self.to_device_stream.wait_stream(self._compute())  # the new tensors' memory is no longer in use
        self.to_device_stream.wait_event(after)  # the host copies are complete
        with torch.cuda.stream(self.to_device_stream):
            for host, device in pairs:
                device.copy_(host, non_blocking=True)
        event = self._event()
        event.record(self.to_device_stream)
        return event

    def wait(self, event: Any) -> None:
        self._compute().wait_event(event)


class HostCopies:
    """:class:`CopyStreams` that make each copy at once, on the calling thread: offload's bookkeeping, and the levers'
    planner's choice with it (``plan_levers(..., offload_streams=HostCopies())``), run on the CPU, where no side
    stream hides anything (a test, a dry run). ``to_host_calls``: the copies to the host made so far.

    Example:
        >>> copies = HostCopies()
        >>> host = torch.empty(3)
        >>> copies.to_host(torch.ones(3), host)
        >>> host.tolist(), copies.to_host_calls
        ([1.0, 1.0, 1.0], 1)
    """

    def __init__(self) -> None:
        self.to_host_calls = 0

    def to_host(self, tensor: torch.Tensor, host: torch.Tensor) -> None:
        host.copy_(tensor)
        self.to_host_calls += 1

    def to_host_event(self) -> None:
        return None

    def to_device(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], after: Any) -> None:
        for host, device in pairs:
            device.copy_(host)

    def wait(self, event: Any) -> None:
        return None


def pinned_buffer(nbytes: int) -> torch.Tensor:
    """A host buffer of ``nbytes`` bytes (``uint8``), the default host allocator: pinned where CUDA is there to pin
    it (copy streams injected on a machine without it get plain host memory)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())


def available_ram() -> int:
    """System RAM available now (psutil), the default reader of the host bound."""
    return int(psutil.virtual_memory().available)


def bucket_size(nbytes: int) -> int:
    """The host buffer that holds ``nbytes``: the next power of two (as PyTorch's pinned allocator rounds), so that
    buffers are reused across shapes.

    Example:
        >>> bucket_size(1), bucket_size(4096), bucket_size(25_165_824)
        (1, 4096, 33554432)
    """
    return 1 << max(0, nbytes - 1).bit_length()


def exposed_transfer_ms(
    forward_ms: Sequence[float],
    backward_ms: Sequence[float],
    moved_bytes: Sequence[int],
    bandwidth_gb_s: float,
    between_ms: float = 0.0,
) -> float:
    """The time a step loses to offload's copies, simulated as :class:`ActivationOffload` queues them: blocks in
    forward order, each block's copy to the host queued as its forward ends, and waited for as the next block's
    forward ends (its device memory is given back then: a copy slower than the next block's forward holds the
    forward); the head's work (``between_ms``) between the last forward and the last backward, the copies still
    running waited for as the backward begins; when the gradient reaches a block, its tensors are fetched if they
    are not yet (an offloaded last block is exposed) and the nearest offloaded block before it is prefetched; one
    copy at a time in each direction at ``bandwidth_gb_s``; a block's backward starts when its tensors are back.

    Args:
        forward_ms: each block's forward time.
        backward_ms: each block's backward time.
        moved_bytes: the bytes each block offloads (0: not offloaded).
        bandwidth_gb_s: the link's bandwidth in each direction, GB/s.
        between_ms: compute between the last block's forward and its backward (head, loss).

    Example:
        >>> exposed_transfer_ms([10] * 4, [20] * 4, [10**9] * 4, 100.0)  # only the last block's copies show
        20.0
        >>> exposed_transfer_ms([10] * 4, [20] * 4, [10**9] * 3 + [0], 100.0, between_ms=10)  # all hidden
        0.0
        >>> exposed_transfer_ms([10] * 4, [20] * 4, [10**9, 0, 0, 0], 25.0)  # block 1's forward waits 30 ms
        30.0
    """
    per_ms = bandwidth_gb_s * 1e6
    clock, to_host_free, offloaded, copying = 0.0, 0.0, {}, 0.0
    for i, (ms, nbytes) in enumerate(zip(forward_ms, moved_bytes, strict=True)):
        clock = max(clock + ms, copying)  # the blocks before this one: their copies waited for as it ends
        copying = 0.0
        if nbytes:
            to_host_free = max(to_host_free, clock) + nbytes / per_ms
            offloaded[i] = copying = to_host_free
    clock = max(clock + between_ms, copying)
    plain = sum(forward_ms) + between_ms + sum(backward_ms)
    to_device_free, back = 0.0, {}
    order = sorted(offloaded, reverse=True)

    def fetch(i: int, now: float) -> None:
        nonlocal to_device_free
        if i not in back:
            to_device_free = max(to_device_free, offloaded[i], now) + moved_bytes[i] / per_ms
            back[i] = to_device_free

    for i in reversed(range(len(forward_ms))):
        if i in offloaded:
            fetch(i, clock)
        earlier = [j for j in order if j < i]
        if earlier:
            fetch(earlier[0], clock)
        if i in offloaded:
            clock = max(clock, back[i])
        clock += backward_ms[i]
    return round(clock - plain, 6)


class _BlockCall:
    """One forward call of a block of the chain: its place in the step, its offloaded tensors (weakly: autograd owns
    them) and the device tensors they were copied from (until the compute stream waited for the copies), the event
    of their copies to the host and, once fetched, of their copies back."""

    def __init__(self, index: int, seq: int) -> None:
        self.index, self.seq = index, seq
        self.handles: list[weakref.ref[_Offloaded]] = []
        self.sources: list[torch.Tensor] = []  # the device tensors copied, kept until the compute stream waited
        self.offloaded: Any = None
        self.fetched: Any = None
        self.waited = False
        self.alive = 0


class _Offloaded:
    """What autograd keeps for one offloaded tensor: its host copy and, once fetched, its device tensor. The host
    buffer goes back to the pool when autograd lets it go."""

    __slots__ = ("__weakref__", "bucket", "call", "device", "dtype", "host", "owner", "shape", "stride")

    def __init__(self, owner: ActivationOffload, call: _BlockCall, host: torch.Tensor, bucket: torch.Tensor) -> None:
        self.owner, self.call, self.host, self.bucket = owner, call, host, bucket
        self.shape, self.stride, self.dtype = host.shape, host.stride(), host.dtype
        self.device: torch.Tensor | None = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit, the owner may be gone first
            self.owner._release(self)


class ActivationOffload:
    """Keeps the activations that chosen blocks save for their backward in pinned host memory, copied on side
    streams while compute goes on, and brings each block's back one block ahead of its backward.

    Use it around the training steps (eager mode), offloading the blocks whose copies hide behind compute
    (:func:`exposed_transfer_ms`: the early ones; the last block's copies cannot hide). The model is unchanged
    outside it: its hooks are removed on exit.

    Args:
        blocks: the model's chain of blocks, in forward order, none inside another (a transformer's layers, a
            ResNet's bottlenecks); each one's backward is the moment to prefetch the offloaded block before it.
        offloaded: the indices (in ``blocks``) of the blocks whose saved activations go to the host; default all.
        min_bytes: tensors smaller than this stay on the device.
        max_host_bytes: the most pinned host memory it may hold (bytes or ``"8GB"``); default ``host_share`` of
            the RAM available when it is entered. Beyond what is available it is refused on entry.
        host_share: the share of available RAM taken as ``max_host_bytes`` when that is not given.
        on_full: when a block's tensors do not fit in ``max_host_bytes``: ``"reduce"`` (that block is no longer
            offloaded, with a warning that names it, the blocks still offloaded and the figures) or ``"refuse"``
            (ValueError with the figures).
        streams: the copies (:class:`CopyStreams`); default :class:`CudaCopyStreams` on the blocks' CUDA device.
            On the CPU without it, nothing is offloaded and a warning says so, once.
        host_allocator: makes a host buffer of a number of bytes (:func:`pinned_buffer`).
        ram: reads the available system RAM in bytes (:func:`available_ram`).

    Attributes:
        moved_bytes: bytes copied to the host in the latest step (and back, once its backward ran).
        block_bytes: those bytes per block index.
        host_bytes: pinned host memory it holds (in use, and pooled for the next step; power-of-two buffers, as
            PyTorch's pinned allocator rounds): declare it to MemGuard (``MemGuard(offload=offload.host_bytes)``)
            so that Windows' count of it in "Shared GPU memory" is not taken for a spill.
        in_use_bytes: host memory holding tensors autograd still needs (0 once the step's backward ran).
        dropped: indices of blocks no longer offloaded because the host bound was reached.

    Raises:
        ValueError: a bad argument, a block inside another, ``max_host_bytes`` beyond the available RAM on entry,
            or, with ``on_full="refuse"``, a block that does not fit.

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
        >>> offload = ActivationOffload([model[0], model[2]], min_bytes=1)
        >>> with warnings.catch_warnings(record=True) as caught, offload:  # on the CPU: nothing to do, said once
        ...     model(torch.randn(2, 4)).sum().backward()
        >>> "does nothing on the CPU" in str(caught[0].message), offload.moved_bytes
        (True, 0)
    """

    def __init__(
        self,
        blocks: Iterable[nn.Module],
        *,
        offloaded: Iterable[int] | None = None,
        min_bytes: int | str = MIN_BYTES,
        max_host_bytes: int | str | None = None,
        host_share: float = 0.5,
        on_full: str = "reduce",
        streams: CopyStreams | None = None,
        host_allocator: Callable[[int], torch.Tensor] = pinned_buffer,
        ram: Callable[[], int] = available_ram,
    ) -> None:
        self.blocks = list(blocks) if isinstance(blocks, Iterable) else [blocks]
        if not self.blocks or not all(isinstance(b, nn.Module) for b in self.blocks):
            raise TypeError(f"`blocks` must be one or more modules, got {blocks!r}")
        for i, outer in enumerate(self.blocks):
            inside = {id(m) for m in outer.modules() if m is not outer}
            held = [j for j, b in enumerate(self.blocks) if id(b) in inside or (j != i and b is outer)]
            if held:
                raise ValueError(f"`blocks` must not hold one another: block {i} holds blocks {held}")
        indices = range(len(self.blocks)) if offloaded is None else list(offloaded)
        if not all(isinstance(i, int) and 0 <= i < len(self.blocks) for i in indices):
            last = len(self.blocks) - 1
            raise ValueError(f"`offloaded` must be indices of `blocks` (0 to {last}), got {offloaded!r}")
        self.offloaded = sorted(set(indices))
        self.min_bytes = check_size("min_bytes", min_bytes, 1)
        self._max_host_bytes = None if max_host_bytes is None else check_size("max_host_bytes", max_host_bytes, 1)
        self.host_share = check_fraction("host_share", host_share)
        if on_full not in ON_FULL:
            raise ValueError(f"`on_full` must be one of {ON_FULL}, got {on_full!r}")
        self.on_full = on_full
        self._streams = streams
        self._host_allocator = check_callable("host_allocator", host_allocator)
        self._ram = check_callable("ram", ram)
        self.max_host_bytes = self._max_host_bytes or 0  # resolved on entry
        self.moved_bytes = 0
        self.block_bytes: dict[int, int] = {}
        self.host_bytes = 0
        self.in_use_bytes = 0
        self.dropped: list[int] = []
        self._pool: dict[int, list[torch.Tensor]] = {}
        self._calls: list[_BlockCall] = []  # this step's calls with tensors offloaded, in forward order
        self._copying: list[_BlockCall] = []  # calls whose device tensors wait for their copies to the host
        self._seq = 0
        # the tensors offloaded by the block running (and the one before's output): a tensor saved again while it
        # is held here is the same tensor, and is not copied twice
        self._held: dict[tuple[Any, ...], tuple[torch.Tensor, weakref.ref[_Offloaded]]] = {}
        self._hooks: list[Any] = []
        self._stack: list[tuple[_BlockCall, Any] | None] = []
        self._active = False
        self._said_cpu = False
        self._params: set[int] = set()
        self._device: torch.device | None = None

    # --- entering and leaving -------------------------------------------------------------------------------

    def __enter__(self) -> ActivationOffload:
        if self._hooks:
            raise RuntimeError("this ActivationOffload is already in use")
        tensors = [t for b in self.blocks for t in (*b.parameters(), *b.buffers())]
        self._device = tensors[0].device if tensors else torch.device("cpu")
        if self._streams is None and self._device.type != "cuda":
            if not self._said_cpu:
                warnings.warn(
                    f"ActivationOffload does nothing on the CPU (the blocks are on {self._device}): their"
                    " activations stay where they are",
                    stacklevel=2,
                )
                self._said_cpu = True
            return self
        self.max_host_bytes = self._host_bound()
        if self._streams is None:
            self._streams = CudaCopyStreams(self._device)
        self._params = {p.data_ptr() for b in self.blocks for p in b.parameters()}
        for index, block in enumerate(self.blocks):
            self._hooks.append(block.register_forward_pre_hook(self._entering(index)))
            self._hooks.append(block.register_forward_hook(self._leaving, always_call=True))
        self._active = True
        return self

    def __exit__(self, *exc: object) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        while self._stack:  # a forward cut short
            entry = self._stack.pop()
            if entry is not None and entry[1] is not None:
                entry[1].__exit__(None, None, None)
        self._active = False
        self._settle()
        self._held.clear()
        self._pool.clear()  # tensors autograd still holds keep their buffers until it lets them go
        self.host_bytes = self.in_use_bytes

    def _host_bound(self) -> int:
        available = int(self._ram())
        if self._max_host_bytes is None:
            return int(available * self.host_share)
        if self._max_host_bytes > available:
            raise ValueError(
                f"`max_host_bytes` is {format_size(self._max_host_bytes)}, but only {format_size(available)} of"
                " system RAM is available: the host cannot hold it; give less, or leave it out (then"
                f" {self.host_share:.0%} of what is available)"
            )
        return self._max_host_bytes

    # --- the forward: hooks around each block ---------------------------------------------------------------

    def _entering(self, index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if not torch.is_grad_enabled():
                self._stack.append(None)
                return
            if not self._calls:  # nothing offloaded is still needed: a new step
                self.moved_bytes, self.block_bytes, self._seq = 0, {}, 0
            call = _BlockCall(index, self._seq)
            self._seq += 1
            hooks = None
            may_keep, outer = hooks_around()  # inside a checkpoint nothing is kept: nothing to move
            if index in self.offloaded and index not in self.dropped and may_keep:
                hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(call, t, outer), self._unpack)
                hooks.__enter__()
            self._stack.append((call, hooks))

        return hook

    def _leaving(self, module: nn.Module, args: Any, output: Any) -> None:
        entry = self._stack.pop() if self._stack else None
        if entry is None:
            return
        call, hooks = entry
        if hooks is not None:
            hooks.__exit__(None, None, None)
        outputs = _tensors(output)
        kept = {_key(t) for t in outputs}  # the next block may save this block's output again
        self._held = {k: v for k, v in self._held.items() if k in kept}
        self._settle()  # the blocks before: their copies ran under this block's forward
        if call.alive:
            call.offloaded = self._streams.to_host_event()  # type: ignore[union-attr]
            self._calls.append(call)
            self._copying.append(call)
        grad_output = next((t for t in outputs if t.requires_grad), None)
        if grad_output is not None:  # the gradient reaches the block's output: its backward is next
            grad_output.register_hook(lambda grad: self._before_backward(call))

    def _offloadable(self, t: torch.Tensor) -> bool:
        if t.device != self._device or t.numel() * t.element_size() < self.min_bytes:
            return False
        if isinstance(t, nn.Parameter) or t.data_ptr() in self._params or (t.is_leaf and t.requires_grad):
            return False
        if torch.empty_like(t, device="meta").stride() != t.stride():
            # not dense (a slice, an expanded or strided view): its copy would first make it dense in a kernel on
            # the copy stream, in memory of that stream's own pool, and the backward would get other strides. It
            # stays on the device
            return False
        return not _is_cast_parameter(t)

    def _pack(self, call: _BlockCall, t: torch.Tensor, outer: Hooks | None) -> Any:
        # what is not moved is handed on to the hooks outside these (the planner's count, the memory report, the
        # spill emulator), which count it, or move it, by their own rules, as without the offload
        if call.index in self.dropped or not self._offloadable(t):
            return hand_on(t, outer)
        key = _key(t)
        if key in self._held:
            handle = self._held[key][1]()
            if handle is not None:
                return handle
        nbytes = t.numel() * t.element_size()
        bucket = self._take(bucket_size(nbytes), call.index, nbytes)
        if bucket is None:
            return hand_on(t, outer)
        host = bucket[:nbytes].view(t.dtype).as_strided(t.shape, t.stride())  # dense: its own layout
        self._streams.to_host(t, host)  # type: ignore[union-attr]
        call.sources.append(t)
        handle = _Offloaded(self, call, host, bucket)
        call.handles.append(weakref.ref(handle))
        call.alive += 1
        self._held[key] = (t, weakref.ref(handle))
        self.moved_bytes += nbytes
        self.block_bytes[call.index] = self.block_bytes.get(call.index, 0) + nbytes
        return handle

    # --- host memory: a pool of power-of-two buffers, bounded ---------------------------------------------------

    def _take(self, size: int, index: int, nbytes: int) -> torch.Tensor | None:
        free = self._pool.get(size)
        if free:
            buffer = free.pop()
        else:
            if self.host_bytes + size > self.max_host_bytes:  # idle buffers of other sizes go first
                self.host_bytes -= sum(b.numel() for bs in self._pool.values() for b in bs)
                self._pool.clear()
            if self.host_bytes + size > self.max_host_bytes:
                self._full(index, nbytes, size)
                return None
            buffer = self._host_allocator(size)
            self.host_bytes += size
        self.in_use_bytes += size
        return buffer

    def _full(self, index: int, nbytes: int, size: int) -> None:
        figures = (
            f"block {index} needs {format_size(size)} more pinned host memory (for a tensor of"
            f" {format_size(nbytes)}) beyond the {format_size(self.host_bytes)} held, and `max_host_bytes` is"
            f" {format_size(self.max_host_bytes)}"
        )
        if self.on_full == "refuse":
            raise ValueError(f"ActivationOffload: the host cannot hold it: {figures}")
        self.dropped.append(index)
        kept = [i for i in self.offloaded if i not in self.dropped]
        warnings.warn(
            f"ActivationOffload offloads fewer blocks: {figures}; from now on blocks {sorted(self.dropped)} keep"
            f" their activations on the device, blocks {kept} are offloaded",
            stacklevel=2,
        )

    def _release(self, handle: _Offloaded) -> None:
        size = handle.bucket.numel()
        self.in_use_bytes -= size
        if self._active:
            self._pool.setdefault(size, []).append(handle.bucket)
        else:
            self.host_bytes -= size
        call = handle.call
        if handle.device is not None and not call.waited:  # fetched, never used (a backward cut short): the compute
            self._streams.wait(call.fetched)  # type: ignore[union-attr]  # stream must not reuse it mid-copy
            call.waited = True
        call.alive -= 1
        if not call.alive and call in self._calls:
            self._calls.remove(call)

    # --- the backward: each block fetched, the offloaded one before it prefetched --------------------------------

    def _settle(self) -> None:
        """The compute stream waits for the copies to the host queued so far, and their device tensors are let go:
        their memory is reused in the compute stream's order, at once (a tensor the copy stream merely recorded
        stays allocated until the copy is seen done, and the host queues a step far ahead of the device)."""
        for call in self._copying:
            self._streams.wait(call.offloaded)  # type: ignore[union-attr]
            call.sources.clear()
        self._copying.clear()

    def _before_backward(self, call: _BlockCall) -> None:
        self._held.clear()
        self._settle()
        if call in self._calls:
            self._fetch(call)
        earlier = [c for c in self._calls if c.seq < call.seq]
        if earlier:
            self._fetch(earlier[-1])

    def _fetch(self, call: _BlockCall) -> None:
        pairs = []
        for ref in call.handles:
            handle = ref()
            if handle is not None and handle.device is None:
                shape, stride, dtype = handle.shape, handle.stride, handle.dtype
                handle.device = torch.empty_strided(shape, stride, dtype=dtype, device=self._device)
                pairs.append((handle.host, handle.device))
        if pairs:
            call.fetched = self._streams.to_device(pairs, call.offloaded)  # type: ignore[union-attr]
            call.waited = False

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Offloaded):
            return handed_back(packed)
        call = packed.call
        if packed.device is None:  # the gradient did not pass the block's output first
            self._before_backward(call)
        if not call.waited:
            self._streams.wait(call.fetched)  # type: ignore[union-attr]
            call.waited = True
        assert packed.device is not None  # fetched by _before_backward
        return packed.device


def _key(t: torch.Tensor) -> tuple[Any, ...]:
    """What makes two saved tensors the same while one of them is held: memory, layout, type and version."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, version(t))


def _tensors(output: Any) -> list[torch.Tensor]:
    """The tensors of a block's output (a tensor, a tuple or list, a dict), in order."""
    if isinstance(output, torch.Tensor):
        return [output]
    values = output.values() if isinstance(output, dict) else output if isinstance(output, list | tuple) else ()
    return [t for value in values for t in _tensors(value)]


def _is_cast_parameter(t: torch.Tensor) -> bool:
    """An autocast copy of a parameter (or a view of one): cast straight from a leaf that accumulates a gradient."""
    fn = view_root(t).grad_fn
    if fn is None or type(fn).__name__ != "ToCopyBackward0":
        return False
    return any(type(nxt).__name__ == "AccumulateGrad" for nxt, _ in fn.next_functions if nxt is not None)
