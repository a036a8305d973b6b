"""The samples in a training batch, loader by loader: one reading for MemGuard's throughput and the tuners' trials.

Several train loaders may make one batch together (a ``CombinedLoader``, or a dict or list of loaders): each
loader's part sits at a path in the batch, and a loader that has run out (``mode="max_size"``) gives None there.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from lightning.pytorch.utilities.data import extract_batch_size
from lightning_utilities.core.apply_func import apply_to_collection

from lightning_memguard.checkpointing.measure import example_arguments

_SEQUENCES = (list, tuple)  # batches whose first element is sized directly

Path = tuple[Any, ...]


def loader_paths(iterables: Any) -> list[Path] | None:
    """Where each loader's batch sits in a training batch when several loaders make one, as a ``CombinedLoader``
    (or a dict or list of loaders) nests them; None for a single loader, whose batch is the whole batch.
    ``iterables``: ``trainer.train_dataloader``."""
    paths: list[Path] = []

    def walk(node: Any, path: Path) -> None:
        if isinstance(node, Mapping):
            for key, child in node.items():
                walk(child, (*path, key))
        elif isinstance(node, list | tuple) and node and not all(isinstance(c, int | float | str) for c in node):
            for i, child in enumerate(node):
                walk(child, (*path, i))
        else:
            paths.append(path)

    walk(iterables, ())
    return paths if paths and paths != [()] else None


def loader_parts(batch: Any, paths: list[Path] | None) -> list[Any]:
    """Each loader's part of ``batch`` (the batch itself for a single loader)."""
    if paths is None:
        return [batch]
    parts = []
    for path in paths:
        part = batch
        for key in path:
            part = part[key]
        parts.append(part)
    return parts


def samples_in(part: Any) -> int | None:
    """Samples in one loader's part of a batch: 0 for a loader that has run out (None); None when it cannot be
    sized. The common batches, (inputs, targets) or a tensor, are sized without Lightning's general traversal: this
    runs every step."""
    if part is None:
        return 0
    first = part[0] if part.__class__ in _SEQUENCES and part else part
    if first.__class__ is torch.Tensor:
        shape = first.shape
        if shape:
            return shape[0]
    try:
        return extract_batch_size(part)
    except Exception:  # Lightning's own error, or a batch whose traversal fails
        return None


def loader_name(path: Path) -> str:
    """A loader as a message names it: its key (``'b'``), or its path among nested loaders (``'nested'[0]``)."""
    head, *rest = path
    return repr(head) + "".join(f"[{key!r}]" for key in rest)


def inputs_from_batch(batch: Any, forward: Callable[..., Any]) -> tuple[Any, str]:
    """The model's inputs in a training batch, where a budget has no ``example_input_array`` to measure on, and
    what they are (for the line that says so). Nothing says in general which part of a batch the model takes; the
    rule, for the batches Lightning's users write:

    - a tensor is the input: ``forward(batch)``;
    - a tuple or list ``(x, y, ...)``: its first element ``x``, read as an ``example_input_array`` is (a tensor:
      ``forward(x)``; a tuple or list: ``forward(*x)``; a dict: as below);
    - a dict: the entries ``forward`` names as parameters, as keywords (a Hugging Face batch's ``input_ids`` and
      ``attention_mask``, without its ``labels`` where ``forward`` takes none); every entry where it takes
      ``**kwargs``.

    The inputs must bind to ``forward``'s signature (every parameter without a default given).

    Raises:
        ValueError: a batch of another kind (a custom object), an empty one, a dict none of whose keys ``forward``
            takes, or inputs that do not bind; the message says which.

    Example:
        >>> def forward(input_ids, attention_mask=None):
        ...     pass
        >>> batch = {"input_ids": torch.zeros(8, 16), "labels": torch.zeros(8)}
        >>> inputs, what = inputs_from_batch(batch, forward)
        >>> sorted(inputs), what
        (['input_ids'], "entries 'input_ids' (keywords of forward)")
        >>> inputs_from_batch((torch.zeros(8, 3), torch.zeros(8)), forward)[1]
        'first element (a tensor of shape [8, 3])'
    """
    inputs: Any
    if torch.is_tensor(batch):
        inputs, what = batch, f"tensor of shape {list(batch.shape)}"
    elif isinstance(batch, Mapping):
        inputs = _taken_by(forward, batch)
        what = f"entries {', '.join(repr(k) for k in inputs)} (keywords of forward)"
    elif isinstance(batch, list | tuple) and batch:
        inputs = batch[0]
        if torch.is_tensor(inputs):
            what = f"first element (a tensor of shape {list(inputs.shape)})"
        elif isinstance(inputs, Mapping):
            inputs = _taken_by(forward, inputs)
            what = f"first element's entries {', '.join(repr(k) for k in inputs)} (keywords of forward)"
        elif isinstance(inputs, list | tuple):
            what = f"first element ({len(inputs)} positional arguments of forward)"
        else:
            raise ValueError(f"its first element is a {type(inputs).__name__}, not a tensor, a tuple or a dict")
    else:
        raise ValueError(f"it is {'an empty' if isinstance(batch, list | tuple) else 'a'} {type(batch).__name__}")
    args, kwargs = example_arguments(inputs)
    try:
        inspect.signature(forward).bind(*args, **kwargs)
    except TypeError as err:
        raise ValueError(f"forward does not take its {what}: {err}") from None
    except ValueError:  # no signature to read (a builtin): the measurement tells
        pass
    return inputs, what


def _taken_by(forward: Callable[..., Any], batch: Mapping[Any, Any]) -> dict[str, Any]:
    """The entries of ``batch`` that ``forward`` takes as keywords (every one where it takes ``**kwargs``)."""
    try:
        parameters = inspect.signature(forward).parameters
    except ValueError:
        parameters = {}  # type: ignore[assignment]
    keywords = {inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        taken = {str(k): v for k, v in batch.items()}
    else:
        taken = {k: v for k, v in batch.items() if k in parameters and parameters[k].kind in keywords}
    if not taken:
        raise ValueError(f"forward takes none of its keys {sorted(map(str, batch))}")
    return taken


# ------------------------------------------------------------------ a batch split into micro-batches, outputs joined


def tensors_in(batch: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    apply_to_collection(batch, torch.Tensor, found.append)
    return found


def split_batch(batch: Any, samples: int, chunks: int) -> list[tuple[Any, int]]:
    """``batch`` cut into ``chunks`` near-equal micro-batches, each with its samples: see :func:`take_samples` for
    what is cut and what every micro-batch gets whole.

    Example:
        >>> x, y = torch.arange(10).reshape(5, 2), torch.arange(5)
        >>> [(tuple(part[0].shape), n) for part, n in split_batch((x, y), 5, 2)]
        [((2, 2), 2), ((3, 2), 3)]
        >>> [part[2] for part, _ in split_batch((x, y, ["a", "b", "c", "d", "e"]), 5, 2)]
        [['a', 'b'], ['c', 'd', 'e']]
    """
    chunks = min(chunks, samples)
    bounds = [round(i * samples / chunks) for i in range(chunks + 1)]
    return [(take_samples(batch, samples, bounds[i], bounds[i + 1]), bounds[i + 1] - bounds[i]) for i in range(chunks)]


def take_samples(batch: Any, samples: int, start: int, stop: int) -> Any:
    """The samples ``start:stop`` of a batch of ``samples``: the rows of every tensor whose first dimension holds
    ``samples``, and the items of every list or tuple of ``samples`` items that is not a record of batched fields
    (a default collate's list of names, a tuple of per-image targets; a namedtuple is always a record); dicts,
    namedtuples, dataclasses and other lists and tuples are taken field by field, as Lightning moves a batch to its
    device. Everything else (a tensor or list of another length, a string, a number) is the same in every part.

    Example:
        >>> batch = {"x": torch.zeros(4, 3), "names": ["a", "b", "c", "d"], "vocab": ["a", "b"], "split": "train"}
        >>> part = take_samples(batch, 4, 1, 3)
        >>> tuple(part["x"].shape), part["names"], part["vocab"], part["split"]
        ((2, 3), ['b', 'c'], ['a', 'b'], 'train')
    """

    def cut(item: Any) -> Any:
        if isinstance(item, torch.Tensor):
            return item[start:stop] if item.dim() > 0 and item.shape[0] == samples else item
        if per_sample_sequence(item, samples):
            return item[start:stop]
        taken = [take_samples(child, samples, start, stop) for child in item]
        return type(item)(*taken) if is_namedtuple(item) else type(item)(taken)

    return apply_to_collection(batch, (torch.Tensor, list, tuple), cut)


def per_sample_sequence(item: Any, samples: int) -> bool:
    """Whether ``item`` is a list or tuple of one entry per sample: ``samples`` long, not a namedtuple, and holding
    no tensor batched along its first dimension (``(inputs, targets)`` of a batch of two is a record, not samples)."""
    return (
        isinstance(item, list | tuple)
        and not is_namedtuple(item)
        and len(item) == samples
        and not any(t.dim() > 0 and t.shape[0] == samples for t in tensors_in(item))
    )


def is_namedtuple(item: Any) -> bool:
    return isinstance(item, tuple) and hasattr(item, "_fields")
