"""Keep convolution outputs, rebuild BatchNorm + ReLU outputs in backward instead of saving them.

In a torchvision Bottleneck, ``relu(bn1(conv1(x)))`` and ``relu(bn2(conv2(.)))`` are kept for backward (by the
ReLU and by the next convolution) although BatchNorm has already saved its input. Here those tensors are saved as
a recipe instead (the BatchNorm input and the batch's mean and inverse deviation) and the ReLU output is rebuilt,
once, when backward first needs it: one element-wise pass instead of a second copy of the tensor, where block
checkpointing re-runs the block's convolutions. The block's output, ``relu(bn3(.) + shortcut)``, kept by its last
ReLU and by the next block, is a recipe too where the next block is rebuilt as well: the shortcut is the block's
input (the block before's rebuilt output, or a tensor kept anyway) or a BatchNorm of it, so a stage's outputs are
rebuilt one after another, each let go after its last use. BatchNorm's running statistics are untouched (the
rebuild never updates them). Gradients match the plain model's bit for bit on the CPU, to rounding on CUDA. A
torchvision ResNet's stem gets the same: the output of its ``relu(bn1(.))``, kept by the ReLU and by the
max-pooling after it, is rebuilt once for both, and the max-pooling's indices are kept as 16-bit integers. timm's
ResNet family (resnet50d, SE-ResNeXt, ResNet-RS, ...: the same conv / BatchNorm / ReLU blocks, with a deep stem or
not) gets all of it too; a block whose last BatchNorm output is changed before the residual sum (by
squeeze-excitation or drop path) keeps its own output. Which modules are a family's blocks, stems, tails and units,
and what runs after a block, the model's map says (:class:`~.model_map.ModelMap`: its adapters' answers); the rebuild
decides which layer types it can rebuild (``nn.BatchNorm2d``, an in-place ``nn.ReLU``; for units also ReLU6, SiLU
and Hardswish).

torchvision's Conv-BN-activation units (``Conv2dNormActivation``: MobileNet, EfficientNet, RegNet) get the same: a
plain unit keeps three tensors of one size, the convolution output (by BatchNorm), the BatchNorm output (by an
activation such as SiLU, Hardswish or ReLU6, which needs its input; an in-place one keeps a copy) and the activation
output (by whatever runs next). Only the first stays; the BatchNorm output is rebuilt from it with the batch's
statistics and the activation output from that, with PyTorch's own activation kernel, each once, when backward
first needs it. The module that runs next on a unit's output where that is not another unit (a convolution, a
SqueezeExcitation) saves it as the recipe too. A tensor changed in place after it got its recipe (a residual
``+=``) is kept as it is.

This module holds the mixins, whose forward saves recipes; the recipes themselves and :class:`~.recipes.RebuildConfig`
are :mod:`.recipes`'s, and which modules get which mixin (as :class:`~.wrap.Swap` records) is
:mod:`.rebuild_targets`'s; :mod:`.surgery` makes every change.

On CUDA each rebuilt BatchNorm (+ ReLU) output is one pass of a Triton kernel (:mod:`._fused`) that computes what
training-mode BatchNorm computed; elsewhere PyTorch's own kernels. Other activations run after it, as PyTorch's own.
Saved-tensor hooks around the model (a profiler, an offloader) still see every other tensor a block saves. Inside a
checkpoint, and under ``torch.compile``, a block runs as usual.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_memguard import _autograd
from lightning_memguard.checkpointing.recipes import (
    Activated,
    RebuildConfig,
    Recipe,
    batch_stats,
    may_rebuild,
    pin,
    recipe_hooks,
    register,
    registered,
    saving_recipes,
)
from lightning_memguard.checkpointing.wrap import SwappedModule


def _remember(bn: nn.BatchNorm2d, inputs: Any, output: torch.Tensor, config: RebuildConfig) -> None:
    """Forward hook of a BatchNorm followed by an in-place ReLU: its output is saved as a recipe."""
    stats = batch_stats(output)
    if stats is not None:
        register(output, Recipe(inputs[0], bn, *stats, config=config))


class RebuildMixin(SwappedModule):
    """Base of the rebuild's mixins: ``remove_rebuild`` takes off every subclass."""


class RebuiltBatchNormReLU(RebuildMixin):
    """Mixin placed in front of a block's class: within its forward, the outputs of ``memguard_bns`` (each followed
    by an in-place ReLU) are saved as recipes, and with ``memguard_tail`` (its last BatchNorm and its shortcut's
    BatchNorm or None) so is the block's output, ``relu(last(.) + shortcut)``; ``memguard_rebuild`` is the
    :class:`RebuildConfig` its recipes follow."""

    memguard_prefix = "RebuiltBNReLU"

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        active, outer = may_rebuild(self)
        if not active:
            return super().forward(*args, **kwargs)
        config = self.__dict__["memguard_rebuild"]
        handles = [bn.register_forward_hook(partial(_remember, config=config)) for bn in self.__dict__["memguard_bns"]]
        tail = self.__dict__.get("memguard_tail")
        if tail is not None and args and isinstance(args[0], torch.Tensor):
            last, shortcut = tail
            handles += self._remember_output(args[0], last, shortcut, config)
        try:
            with saving_recipes(outer):
                return super().forward(*args, **kwargs)
        finally:
            for handle in handles:
                handle.remove()

    @staticmethod
    def _remember_output(
        x: torch.Tensor, last: nn.Module, shortcut: nn.Module | None, config: RebuildConfig
    ) -> list[Any]:
        """Hooks that save the block's output as a recipe: it is the last BatchNorm's output, added to in place and
        made non-negative in place. The shortcut's BatchNorm runs after the last one; until it has, nothing is
        saved as a recipe."""
        pending: list[tuple[torch.Tensor, Recipe]] = []

        def remember_last(bn: nn.BatchNorm2d, inputs: Any, output: torch.Tensor) -> None:
            stats = batch_stats(output)
            if stats is None:
                return
            if shortcut is None:
                identity = registered(x)
                recipe = Recipe(inputs[0], bn, *stats, identity=x if identity is None else identity, config=config)
                register(output, recipe)
            else:
                pending.append((output, Recipe(inputs[0], bn, *stats, config=config)))

        def remember_shortcut(bn: nn.BatchNorm2d, inputs: Any, output: torch.Tensor) -> None:
            stats = batch_stats(output)
            if stats is not None and pending:
                out, recipe = pending.pop()
                recipe.identity = Recipe(inputs[0], bn, *stats, relu=False, config=config)
                register(out, recipe)

        handles = [last.register_forward_hook(remember_last)]
        if shortcut is not None:
            handles.append(shortcut.register_forward_hook(remember_shortcut))
        return handles


class RebuiltStemReLU(RebuildMixin):
    """Mixin for the in-place ReLU of a ResNet's stem (conv1, bn1, relu, maxpool; as the model's adapter names it:
    torchvision's, timm's with its ``act1``): its output, kept by
    the ReLU and by the max-pooling after it, is saved as a recipe (of ``memguard_bn``'s output, following
    ``memguard_rebuild``)."""

    memguard_prefix = "RebuiltStem"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        active, outer = may_rebuild(self)
        stats = batch_stats(x) if active and isinstance(x, torch.Tensor) else None
        source = _autograd.saved_input(x) if stats is not None else None
        if not isinstance(source, torch.Tensor) or not getattr(self, "inplace", False):
            return super().forward(x)
        config = self.__dict__["memguard_rebuild"]
        register(x, Recipe(source, self.__dict__["memguard_bn"], *stats, config=config))  # type: ignore[misc]
        with saving_recipes(outer):
            return super().forward(x)


class _Narrowed:
    """Max-pooling indices kept as 16-bit integers (as packed by the hooks around): each is a position within one
    input plane, which is small."""

    __slots__ = ("indices",)

    def __init__(self, indices: Any) -> None:
        self.indices = indices


class RebuiltStemPool(RebuildMixin):
    """Mixin for the max-pooling of a ResNet's stem: its input is saved as the recipe the stem's ReLU made, and
    the indices of the maxima, positions within an input plane, as 16-bit integers where a plane is small enough
    (a quarter of the 64-bit ones: exact, one cast each way)."""

    memguard_prefix = "RebuiltStem"
    memguard_unit = False  # part of the stem, which its ReLU counts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        active, outer = may_rebuild(self)
        if not active or registered(x) is None:
            return super().forward(x)
        narrow = x.dim() >= 2 and x.shape[-1] * x.shape[-2] <= torch.iinfo(torch.int16).max
        pack, unpack = recipe_hooks(outer)

        def pack_narrowed(t: torch.Tensor) -> Any:
            if narrow and t.dtype == torch.int64:  # the only integer tensor max-pooling saves: its indices
                return _Narrowed(pack(t.to(torch.int16)))  # hooks around the model see the narrow copy
            return pack(t)

        def unpack_narrowed(saved: Any) -> torch.Tensor:
            return unpack(saved.indices).to(torch.int64) if isinstance(saved, _Narrowed) else unpack(saved)

        with torch.autograd.graph.saved_tensors_hooks(pack_narrowed, unpack_narrowed):
            return super().forward(x)


def _relu6(x: torch.Tensor) -> torch.Tensor:
    return F.hardtanh(x, 0.0, 6.0)  # what nn.ReLU6 runs


ACTIVATIONS: dict[type[nn.Module], Callable[[torch.Tensor], torch.Tensor] | None] = {
    nn.ReLU: None,  # in place only: it keeps its output, rebuilt with BatchNorm in one pass like a ResNet's
    nn.ReLU6: _relu6,
    nn.SiLU: F.silu,
    nn.Hardswish: F.hardswish,
}
"""The activations a Conv-BN-activation unit may end in, and how each output is rebuilt from its input."""


@contextlib.contextmanager
def _out_of_place(act: nn.Module) -> Iterator[None]:
    """Run an in-place activation out of place for one call (the same values): it then keeps its input, the
    BatchNorm output, instead of a copy made before overwriting it. Only the activation's own ``inplace`` flag
    changes, and back when the call ends; nothing is put on it."""
    inplace = vars(act).get("inplace") is True
    if inplace:
        vars(act)["inplace"] = False
    try:
        yield
    finally:
        if inplace:
            vars(act)["inplace"] = True


class RebuiltConvNormActivation(RebuildMixin):
    """Mixin for a convolution-norm-activation unit whose children are its convolution, BatchNorm and activation, run
    one after another (torchvision's Conv2dNormActivation; see :func:`.rebuild_targets.unit_parts`). Of the three
    tensors of one size that a plain unit keeps for backward, the convolution output (kept by BatchNorm) stays; the
    BatchNorm output (kept by the activation) and the activation output (kept by whatever runs next on it: the next
    unit, a convolution or SqueezeExcitation marked :class:`TakesRecipes`) are saved as recipes and rebuilt in backward
    from it and the batch's statistics, each once, when first needed. A ReLU keeps only its output: it is rebuilt with
    BatchNorm in one pass, as in a ResNet. ``memguard_rebuild`` is the :class:`~.recipes.RebuildConfig` its recipes
    follow."""

    memguard_prefix = "RebuiltCNA"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        active, outer = may_rebuild(self)
        if not active:
            return super().forward(x)  # type: ignore[no-any-return]
        # the layers rebuild_targets.unit_parts checked when the mixin was given (unit_swaps): conv, BatchNorm, the
        # activation if any
        layers: list[Any] = list(self._modules.values())
        conv, bn, act = layers[0], layers[1], layers[2] if len(layers) == 3 else None
        config = self.__dict__["memguard_rebuild"]
        with saving_recipes(outer):
            source = conv(x)  # what BatchNorm keeps for its backward
            out = bn(source)
            stats = batch_stats(out) if bn.training and isinstance(out, torch.Tensor) else None
            if stats is None:
                return out if act is None else act(out)  # type: ignore[no-any-return]
            if act is None:
                register(out, Recipe(source, bn, *stats, relu=False, config=config), _autograd.version(out))
                return out  # type: ignore[no-any-return]
            rebuild = ACTIVATIONS[type(act)]
            if rebuild is None:  # an in-place ReLU, which keeps what it overwrites the BatchNorm output with
                register(out, Recipe(source, bn, *stats, config=config))
                activated = act(out)
                pin(out)
                return activated  # type: ignore[no-any-return]
            pre = Recipe(source, bn, *stats, relu=False, config=config)
            register(out, pre, _autograd.version(out))
            with _out_of_place(act):
                activated = act(out)
            register(activated, Activated(pre, rebuild), _autograd.version(activated))
            return activated  # type: ignore[no-any-return]


class TakesRecipes(RebuildMixin):
    """Mixin for the module that runs next on a rebuilt unit's output where that is not a rebuilt unit itself (a
    convolution, a SqueezeExcitation): within its forward, what it keeps of that output is saved as the unit's
    recipe. Anything it keeps that was changed in place since is kept as it is. Which modules take recipes depends on
    which units are rebuilt and what is checkpointed: :func:`.rebuild_targets.recipe_takers` says,
    :func:`.surgery.link_outputs` gives and takes this mixin after every change. It carries no attribute."""

    memguard_prefix = "TakesRecipes"
    memguard_unit = False  # part of the unit before it, which counts

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        active, outer = may_rebuild(self)
        if not active:
            return super().forward(*args, **kwargs)
        with saving_recipes(outer):
            return super().forward(*args, **kwargs)
