"""The one ledger of the tensors a training step saves for its backward pass, kept by every count of them: the
planner's measurement (:class:`~lightning_memguard.checkpointing.measure.StepMeter`), the memory report's attribution
(:class:`~lightning_memguard.forensics.attribution.SavedTensorRecorder`) and the spill emulator's on-device count
(:class:`~lightning_memguard.testing.SysmemSpillEmulator`), so the three give the same bytes for one step.

- **Which storage.** A saved tensor is known by its storage, as the allocator holds it: the address and device of
  this process's storage (a sharded ``DTensor``'s local shard), shared by all views of it (:func:`storage_key`). A
  storage freed within the step whose address the allocator gives to a new one (a saved tensor moved to the host)
  is a new storage, told apart by a weak reference to the first (:func:`~lightning_memguard._autograd.storage_watch`).
- **What it costs.** A storage is charged once, whole: the allocator keeps all of it while any view of it is saved.
- **Whose it is.** Where the charge is split by owner (the report's modules, the planner's links), each saved view
  is charged its own byte range first, the bytes of it not charged before (:func:`charge`); the rest of the storage,
  held alive only through the views, goes to the owners of its views in proportion to what each charged of it (all
  to the first where they charged nothing), so the owners' shares sum to the total exactly (:meth:`Ledger.shares`).
- **What existed before the step.** Parameters (a leaf that requires grad, as its strategy hands it to the forward,
  and autocast's low-precision copy of one), the model's buffers and the batch (the storages given to the ledger):
  these are not activations, and are not charged (:meth:`Ledger.exists`). Everything else saved is: a max-pooling's
  indices, BatchNorm's batch statistics, a low-precision copy of the batch, a tensor made in the step.
- **Where it is.** Each entry says where its bytes are held: on the device (:data:`DEVICE`), or moved to the host
  (:data:`HOST`: the emulated driver's spill, an offload hook); and whether a fused operation saved it (``fused``).
- **What no hook sees.** A count of a step's saved tensors reads them through saved-tensor hooks; a tensor kept for
  backward past those hooks (the outputs a selective activation checkpoint caches: the pointwise lever's matrix
  products) is handed, by the code that keeps it (:func:`kept_unseen`), to the counts open around it
  (:func:`counting_unseen`: the innermost, and those outside it as hooks hand on), each charging it as its hooks
  charge the rest. No hook having moved it, it is held on the device.

Torch only, no Lightning.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch
from torch.distributed.tensor import DTensor

from lightning_memguard import _autograd

Key = tuple[int, str]  # a storage: its address and device
Owner = TypeVar("Owner", bound=Hashable)  # who a charge is split by: a module's name, a link and a part

DEVICE = "device"  # an entry's bytes are held on the device
HOST = "host"  # an entry's bytes were moved to host memory: the card does not hold them


def held(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage this process holds: a sharded tensor's local shard (a DTensor under FSDP2 or
    ``ModelParallelStrategy`` has no storage of its own), else the tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def storage_key(tensor: torch.Tensor) -> Key:
    """A tensor's storage, as the allocator holds it: its address and device (views of one tensor share it).

    Example:
        >>> x = torch.zeros(4, 4)
        >>> storage_key(x[1:].t()) == storage_key(x), storage_key(x.clone()) == storage_key(x)
        (True, False)
    """
    local = held(tensor)
    return local.untyped_storage().data_ptr(), str(local.device)


def storage_nbytes(tensor: torch.Tensor) -> int:
    """The bytes of ``tensor``'s whole storage: what the allocator keeps while any view of it lives."""
    return int(held(tensor).untyped_storage().nbytes())


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages among ``tensors``, each counted once."""
    seen: dict[Key, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            seen.setdefault(storage_key(t), storage_nbytes(t))
    return sum(seen.values())


def byte_range(tensor: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage that ``tensor`` spans, as ``(start, end)``: a view's own, not its base's.

    Example:
        >>> batch = torch.zeros(16, 8)
        >>> byte_range(batch[4:8]), byte_range(batch[:, :2])
        ((128, 256), (0, 488))
    """
    size = tensor.element_size()
    start = int(tensor.storage_offset()) * size
    if tensor.numel() == 0:
        return start, start
    last = int(sum((n - 1) * stride for n, stride in zip(tensor.shape, tensor.stride(), strict=True)))
    return start, start + (last + 1) * size


def charge(charged: list[tuple[int, int]], start: int, end: int) -> int:
    """The bytes of ``[start, end)`` not yet in ``charged`` (a storage's ranges charged so far, kept merged and
    sorted), which are added to it.

    Example:
        >>> ranges = []
        >>> charge(ranges, 0, 100), charge(ranges, 50, 150), charge(ranges, 0, 150), ranges
        (100, 50, 0, [(0, 150)])
    """
    new = end - start - sum(max(0, min(hi, end) - max(lo, start)) for lo, hi in charged)
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted([*charged, (start, end)]):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    charged[:] = merged
    return max(0, new)


def tensors_in(structure: Any) -> list[torch.Tensor]:
    """The tensors in a batch: a tensor, or inside mappings, lists, tuples, sets and dataclasses, at any depth.

    Example:
        >>> x = torch.zeros(2)
        >>> len(tensors_in({"x": x, "rest": [x, (x, "label")], "n": 3}))
        3
    """
    if isinstance(structure, torch.Tensor):
        return [structure]
    if isinstance(structure, Mapping):
        structure = list(structure.values())
    elif dataclasses.is_dataclass(structure) and not isinstance(structure, type):
        structure = [getattr(structure, f.name) for f in dataclasses.fields(structure)]
    if isinstance(structure, list | tuple | set | frozenset):
        return [t for item in structure for t in tensors_in(item)]
    return []


@dataclass
class Entry(Generic[Owner]):
    """One storage a step saved.

    Attributes:
        key: the storage (:func:`storage_key`).
        nbytes: its whole size, charged once.
        where: :data:`DEVICE`, or :data:`HOST` where its bytes were moved to host memory (the emulated driver's
            spill, an offload hook): the card does not hold them.
        fused: the fused operation that saved it (a fused loss keeping its input's gradient from the forward),
            None for an ordinary saved tensor; charged as any other, named so a report can say what a fusion holds.
        own: bytes of its views charged to each owner, in the order the owners first saved a view of it.
        ranges: its byte ranges charged so far, merged.
        events: the index in :attr:`Ledger.events` of each owner's first charge of it.
        freed: whether the storage has since been freed (its address may then be another storage's).
    """

    key: Key
    nbytes: int
    where: str = DEVICE
    fused: str | None = None
    own: dict[Owner, int] = field(default_factory=dict)
    ranges: list[tuple[int, int]] = field(default_factory=list)
    events: dict[Owner, int] = field(default_factory=dict)
    freed: Callable[[], bool] = lambda: False

    def shares(self) -> dict[Owner, int]:
        """Each owner's share of the storage: its own bytes, and of the rest (the bytes no saved view spans) a part
        in proportion to them (all to the first owner where none charged any); the shares sum to ``nbytes``.

        Example:
            >>> entry = Entry((0, "cpu"), 100, own={"a": 30, "b": 10})
            >>> entry.shares()
            {'a': 75, 'b': 25}
        """
        if not self.own:
            return {}
        first = next(iter(self.own))
        rest = max(0, self.nbytes - sum(self.own.values()))
        spanned = sum(self.own.values())
        shares = {o: b + (rest * b // spanned if spanned else 0) for o, b in self.own.items()}
        shares[first] += self.nbytes - sum(shares.values()) if rest else 0
        return shares


class Ledger(Generic[Owner]):
    """The tensors one step saved, each storage once (see the module's docstring for the rules).

    Args:
        existing: the tensors that exist before the step besides the parameters: the model's parameters and buffers
            and the batch's tensors (their storages, and views of them, are never charged).

    Example:
        >>> linear = torch.nn.Linear(4, 4)
        >>> batch = torch.randn(8, 4)
        >>> ledger: Ledger[str] = Ledger([*linear.parameters(), *linear.buffers(), batch])
        >>> hidden = linear(batch)
        >>> ledger.save(batch, "input"), ledger.save(linear.weight.t(), "weight")  # existed before the step
        (None, None)
        >>> ledger.save(hidden[:4], "head").own  # its own half of `hidden`
        {'head': 64}
        >>> ledger.total, ledger.shares()  # the whole storage of `hidden`: the allocator keeps all of it
        (128, {'head': 128})
    """

    def __init__(self, existing: Iterable[torch.Tensor] = ()) -> None:
        self._existing = frozenset(storage_key(t) for t in existing if t.device.type != "meta")
        self.entries: dict[Key, Entry[Owner]] = {}  # the storages saved and alive, or saved and not yet seen reused
        self.retired: list[Entry[Owner]] = []  # storages saved, then freed within the step, their address reused
        self.events: list[tuple[Owner, int]] = []  # (owner, bytes of its own range) as saved, in order

    def exists(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` existed before the step: a parameter (a view of a leaf that requires grad), autocast's
        copy of one, or a storage given as existing (a buffer, the batch)."""
        root = _autograd.view_root(tensor)
        if root.is_leaf and root.requires_grad:
            return True  # a parameter as its strategy hands it to the forward (FSDP2's gathered one included)
        if _autograd.copied_leaf(tensor) is not None:
            return True  # autocast's low-precision copy of a weight: the weight's, not an activation
        return storage_key(tensor) in self._existing

    def entry(self, tensor: torch.Tensor) -> Entry[Owner] | None:
        """The entry of ``tensor``'s storage, None where it was not saved in this step (or was, and was freed: its
        address is now another storage's)."""
        key = storage_key(tensor)
        found = self.entries.get(key)
        if found is not None and found.freed():
            self.retired.append(self.entries.pop(key))
            return None
        return found

    def save(
        self, tensor: torch.Tensor, owner: Owner, where: str = DEVICE, fused: str | None = None
    ) -> Entry[Owner] | None:
        """Charge ``tensor``, saved while ``owner`` ran: its storage once, whole (a new entry, held ``where``), and
        ``owner`` the bytes of its own range not charged before. Its storage's entry, or None for what existed
        before the step, or a meta tensor, which are not charged."""
        if tensor.device.type == "meta" or self.exists(tensor):
            return None
        found = self.entry(tensor)
        if found is None:
            found = Entry[Owner](storage_key(tensor), storage_nbytes(tensor), where, fused)
            found.freed = _autograd.storage_watch(held(tensor))
            self.entries[found.key] = found
        size = charge(found.ranges, *byte_range(held(tensor)))
        if size or not found.own:
            found.events.setdefault(owner, len(self.events))
            found.own[owner] = found.own.get(owner, 0) + size
            self.events.append((owner, size))
        return found

    def _all(self) -> list[Entry[Owner]]:
        return [*self.retired, *self.entries.values()]

    @property
    def total(self) -> int:
        """Bytes of every storage saved, each once and whole."""
        return sum(e.nbytes for e in self._all())

    @property
    def on_device(self) -> int:
        """Of :attr:`total`, the bytes held on the device."""
        return sum(e.nbytes for e in self._all() if e.where == DEVICE)

    @property
    def on_host(self) -> int:
        """Of :attr:`total`, the bytes moved to host memory."""
        return sum(e.nbytes for e in self._all() if e.where == HOST)

    def by_owner(self) -> dict[Owner, dict[Key, int]]:
        """Each owner's share of each storage (:meth:`Entry.shares`): they sum to :attr:`total` exactly."""
        owners: dict[Owner, dict[Key, int]] = {}
        for entry in self._all():
            for owner, share in entry.shares().items():
                mine = owners.setdefault(owner, {})
                mine[entry.key] = mine.get(entry.key, 0) + share
        return owners

    def shares(self) -> dict[Owner, int]:
        """Each owner's bytes, the storages' rests included: they sum to :attr:`total` exactly."""
        return {owner: sum(mine.values()) for owner, mine in self.by_owner().items()}

    def timeline(self) -> list[tuple[Owner, int]]:
        """:attr:`events` with each owner's part of a storage's rest added to its first charge of that storage:
        summed in order, the bytes held as the step went."""
        events = list(self.events)
        for entry in self._all():
            for owner, share in entry.shares().items():
                index = entry.events[owner]
                events[index] = (owner, events[index][1] + share - entry.own[owner])
        return events


_Count = tuple[Callable[[torch.Tensor], None], bool]  # a count and whether it hands on to the counts outside it
_unseen_counts: ContextVar[tuple[_Count, ...]] = ContextVar("memguard_unseen_counts", default=())


@contextmanager
def counting_unseen(count: Callable[[torch.Tensor], None], hand_on: bool = False) -> Iterator[None]:
    """While in it, ``count`` is handed each tensor kept for backward where no saved-tensor hook sees it
    (:func:`kept_unseen`), as its pack hook is handed each tensor autograd saves: a count of a step's saved tensors
    enters it together with its hooks, and charges what it is handed as it charges what they see. As with hooks, the
    innermost count is handed the tensor, and the counts outside it only where it hands on (``hand_on``: the report's
    recorder, whose hooks hand each tensor on to the hooks outside them).

    Example:
        >>> inner, outer = [], []
        >>> with counting_unseen(outer.append), counting_unseen(inner.append, hand_on=True):
        ...     kept_unseen([torch.zeros(2)])
        >>> kept_unseen([torch.zeros(3)])  # no count open: nobody is told
        >>> [t.numel() for t in inner], [t.numel() for t in outer]
        ([2], [2])
    """
    entry = (count, hand_on)
    _unseen_counts.set((*_unseen_counts.get(), entry))
    try:
        yield
    finally:  # this count taken out, whichever others were opened or closed meanwhile
        _unseen_counts.set(tuple(c for c in _unseen_counts.get() if c is not entry))


def counting() -> bool:
    """Whether a count is open (:func:`counting_unseen`): code that keeps tensors past the hooks need only collect
    them then."""
    return bool(_unseen_counts.get())


def kept_unseen(tensors: Iterable[torch.Tensor]) -> None:
    """Hand ``tensors``, kept for backward where no saved-tensor hook sees them (a selective activation checkpoint's
    cache), to the innermost count open (:func:`counting_unseen`) and on outwards while each hands on. Called once, in
    the forward, by the code that keeps them; not in a backward pass, whose recomputation (a checkpoint's) keeps
    nothing the step's count has not had."""
    if _autograd.in_backward():
        return
    tensors = list(tensors)
    for count, hand_on in reversed(_unseen_counts.get()):
        for tensor in tensors:
            count(tensor)
        if not hand_on:
            return
