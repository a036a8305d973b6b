"""How the rebuild makes and keeps a tensor it did not save: :class:`RebuildConfig`, the recipes, and the saved-tensor
hooks that save a recipe in a tensor's place.

A recipe (:class:`Recipe`) rebuilds ``relu(batch_norm(source) + identity)`` from a BatchNorm's input and the batch's
mean and inverse deviation (what training-mode BatchNorm saved anyway); :class:`Activated` rebuilds an activation's
output from the recipe of its input. Each is built once, when backward first unpacks it, and let go after its last
saved copy is unpacked. On CUDA a recipe is one pass of a Triton kernel (:mod:`._fused`) where it can run; elsewhere
PyTorch's own kernels, two or three passes (on the CPU training-mode BatchNorm on the same input again, which gives
the same bits). Which live tensors have recipes is kept beside the model, weakly, with each tensor's version
(:func:`register`): a tensor changed in place since is kept as it is. The mixins that save recipes are
:mod:`.rebuild`'s.
"""

from __future__ import annotations

import numbers
import operator
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_memguard import _autograd, _compiler
from lightning_memguard.checkpointing import _fused
from lightning_memguard.core.checks import check_instance


@dataclass(frozen=True)
class RebuildConfig:
    """How rebuilt tensors are made; passed to ``rebuild_bn_relu`` (or ``checkpoint_blocks(rebuild_config=...)``)
    and carried by each rebuilt module.

    Args:
        fused: rebuild with one Triton kernel pass where it can run (CUDA); False: always with PyTorch's own kernels.
        chain_kept: when backward first needs a block's output, the stage's earlier outputs it is built from are
            built too: this many of them (the nearest) are kept for their own use soon after; the others are let go
            and built again when needed. Fewer: less memory early in a stage's backward, more passes.

    Raises:
        TypeError: ``fused`` not a bool, ``chain_kept`` not an int.
        ValueError: ``chain_kept`` below 0.

    Example:
        >>> RebuildConfig(chain_kept=-1)
        Traceback (most recent call last):
        ...
        ValueError: `chain_kept` must be at least 0, got -1
    """

    fused: bool = True
    chain_kept: int = 2

    def __post_init__(self) -> None:
        if not isinstance(self.fused, bool):
            raise TypeError(f"`fused` must be a bool, got {self.fused!r}")
        if not isinstance(self.chain_kept, numbers.Integral) or isinstance(self.chain_kept, bool):
            raise TypeError(f"`chain_kept` must be an int, got {self.chain_kept!r}")
        if self.chain_kept < 0:
            raise ValueError(f"`chain_kept` must be at least 0, got {self.chain_kept!r}")
        object.__setattr__(self, "chain_kept", operator.index(self.chain_kept))  # np.int64(2) is kept as 2


DEFAULT_CONFIG = RebuildConfig()


def check_config(config: Any) -> RebuildConfig:
    """``rebuild_config`` as the public functions take it: a :class:`RebuildConfig`, or None for the default."""
    if config is None:
        return DEFAULT_CONFIG
    return check_instance("rebuild_config", config, RebuildConfig, "be a RebuildConfig or None")


class Recipe:
    """How to rebuild one tensor: ``batch_norm(source)`` with the batch's own statistics, plus ``identity`` (a
    tensor, or another recipe) where there is one, then a ReLU.

    Built when backward first unpacks it, kept until every saved copy (``packed``) has been unpacked, then let go.
    A recipe another one needs as its identity is built then, and kept the same way if it is one of the
    ``config.chain_kept`` nearest in the chain (else built again when unpacked); one nothing saved is never kept.
    """

    __slots__ = ("source", "bn", "mean", "invstd", "identity", "relu", "config", "packed", "unpacked", "rebuilt")

    def __init__(
        self,
        source: torch.Tensor,
        bn: nn.BatchNorm2d,
        mean: torch.Tensor,
        invstd: torch.Tensor,
        identity: torch.Tensor | Recipe | None = None,
        relu: bool = True,
        config: RebuildConfig = DEFAULT_CONFIG,
    ) -> None:
        self.source, self.bn, self.mean, self.invstd = source, bn, mean, invstd
        self.identity, self.relu, self.config = identity, relu, config
        self.packed = 0
        self.unpacked = 0
        self.rebuilt: torch.Tensor | None = None

    def _args(self) -> _fused.BatchNormArgs | None:
        weight, bias = self.bn.weight, self.bn.bias
        if not isinstance(weight, torch.Tensor) or not isinstance(bias, torch.Tensor):
            return None
        return (self.source, self.mean, self.invstd, weight.detach(), bias.detach())

    def _eager(self, identity: torch.Tensor | None) -> torch.Tensor:
        bn = self.bn
        if self.source.device.type == "cpu":
            # training mode again on the same input: the same statistics, and the forward pass's output bit for bit
            # (in eval mode a variance that gives back the saved inverse deviation does not always exist)
            out = torch.native_batch_norm(self.source, bn.weight, bn.bias, None, None, True, 0.0, bn.eps)[0]
        else:
            var = self.invstd.float().pow(-2) - bn.eps  # the batch's variance, from what BatchNorm saved
            cudnn = torch.backends.cudnn.enabled
            out = torch.batch_norm(self.source, bn.weight, bn.bias, self.mean.float(), var, False, 0.0, bn.eps, cudnn)
        if identity is not None:
            out.add_(identity)
        return out.relu_() if self.relu else out

    def _build(self, depth: int) -> torch.Tensor:
        identity = self.identity
        own = self._args() if self.config.fused else None  # the kernel's path, where it can run (fused() says)
        if own is not None and isinstance(identity, Recipe) and identity.packed == 0 and identity.rebuilt is None:
            second = identity._args() if identity.identity is None and not identity.relu else None
            out = _fused.fused(own, second, self.relu) if second is not None else None  # both BatchNorms, one pass
            if out is not None:
                return out
        value = identity.value(depth + 1) if isinstance(identity, Recipe) else identity
        out = _fused.fused(own, value, self.relu) if own is not None else None
        return out if out is not None else self._eager(value)

    def value(self, depth: int = 0) -> torch.Tensor:
        """The rebuilt tensor, kept while saved copies of it are still to be unpacked; ``depth``: how many recipes
        up the chain asked for it (0: unpacked itself), past ``config.chain_kept`` it is not kept."""
        out = self.rebuilt
        if out is None:
            out = self._build(depth)
            if self.unpacked < self.packed and depth <= self.config.chain_kept:
                self.rebuilt = out
        return out

    def rebuild(self) -> torch.Tensor:
        """Unpack one saved copy."""
        out = self.value()
        self.unpacked += 1
        if self.unpacked >= self.packed:  # every saved copy has been used: let it go
            self.rebuilt = None
        return out


class Activated:
    """How to rebuild an activation's output: the activation, with PyTorch's own kernel as in the forward pass,
    applied to ``pre``, the recipe of its input (a BatchNorm output, which the activation saves for its own
    backward). Built when backward first unpacks it (``pre`` is built then too, and kept for the activation's
    backward, which comes soon after), kept until every saved copy has been unpacked, then let go; ``pre``'s
    ``config.chain_kept`` says how far up a chain it is kept, as for a recipe."""

    __slots__ = ("pre", "fn", "packed", "unpacked", "rebuilt")

    def __init__(self, pre: Recipe, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.pre, self.fn = pre, fn
        self.packed = 0
        self.unpacked = 0
        self.rebuilt: torch.Tensor | None = None

    def value(self, depth: int = 0) -> torch.Tensor:
        """The rebuilt tensor, kept while saved copies of it are still to be unpacked."""
        out = self.rebuilt
        if out is None:
            out = self.fn(self.pre.value(depth + 1))
            if self.unpacked < self.packed and depth <= self.pre.config.chain_kept:
                self.rebuilt = out
        return out

    def rebuild(self) -> torch.Tensor:
        """Unpack one saved copy."""
        out = self.value()
        self.unpacked += 1
        if self.unpacked >= self.packed:
            self.rebuilt = None
        return out


_Saved = Recipe | Activated
"""What a tensor is saved as instead of itself."""


def batch_stats(output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The batch mean and inverse deviation that training-mode BatchNorm saved for its backward."""
    mean, invstd = _autograd.batch_norm_saved_statistics(output)
    if isinstance(mean, torch.Tensor) and isinstance(invstd, torch.Tensor) and mean.numel() == output.shape[1]:
        return mean, invstd
    return None


_Outer = _autograd.Hooks | None


def may_rebuild(module: nn.Module) -> tuple[bool, _Outer]:
    """Whether a forward of ``module`` may save recipes (training with gradients, not compiling, not inside a
    checkpoint, which frees everything already), and the saved-tensor hooks around it."""
    if not torch.is_grad_enabled() or not module.training or _compiler.compiling():
        return False, None
    return _autograd.hooks_around()  # the hooks around the block's forward


_RECIPES: dict[int, tuple[weakref.ref[torch.Tensor], _Saved, int | None]] = {}
"""Live tensors that a forward pass saves as recipes, by id: one block's output is saved again by the next. With a
version, only while the tensor has not been changed in place since (its ``_version``)."""


def register(t: torch.Tensor, recipe: _Saved, version: int | None = None) -> None:
    """From now on, ``t`` is saved as ``recipe`` wherever the recipe hooks are in force (with ``version``, only
    while ``t`` keeps it)."""
    key = id(t)

    def forget(ref: weakref.ref[torch.Tensor]) -> None:
        if _RECIPES.get(key, (None,))[0] is ref:
            del _RECIPES[key]

    _RECIPES[key] = (weakref.ref(t, forget), recipe, version)  # no strong reference: the tensor is freed as it would be


def pin(t: torch.Tensor) -> None:
    """From now on, ``t`` is saved as its recipe only while it keeps its current version (nothing changes it)."""
    entry = _RECIPES.get(id(t))
    if entry is not None and entry[0]() is t:
        _RECIPES[id(t)] = (entry[0], entry[1], _autograd.version(t))


def _saved_as(t: Any) -> _Saved | None:
    """The recipe ``t`` is saved as, if it has one (and has not been changed in place since it got it)."""
    entry = _RECIPES.get(id(t))
    tensor = entry[0]() if entry is not None else None
    if entry is None or tensor is None or tensor is not t:
        return None
    if entry[2] is not None and entry[2] != _autograd.version(tensor):
        return None
    return entry[1]


def registered(t: Any) -> Recipe | None:
    """The BatchNorm recipe ``t`` is saved as, if it has one."""
    recipe = _saved_as(t)
    return recipe if isinstance(recipe, Recipe) else None


def recipe_hooks(outer: _Outer) -> _autograd.Hooks:
    """Pack and unpack hooks that save a recipe where a tensor has one, and hand anything else to ``outer``."""

    def pack(t: torch.Tensor) -> Any:
        recipe = _saved_as(t)
        if recipe is not None:
            recipe.packed += 1
            return recipe
        return _autograd.hand_on(t, outer)

    def unpack(saved: Any) -> torch.Tensor:
        if isinstance(saved, Recipe | Activated):
            return saved.rebuild()
        return _autograd.handed_back(saved)

    return pack, unpack


def saving_recipes(outer: _Outer) -> Any:
    """Saved-tensor hooks (a context manager) from :func:`recipe_hooks`."""
    return torch.autograd.graph.saved_tensors_hooks(*recipe_hooks(outer))
