"""The samples in a training batch, loader by loader: one reading for MemGuard's throughput and the tuners' trials.

Several train loaders may make one batch together (a ``CombinedLoader``, or a dict or list of loaders): each
loader's part sits at a path in the batch, and a loader that has run out (``mode="max_size"``) gives None there.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch.utilities.data import extract_batch_size

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
