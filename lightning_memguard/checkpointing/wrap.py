"""Activation checkpointing of whole blocks, with BatchNorm statistics updated once per step."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

Units = str | set[type[nn.Module]] | tuple[type[nn.Module], ...] | Callable[[str, nn.Module], bool]

_AUTO_SUFFIXES = ("Block", "Bottleneck", "EncoderLayer", "DecoderLayer")


_STATS = ("running_mean", "running_var", "num_batches_tracked")


class _FrozenBatchNormStats:
    """During recomputation, BatchNorm updates throw-away copies of its running statistics, not the real ones.

    Training-mode BatchNorm normalises with the batch's own statistics, so the recomputed output is the same; the
    ops and saved tensors are the same too, which the non-reentrant checkpoint checks.
    """

    def __init__(self, unit: nn.Module) -> None:
        self._bns = [
            m for m in unit.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats
        ]
        self._real: list[list[torch.Tensor | None]] = []

    def __enter__(self) -> None:
        self._real = []
        for bn in self._bns:
            real = [getattr(bn, name) for name in _STATS]
            self._real.append(real)
            for name, buf in zip(_STATS, real, strict=True):
                if buf is not None:
                    setattr(bn, name, buf.clone())

    def __exit__(self, *exc: object) -> None:
        for bn, real in zip(self._bns, self._real, strict=True):
            for name, buf in zip(_STATS, real, strict=True):
                if buf is not None:
                    setattr(bn, name, buf)
        self._real = []


class CheckpointedUnit(nn.Module):
    """Mixin placed in front of a block's own class: its forward runs under ``torch.utils.checkpoint``.

    The block keeps its attributes and parameter names, so ``state_dict`` keys do not change.
    """

    memguard_bn_correct: bool = True

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return super().forward(*args, **kwargs)
        if self.memguard_bn_correct:
            return checkpoint(
                super().forward,
                *args,
                use_reentrant=False,
                context_fn=lambda: (contextlib.nullcontext(), _FrozenBatchNormStats(self)),
                **kwargs,
            )
        return checkpoint(super().forward, *args, use_reentrant=False, **kwargs)


_SUBCLASSES: dict[type, type] = {}


def _checkpointed_class(cls: type[nn.Module]) -> type:
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        name = f"Checkpointed{cls.__name__}"
        sub = type(name, (CheckpointedUnit, cls), {"__module__": __name__, "__qualname__": name})
        sub._memguard_original = cls  # type: ignore[attr-defined]
        _SUBCLASSES[cls] = sub
        globals().setdefault(name, sub)  # lets pickle find it by name in this process
    return sub


def is_checkpointed(module: nn.Module) -> bool:
    return isinstance(module, CheckpointedUnit)


_FOREIGN_WRAPPERS = ("CheckpointWrapper", "ActivationWrapper", "OffloadWrapper")


def _wrapped_by_someone_else(module: nn.Module) -> bool:
    return "forward" in module.__dict__ or type(module).__name__ in _FOREIGN_WRAPPERS


def _matches(units: Units, name: str, module: nn.Module) -> bool:
    if units == "auto":
        cls = type(module)
        base = getattr(cls, "_memguard_original", cls)
        return base.__name__.endswith(_AUTO_SUFFIXES) and not isinstance(module, nn.ModuleList | nn.Sequential)
    if isinstance(units, set | tuple):
        return isinstance(module, tuple(units))
    if callable(units):
        return bool(units(name, module))
    raise TypeError(
        f"`units` must be 'auto', a set of module classes or a callable (name, module) -> bool, got {units!r}"
    )


def find_units(model: nn.Module, units: Units = "auto") -> list[tuple[str, nn.Module]]:
    """The outermost submodules that ``units`` selects, in forward order of registration.

    Raises:
        TypeError: if ``units`` is of the wrong kind.
        ValueError: if nothing in the model matches.
    """
    if isinstance(units, str) and units != "auto":
        raise ValueError(f"`units` must be 'auto', a set of module classes or a callable, got {units!r}")
    found: list[tuple[str, nn.Module]] = []
    skip_prefixes: list[str] = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(p) for p in skip_prefixes):
            continue
        if type(module).__name__ in _FOREIGN_WRAPPERS or _matches(units, name, module):
            found.append((name, module))
            skip_prefixes.append(name + ".")
    if not found:
        raise ValueError(
            f"no blocks to checkpoint found in {type(model).__name__} with units={units!r}; pass `units` as a set of"
            " module classes or a predicate on (name, module)"
        )
    return found


def apply_checkpointing(units: list[tuple[str, nn.Module]], bn_correct: bool = True) -> list[str]:
    """Checkpoint the given blocks in place; return the names of the blocks changed.

    Blocks already checkpointed by this library are left as they are (with a warning); blocks that something else
    already wraps are left alone (with a warning).
    """
    changed, ours, theirs = [], [], []
    for name, module in units:
        if is_checkpointed(module):
            ours.append(name)
            continue
        if _wrapped_by_someone_else(module):
            theirs.append(name)
            continue
        module.__class__ = _checkpointed_class(type(module))
        module.memguard_bn_correct = bn_correct  # type: ignore[assignment]
        changed.append(name)
    if ours:
        warnings.warn(
            f"{len(ours)} block(s) are already checkpointed ({ours[0]}, ...); applying twice changes nothing",
            UserWarning,
            stacklevel=3,
        )
    if theirs:
        warnings.warn(
            f"{len(theirs)} block(s) are already wrapped by other code ({theirs[0]}, ...) and are left alone",
            UserWarning,
            stacklevel=3,
        )
    return changed


def remove_checkpointing(model: nn.Module) -> int:
    """Undo :func:`apply_checkpointing` everywhere in ``model``; return how many blocks were restored."""
    count = 0
    for module in model.modules():
        if is_checkpointed(module):
            module.__class__ = type(module)._memguard_original  # type: ignore[attr-defined]
            module.__dict__.pop("memguard_bn_correct", None)
            count += 1
    return count


@contextlib.contextmanager
def preserved_state(model: nn.Module) -> Iterator[None]:
    """Restore buffers (BatchNorm statistics) and gradients after profiling runs, bit for bit."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    grads = {name: (p.grad.detach().clone() if p.grad is not None else None) for name, p in model.named_parameters()}
    try:
        yield
    finally:
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])
            for name, p in model.named_parameters():
                p.grad = grads.get(name)
