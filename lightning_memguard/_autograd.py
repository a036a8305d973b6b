"""What this library reads from autograd's internals, in one place: private attributes of autograd's nodes and
tensors, and the saved-tensor hooks in force, which torch offers no public way to read.

- :func:`batch_norm_saved_statistics`: the batch mean and inverse deviation a training-mode BatchNorm's backward
  node saved (``_saved_result1``, ``_saved_result2``): the rebuild recomputes BatchNorm's output from them instead of
  keeping it.
- :func:`saved_input`: the input the node that made a tensor saved (``_saved_input``): a BatchNorm's, which the
  rebuild of a ResNet stem's ReLU recomputes from.
- :func:`saved_tensors_hooks_in_force`: the saved-tensor hooks around the code now running
  (``torch._C._autograd._top_saved_tensors_default_hooks``), which a block's own hooks hand on to (:func:`hooks_around`,
  :func:`hand_on`, :func:`handed_back`: the rebuild's recipes, the memory report's recorder, the offload lever);
  :func:`checkpoint_hook`: whether a pack hook is ``torch.utils.checkpoint``'s own (inside a checkpoint nothing is
  kept anyway).
- :func:`version`: a tensor's version counter (``_version``), which in-place changes move: a recipe holds only
  while its tensor is unchanged, and the offload lever tells a saved tensor it holds from one changed since.
- :func:`view_root`: the tensor a view was made from (``_base``): the spill emulator counts storage, not views, and
  the offload lever finds the autocast copy of a weight behind a view of it.
- :func:`storage_watch`: whether a tensor's storage has been freed since, asked without keeping it alive (a weak
  reference to the storage, ``StorageWeakRef``): the ledger of saved tensors tells a freed storage from a new one
  that the allocator gave its address.
- :func:`copied_leaf`: the leaf a tensor is a dtype copy of, through views (its nodes' ``variable``): autocast's
  low-precision copy of a weight, which the memory report counts as a weight, not an activation.
- :func:`in_backward`: whether code runs inside a backward pass (``torch._C._current_graph_task_id``): a forward run
  again there is a checkpoint's recomputation, whose graph backward never runs through.
- :func:`at_backward_end`: a call queued to run once the backward pass now running is done
  (``Variable._execution_engine.queue_callback``, as FSDP and DDP queue theirs), in the order queued.
- :func:`flatten`, :func:`unflatten`: a structure of containers (lists, tuples, dicts, named tuples, ``OrderedDict``,
  any type registered with PyTorch's pytree, such as Hugging Face's ``ModelOutput``) as its leaves and a description,
  and made anew around leaves (``torch.utils._pytree``): a checkpointed block's arguments, every tensor among them an
  argument of the checkpoint.
- :func:`record_memory_history`, :func:`dump_memory_snapshot`: the CUDA allocator's history, recorded and written
  for PyTorch's memory viewer (``torch.cuda.memory._record_memory_history``, ``_dump_snapshot``): MemGuard's
  ``record_memory=True`` and its reports' snapshot.
- :func:`kept`: what a saved-tensor pack hook returns to keep a tensor as autograd would, without the cycle that
  returning the tensor itself makes (a failed step's graph would stay alive).
- :func:`selectively_saved`: the tensors a selective activation checkpoint's forward mode cached for backward (its
  ``storage``, each entry a ``_VersionWrapper`` holding ``val``): what pointwise recomputation keeps of a block,
  which no saved-tensor hook sees (torch 2.14 routes them through the hooks only when asked,
  ``respect_saved_tensors_hooks=True``, which the lever does not ask), handed to the ledger of saved tensors;
  :func:`selectively_saved_changed`: whether one of them was changed in place since it was cached
  (``_VersionWrapper.version``), which torch's selective checkpoint refuses in backward.

A torch release that renames one of them breaks here and nowhere else; where a node's attribute or the hooks'
reader is missing, the functions answer None (nothing saved, no hooks), so the rebuild keeps the tensor as autograd
would.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree

_CHECKPOINT_MODULE = "torch.utils.checkpoint"


def batch_norm_saved_statistics(output: torch.Tensor) -> tuple[Any, Any]:
    """What the node that made ``output`` saved as its first and second results (``_saved_result1``,
    ``_saved_result2``): for training-mode BatchNorm, the batch mean and inverse deviation; None where it saved
    none."""
    node = output.grad_fn
    return getattr(node, "_saved_result1", None), getattr(node, "_saved_result2", None)


def saved_input(output: Any) -> Any:
    """The input the node that made ``output`` saved for its backward (``_saved_input``), None where it saved none."""
    return getattr(output.grad_fn, "_saved_input", None)


Hooks = tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]
"""A pack hook and its unpack hook."""


def saved_tensors_hooks_in_force() -> Hooks | None:
    """The innermost saved-tensor hooks in force (pack, unpack), None if there are none."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else None


def hooks_around() -> tuple[bool, Hooks | None]:
    """Whether a block's own saved-tensor hooks may keep anything here (not inside a checkpoint, whose forward and
    recomputation keep nothing anyway), and the hooks in force around them, to hand on to (:func:`hand_on`)."""
    outer = saved_tensors_hooks_in_force()
    return outer is None or not checkpoint_hook(outer[0]), outer


class HandedOn:
    """A tensor a block's own hooks did not keep themselves, packed by the hooks in force around them; its
    ``unpack()`` is theirs."""

    __slots__ = ("_unpack", "packed")

    def __init__(self, packed: Any, unpack: Callable[[Any], torch.Tensor]) -> None:
        self.packed, self._unpack = packed, unpack

    def unpack(self) -> torch.Tensor:
        return self._unpack(self.packed)


def hand_on(tensor: torch.Tensor, outer: Hooks | None) -> Any:
    """``tensor`` as the hooks around a block's own would save it: packed by ``outer`` (a :class:`HandedOn`, that
    :func:`handed_back` unpacks), or kept as autograd keeps it where there are none. So the counts and movers of
    saved tensors outside (the planner's measurement, the memory report, the spill emulator) see what the block's
    hooks leave as they would see it without them."""
    return kept(tensor) if outer is None else HandedOn(outer[0](tensor), outer[1])


def handed_back(saved: Any) -> torch.Tensor:
    """What :func:`hand_on` saved, as a tensor again."""
    return saved.unpack() if isinstance(saved, HandedOn) else saved


def checkpoint_hook(pack: Any) -> bool:
    """Whether a pack hook is ``torch.utils.checkpoint``'s own (forward or recomputation), on any torch version
    (marked ``_checkpoint_internal``, or defined in that module)."""
    return bool(getattr(pack, "_checkpoint_internal", False)) or getattr(pack, "__module__", "") == _CHECKPOINT_MODULE


def version(tensor: torch.Tensor) -> int:
    """``tensor``'s version counter (``_version``): every in-place change moves it."""
    return tensor._version


def view_root(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor ``tensor`` is a view of (``_base``), or ``tensor`` itself."""
    base = tensor._base
    return base if base is not None else tensor


def storage_watch(tensor: torch.Tensor) -> Callable[[], bool]:
    """A call that answers whether ``tensor``'s storage has been freed since, holding only a weak reference to it
    (``torch.multiprocessing.reductions.StorageWeakRef``, as torch's own compiler tells storages apart).

    Example:
        >>> x = torch.zeros(4)
        >>> freed = storage_watch(x[1:])
        >>> before = freed()
        >>> del x
        >>> before, freed()
        (False, True)
    """
    ref = StorageWeakRef(tensor.untyped_storage())
    return ref.expired


_VIEWS_AND_COPIES = frozenset(
    {
        "ToCopyBackward0", "TBackward0", "ViewBackward0", "UnsafeViewBackward0", "TransposeBackward0",
        "PermuteBackward0", "ExpandBackward0", "UnsqueezeBackward0", "SqueezeBackward0", "SqueezeBackward1",
        "AliasBackward0",
    }
)  # fmt: skip


def copied_leaf(tensor: torch.Tensor) -> torch.Tensor | None:
    """The leaf tensor (a parameter) that ``tensor`` is a dtype copy of, through views only (autocast's copy of a
    weight, transposed for a matmul), or None: a tensor computed from anything else, or a view without a copy.

    Example:
        >>> weight = torch.nn.Parameter(torch.ones(2, 3))
        >>> copied_leaf(weight.to(torch.bfloat16).t()) is weight, copied_leaf(weight.t()), copied_leaf(weight * 2)
        (True, None, None)
    """
    node, copied = tensor.grad_fn, False
    for _ in range(16):
        if node is None:
            return None
        name = type(node).__name__
        if name == "AccumulateGrad":
            leaf = getattr(node, "variable", None)
            return leaf if copied and isinstance(leaf, torch.Tensor) else None
        if name not in _VIEWS_AND_COPIES:
            return None
        copied = copied or name == "ToCopyBackward0"
        inputs = [n for n, _ in node.next_functions if n is not None]
        if len(inputs) != 1:
            return None
        node = inputs[0]
    return None


def in_backward() -> bool:
    """Whether the code now running is inside a backward pass (a checkpoint's recomputation, a backward hook)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def at_backward_end(fn: Callable[[], None]) -> None:
    """Queue ``fn`` to run when the backward pass now running ends, after the callbacks queued before it."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)  # type: ignore[attr-defined]


def record_memory_history(max_entries: int | None) -> None:
    """Record the CUDA allocator's history (its latest ``max_entries`` events, with stack traces), or stop with
    None (``torch.cuda.memory._record_memory_history``: private, the source of PyTorch's memory viewer)."""
    if max_entries is None:
        torch.cuda.memory._record_memory_history(enabled=None)
    else:
        torch.cuda.memory._record_memory_history(max_entries=max_entries)


def dump_memory_snapshot(path: str) -> None:
    """Write the allocator's recorded history to ``path``, a pickle that https://pytorch.org/memory_viz opens
    (``torch.cuda.memory._dump_snapshot``)."""
    torch.cuda.memory._dump_snapshot(path)


def flatten(structure: Any) -> tuple[list[Any], Any]:
    """``structure``'s leaves, in order, and what rebuilds it around them (:func:`unflatten`)."""
    return _pytree.tree_flatten(structure)


def unflatten(leaves: list[Any], description: Any) -> Any:
    """The structure :func:`flatten` described, made anew around ``leaves`` (new containers)."""
    return _pytree.tree_unflatten(leaves, description)


def kept(tensor: torch.Tensor) -> torch.Tensor:
    """What a saved-tensor pack hook returns to keep ``tensor`` as autograd would: an alias of it with no autograd
    history (``detach()``: the same storage and version counter). Returned as it is, an op's output saved for the
    op's own backward closes a cycle (the tensor, its node, the node's saved copy: the tensor) that Python's collector
    does not see and only backward breaks: a step that raised before its backward (an out-of-memory error, a block
    refused) kept its whole graph alive, one step's activations lost per failure."""
    return tensor.detach()


def _cached_entries(caching_mode: Any) -> list[Any]:
    """The entries ``caching_mode`` (the first of ``create_selective_checkpoint_contexts``'s pair) holds: its
    ``storage`` maps each op to its calls' entries (a list before torch 2.12, a dict by call after), each output
    wrapped with its version at caching (``_VersionWrapper``: ``val``, ``version``), or a marker for a call
    recomputed. Empty where the mode has no storage."""
    storage = getattr(caching_mode, "storage", None) or {}
    found: list[Any] = []
    for calls in storage.values():
        entries = calls.values() if isinstance(calls, dict) else calls
        for entry in entries:
            found += [
                leaf for leaf in _pytree.tree_leaves(entry) if isinstance(getattr(leaf, "val", None), torch.Tensor)
            ]
    return found


def selectively_saved(caching_mode: Any) -> list[torch.Tensor]:
    """The tensors ``caching_mode`` cached for backward (:func:`_cached_entries`)."""
    return [entry.val for entry in _cached_entries(caching_mode)]


def selectively_saved_changed(caching_mode: Any) -> bool:
    """Whether a tensor ``caching_mode`` cached has been changed in place since (its version moved): torch's
    selective checkpoint refuses it when backward recomputes, and a backward that raises there with saved-tensor hooks
    in force leaves its graph alive (torch 2.11 to 2.14), so the lever asks at the end of the block's forward."""
    return any(
        getattr(entry, "version", None) is not None and entry.val._version != entry.version
        for entry in _cached_entries(caching_mode)
    )
