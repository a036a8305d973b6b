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
and what runs after a block, the model's :class:`~.families.Layout` says (its adapters' answers); this module
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

This module describes: the mixins, the recipes they save, and which modules get which mixin (as
:class:`~.wrap.Swap` records: :func:`rebuild_swaps`, :func:`output_tails`, :func:`recipe_takers`);
:mod:`.surgery` makes every change.

On CUDA each rebuilt BatchNorm (+ ReLU) output is one pass of a Triton kernel (:mod:`._fused`) that computes what
training-mode BatchNorm computed; elsewhere PyTorch's own kernels, two or three passes (on the CPU training-mode
BatchNorm on the same input again, which gives the same bits). Other activations run after it, as PyTorch's own.
Saved-tensor hooks around the model (a profiler, an offloader) still see every other tensor a block saves. Inside a
checkpoint, and under ``torch.compile``, a block runs as usual.
"""

from __future__ import annotations

import contextlib
import numbers
import operator
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_memguard import _autograd, _compiler
from lightning_memguard.checkpointing import _fused
from lightning_memguard.checkpointing.families import Layout
from lightning_memguard.checkpointing.wrap import Swap, SwappedModule, is_checkpointed, plain_sequential
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


class _Recipe:
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
        identity: torch.Tensor | _Recipe | None = None,
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
        if own is not None and isinstance(identity, _Recipe) and identity.packed == 0 and identity.rebuilt is None:
            second = identity._args() if identity.identity is None and not identity.relu else None
            out = _fused.fused(own, second, self.relu) if second is not None else None  # both BatchNorms, one pass
            if out is not None:
                return out
        value = identity.value(depth + 1) if isinstance(identity, _Recipe) else identity
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


class _Activated:
    """How to rebuild an activation's output: the activation, with PyTorch's own kernel as in the forward pass,
    applied to ``pre``, the recipe of its input (a BatchNorm output, which the activation saves for its own
    backward). Built when backward first unpacks it (``pre`` is built then too, and kept for the activation's
    backward, which comes soon after), kept until every saved copy has been unpacked, then let go; ``pre``'s
    ``config.chain_kept`` says how far up a chain it is kept, as for a recipe."""

    __slots__ = ("pre", "fn", "packed", "unpacked", "rebuilt")

    def __init__(self, pre: _Recipe, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
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


_Saved = _Recipe | _Activated
"""What a tensor is saved as instead of itself."""


def _batch_stats(output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The batch mean and inverse deviation that training-mode BatchNorm saved for its backward."""
    mean, invstd = _autograd.batch_norm_saved_statistics(output)
    if isinstance(mean, torch.Tensor) and isinstance(invstd, torch.Tensor) and mean.numel() == output.shape[1]:
        return mean, invstd
    return None


_Hooks = tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]
"""A pack hook and its unpack hook."""
_Outer = _Hooks | None


class _Passed:
    """A tensor packed by the hooks around the block, to be unpacked by them."""

    __slots__ = ("packed",)

    def __init__(self, packed: Any) -> None:
        self.packed = packed


def _may_rebuild(module: nn.Module) -> tuple[bool, _Outer]:
    """Whether a forward of ``module`` may save recipes (training with gradients, not compiling, not inside a
    checkpoint, which frees everything already), and the saved-tensor hooks around it."""
    if not torch.is_grad_enabled() or not module.training or _compiler.compiling():
        return False, None
    outer = _autograd.saved_tensors_hooks_in_force()  # the hooks around the block's forward
    return outer is None or not _autograd.checkpoint_hook(outer[0]), outer


_RECIPES: dict[int, tuple[weakref.ref[torch.Tensor], _Saved, int | None]] = {}
"""Live tensors that a forward pass saves as recipes, by id: one block's output is saved again by the next. With a
version, only while the tensor has not been changed in place since (its ``_version``)."""


def _register(t: torch.Tensor, recipe: _Saved, version: int | None = None) -> None:
    key = id(t)

    def forget(ref: weakref.ref[torch.Tensor]) -> None:
        if _RECIPES.get(key, (None,))[0] is ref:
            del _RECIPES[key]

    _RECIPES[key] = (weakref.ref(t, forget), recipe, version)  # no strong reference: the tensor is freed as it would be


def _pin(t: torch.Tensor) -> None:
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


def _registered(t: Any) -> _Recipe | None:
    recipe = _saved_as(t)
    return recipe if isinstance(recipe, _Recipe) else None


def _recipe_hooks(outer: _Outer) -> _Hooks:
    """Pack and unpack hooks that save a recipe where a tensor has one, and hand anything else to ``outer``."""

    def pack(t: torch.Tensor) -> Any:
        recipe = _saved_as(t)
        if recipe is not None:
            recipe.packed += 1
            return recipe
        return t if outer is None else _Passed(outer[0](t))

    def unpack(saved: Any) -> torch.Tensor:
        if isinstance(saved, _Recipe | _Activated):
            return saved.rebuild()
        return saved if outer is None else outer[1](saved.packed)

    return pack, unpack


def _saving_recipes(outer: _Outer) -> Any:
    """Saved-tensor hooks (a context manager) from :func:`_recipe_hooks`."""
    return torch.autograd.graph.saved_tensors_hooks(*_recipe_hooks(outer))


def _remember(bn: nn.BatchNorm2d, inputs: Any, output: torch.Tensor, config: RebuildConfig) -> None:
    """Forward hook of a BatchNorm followed by an in-place ReLU: its output is saved as a recipe."""
    stats = _batch_stats(output)
    if stats is not None:
        _register(output, _Recipe(inputs[0], bn, *stats, config=config))


class RebuildMixin(SwappedModule):
    """Base of the rebuild's mixins: ``remove_rebuild`` takes off every subclass."""


class RebuiltBatchNormReLU(RebuildMixin):
    """Mixin placed in front of a block's class: within its forward, the outputs of ``memguard_bns`` (each followed
    by an in-place ReLU) are saved as recipes, and with ``memguard_tail`` (its last BatchNorm and its shortcut's
    BatchNorm or None) so is the block's output, ``relu(last(.) + shortcut)``; ``memguard_rebuild`` is the
    :class:`RebuildConfig` its recipes follow."""

    memguard_prefix = "RebuiltBNReLU"

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        active, outer = _may_rebuild(self)
        if not active:
            return super().forward(*args, **kwargs)
        config = self.__dict__["memguard_rebuild"]
        handles = [bn.register_forward_hook(partial(_remember, config=config)) for bn in self.__dict__["memguard_bns"]]
        tail = self.__dict__.get("memguard_tail")
        if tail is not None and args and isinstance(args[0], torch.Tensor):
            last, shortcut = tail
            handles += self._remember_output(args[0], last, shortcut, config)
        try:
            with _saving_recipes(outer):
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
        pending: list[tuple[torch.Tensor, _Recipe]] = []

        def remember_last(bn: nn.BatchNorm2d, inputs: Any, output: torch.Tensor) -> None:
            stats = _batch_stats(output)
            if stats is None:
                return
            if shortcut is None:
                identity = _registered(x)
                recipe = _Recipe(inputs[0], bn, *stats, identity=x if identity is None else identity, config=config)
                _register(output, recipe)
            else:
                pending.append((output, _Recipe(inputs[0], bn, *stats, config=config)))

        def remember_shortcut(bn: nn.BatchNorm2d, inputs: Any, output: torch.Tensor) -> None:
            stats = _batch_stats(output)
            if stats is not None and pending:
                out, recipe = pending.pop()
                recipe.identity = _Recipe(inputs[0], bn, *stats, relu=False, config=config)
                _register(out, recipe)

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
        active, outer = _may_rebuild(self)
        stats = _batch_stats(x) if active and isinstance(x, torch.Tensor) else None
        source = _autograd.saved_input(x) if stats is not None else None
        if not isinstance(source, torch.Tensor) or not getattr(self, "inplace", False):
            return super().forward(x)
        config = self.__dict__["memguard_rebuild"]
        _register(x, _Recipe(source, self.__dict__["memguard_bn"], *stats, config=config))  # type: ignore[misc]
        with _saving_recipes(outer):
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
        active, outer = _may_rebuild(self)
        if not active or _registered(x) is None:
            return super().forward(x)
        narrow = x.dim() >= 2 and x.shape[-1] * x.shape[-2] <= torch.iinfo(torch.int16).max
        pack, unpack = _recipe_hooks(outer)

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


_ACTIVATIONS: dict[type[nn.Module], Callable[[torch.Tensor], torch.Tensor] | None] = {
    nn.ReLU: None,  # in place only: it keeps its output, rebuilt with BatchNorm in one pass like a ResNet's
    nn.ReLU6: _relu6,
    nn.SiLU: F.silu,
    nn.Hardswish: F.hardswish,
}
"""The activations a Conv-BN-activation unit may end in, and how each output is rebuilt from its input."""


def unit_parts(module: nn.Module, layout: Layout) -> tuple[nn.Module, nn.BatchNorm2d, nn.Module | None] | None:
    """The convolution, BatchNorm and activation (None without one) of a convolution-norm-activation unit that an
    adapter of :mod:`.families` describes (torchvision's Conv2dNormActivation), when they are layers the rebuild
    knows: an ``nn.Conv2d``, an ``nn.BatchNorm2d``, then an in-place ``nn.ReLU``, an ``nn.ReLU6``, ``nn.SiLU`` or
    ``nn.Hardswish``, or nothing (None otherwise)."""
    parts = layout.unit(module)
    if parts is None or not isinstance(parts.conv, nn.Conv2d) or type(parts.norm) is not nn.BatchNorm2d:
        return None
    act = parts.activation
    if act is not None and (type(act) not in _ACTIVATIONS or (type(act) is nn.ReLU and not act.inplace)):
        return None
    return parts.conv, parts.norm, act  # type: ignore[return-value]


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
    one after another (torchvision's Conv2dNormActivation; see :func:`unit_parts`). Of the three tensors of one size
    that a plain unit keeps for backward, the convolution output (kept by BatchNorm) stays; the BatchNorm output (kept
    by the activation) and the activation output (kept by whatever runs next on it: the next unit, a convolution or
    SqueezeExcitation marked :class:`TakesRecipes`) are saved as recipes and rebuilt in backward from it and the batch's
    statistics, each once, when first needed. A ReLU keeps only its output: it is rebuilt with BatchNorm in one pass, as
    in a ResNet. ``memguard_rebuild`` is the :class:`RebuildConfig` its recipes follow."""

    memguard_prefix = "RebuiltCNA"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        active, outer = _may_rebuild(self)
        if not active:
            return super().forward(x)  # type: ignore[no-any-return]
        # the layers unit_parts checked when the mixin was given (unit_swaps): conv, BatchNorm, the activation if any
        layers: list[Any] = list(self._modules.values())
        conv, bn, act = layers[0], layers[1], layers[2] if len(layers) == 3 else None
        config = self.__dict__["memguard_rebuild"]
        with _saving_recipes(outer):
            source = conv(x)  # what BatchNorm keeps for its backward
            out = bn(source)
            stats = _batch_stats(out) if bn.training and isinstance(out, torch.Tensor) else None
            if stats is None:
                return out if act is None else act(out)  # type: ignore[no-any-return]
            if act is None:
                _register(out, _Recipe(source, bn, *stats, relu=False, config=config), _autograd.version(out))
                return out  # type: ignore[no-any-return]
            rebuild = _ACTIVATIONS[type(act)]
            if rebuild is None:  # an in-place ReLU, which keeps what it overwrites the BatchNorm output with
                _register(out, _Recipe(source, bn, *stats, config=config))
                activated = act(out)
                _pin(out)
                return activated  # type: ignore[no-any-return]
            pre = _Recipe(source, bn, *stats, relu=False, config=config)
            _register(out, pre, _autograd.version(out))
            with _out_of_place(act):
                activated = act(out)
            _register(activated, _Activated(pre, rebuild), _autograd.version(activated))
            return activated  # type: ignore[no-any-return]


class TakesRecipes(RebuildMixin):
    """Mixin for the module that runs next on a rebuilt unit's output where that is not a rebuilt unit itself (a
    convolution, a SqueezeExcitation): within its forward, what it keeps of that output is saved as the unit's
    recipe. Anything it keeps that was changed in place since is kept as it is. Which modules take recipes depends on
    which units are rebuilt and what is checkpointed: :func:`recipe_takers` says, :func:`.surgery.link_outputs` gives
    and takes this mixin after every change. It carries no attribute."""

    memguard_prefix = "TakesRecipes"
    memguard_unit = False  # part of the unit before it, which counts

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        active, outer = _may_rebuild(self)
        if not active:
            return super().forward(*args, **kwargs)
        with _saving_recipes(outer):
            return super().forward(*args, **kwargs)


def _outside_checkpoints(model: nn.Module) -> Iterator[nn.Module]:
    """The modules of ``model`` that are neither checkpointed nor inside a checkpointed one (a checkpoint recomputes
    those whole), each once, parents before children."""
    seen: set[int] = set()
    stack = [model]
    while stack:
        module = stack.pop()
        if id(module) in seen or is_checkpointed(module):
            continue
        seen.add(id(module))
        yield module
        stack.extend(reversed(list(module.children())))


def stem_modules(model: nn.Module, layout: Layout) -> tuple[nn.Module, nn.Module, nn.Module] | None:
    """The stem's BatchNorm, ReLU and max-pooling of a model whose adapter names a stem (torchvision's and timm's
    ResNets), when they are the stock layers the stem rebuild knows (None otherwise)."""
    stem = layout.stem_of(model)
    if stem is None or len(stem.modules) != 4:
        return None
    parts: tuple[nn.Module, nn.Module, nn.Module] = tuple(m for _, m in stem.modules[1:])  # type: ignore[assignment]
    return parts if stem_rebuildable(*parts) else None


def stem_rebuildable(bn: nn.Module, relu: nn.Module, pool: nn.Module) -> bool:
    """Whether a stem's norm layer, activation and pooling are the layers the stem rebuild knows."""
    return type(bn) is nn.BatchNorm2d and isinstance(relu, nn.ReLU) and isinstance(pool, nn.MaxPool2d)


def stem_swaps(bn: nn.Module, relu: nn.Module, pool: nn.Module, config: RebuildConfig) -> list[Swap]:
    """What rebuilding a ResNet stem's ReLU output takes (empty if the stem is not the stock layers, is rebuilt
    already or is checkpointed)."""
    if not stem_rebuildable(bn, relu, pool) or isinstance(relu, RebuiltStemReLU):
        return []
    if any(is_checkpointed(m) for m in (bn, relu, pool)):
        return []
    return [
        Swap(relu, RebuiltStemReLU, {"memguard_bn": bn, "memguard_rebuild": config}),  # a plain reference to bn
        Swap(pool, RebuiltStemPool, {}),
    ]


def block_swaps(module: nn.Module, config: RebuildConfig, layout: Layout) -> list[Swap]:
    """What rebuilding a block's BatchNorm + ReLU outputs takes (empty if it is not a block the rebuild knows, is
    rebuilt already or is checkpointed: a checkpointed block is recomputed whole in backward already)."""
    bns = _eligible(module, layout)
    if bns is None or isinstance(module, RebuiltBatchNormReLU) or is_checkpointed(module):
        return []
    return [Swap(module, RebuiltBatchNormReLU, {"memguard_bns": bns, "memguard_rebuild": config})]  # plain references


def unit_swaps(module: nn.Module, config: RebuildConfig, layout: Layout) -> list[Swap]:
    """What rebuilding a Conv2dNormActivation's BatchNorm and activation outputs takes (empty if it is not a unit
    the rebuild knows, see :func:`unit_parts`, is rebuilt already or is checkpointed)."""
    if isinstance(module, RebuiltConvNormActivation) or is_checkpointed(module) or unit_parts(module, layout) is None:
        return []
    return [Swap(module, RebuiltConvNormActivation, {"memguard_rebuild": config})]


def rebuild_swaps(module: nn.Module, config: RebuildConfig, layout: Layout) -> list[Swap]:
    """What rebuilding ``module`` and everything in it that is not checkpointed (a checkpoint recomputes what is
    inside it whole) takes: the swaps of each torchvision ResNet stem, each BasicBlock or Bottleneck and each
    Conv2dNormActivation (and the same of other families, as :mod:`.families` describes them), made by
    :func:`.surgery.apply`. A new kind of block is taught here: a mixin above, a function like :func:`block_swaps`,
    and one line below; a new family whose blocks have the same shape needs only its adapter."""
    swaps: list[Swap] = []
    for sub in _outside_checkpoints(module):
        stem = stem_modules(sub, layout)
        if stem is not None:
            swaps += stem_swaps(*stem, config)
        swaps += block_swaps(sub, config, layout)
        swaps += unit_swaps(sub, config, layout)
    return swaps


def rebuildable(module: nn.Module, layout: Layout) -> bool:
    """Whether :func:`rebuild_bn_relu` applies to this block: a residual block (torchvision's or timm's BasicBlock or
    Bottleneck) with ``nn.BatchNorm2d`` layers each followed by an in-place ``nn.ReLU``, or a module that is or holds
    a convolution-norm-activation unit it knows (see :func:`unit_parts`)."""
    return _eligible(module, layout) is not None or any(unit_parts(m, layout) is not None for m in module.modules())


def _in_place_relu(module: nn.Module) -> bool:
    return type(module) is nn.ReLU and module.inplace  # type: ignore[return-value]


def _eligible(module: nn.Module, layout: Layout) -> tuple[nn.Module, ...] | None:
    """The BatchNorms whose ReLU outputs can be rebuilt in a residual block an adapter of :mod:`.families` describes
    (torchvision's or timm's BasicBlock or Bottleneck): every one of its norm layers that feeds an activation is an
    ``nn.BatchNorm2d`` (not a frozen or other norm layer), each followed by an in-place ``nn.ReLU``."""
    pairs = layout.norm_activations(module)
    if not pairs or not all(type(bn) is nn.BatchNorm2d and _in_place_relu(act) for bn, act in pairs):
        return None
    return tuple(bn for bn, _ in pairs)


def _tail(block: nn.Module, layout: Layout) -> tuple[nn.Module, nn.Module | None] | None:
    """For a residual block with its family's forward (see :meth:`.families.Family.tail`), whose output is its last
    BatchNorm's, added to in place and made non-negative in place by an in-place ReLU: that BatchNorm and its
    shortcut's (None without one)."""
    tail = layout.tail(block)
    if tail is None or type(tail.norm) is not nn.BatchNorm2d or not _in_place_relu(tail.activation):
        return None
    if tail.shortcut is not None and type(tail.shortcut) is not nn.BatchNorm2d:
        return None
    return tail.norm, tail.shortcut


def _following(model: nn.Module, layout: Layout) -> dict[int, nn.Module]:
    """What runs next on each module's output, where the model's structure says so: the next child of an
    ``nn.Sequential``, and in a model of a known family what its adapter says (in a ResNet the next stage's first
    block after a stage's last, the pooling after the last block)."""
    after: dict[int, nn.Module] = {}
    for module in model.modules():
        if plain_sequential(module):
            children = list(module.children())
            after.update((id(a), b) for a, b in zip(children, children[1:], strict=False))
    after.update(layout.following)
    return after


def _keeps_nothing(module: nn.Module) -> bool:
    """Whether ``module`` keeps nothing of its input for backward: average pooling to one value per channel."""
    return type(module) is nn.AdaptiveAvgPool2d and module.output_size in (1, (1, 1))


def _takes_recipes(module: nn.Module | None, layout: Layout) -> bool:
    """Whether a block's output may be saved as a recipe, given what runs next on it: a rebuilt block (not
    checkpointed, with its family's forward, which does not change its input in place), or a module that keeps
    nothing of it."""
    if isinstance(module, RebuiltBatchNormReLU):
        return not is_checkpointed(module) and _tail(module, layout) is not None
    return module is not None and _keeps_nothing(module)


def output_tails(model: nn.Module, layout: Layout) -> list[tuple[nn.Module, tuple[nn.Module, nn.Module | None] | None]]:
    """For each rebuilt block of ``model``, what its output is rebuilt from (``memguard_tail``: its last BatchNorm
    and its shortcut's or None), or None where it keeps its output.

    A block's output, ``relu(last_bn(.) + shortcut)``, is rebuilt where the block after it is rebuilt and not
    checkpointed (it then saves that output as a recipe too), and in a ResNet the last block's, which the average
    pooling does not keep. Rebuilding a stage's outputs in backward needs the one before, back to the
    stage's first block, whose shortcut has its own BatchNorm: they are built in turn and each is let go after its
    last use. A block whose output goes anywhere else keeps it. Depends on which blocks are rebuilt or checkpointed:
    :func:`.surgery.link_outputs` sets it after every change.
    """
    after = _following(model, layout)
    out: list[tuple[nn.Module, tuple[nn.Module, nn.Module | None] | None]] = []
    for module in model.modules():
        if isinstance(module, RebuiltBatchNormReLU):
            tail = _tail(module, layout) if not is_checkpointed(module) else None  # a checkpoint recomputes it whole
            out.append((module, tail if tail is not None and _takes_recipes(after.get(id(module)), layout) else None))
    return out


def _taker(module: nn.Module | None, layout: Layout) -> nn.Module | None:
    """The module to mark :class:`TakesRecipes` when ``module`` runs next on a rebuilt unit's output: the first
    element of a plain ``nn.Sequential``; none if it is a rebuilt unit or holds one (those take recipes already), is
    checkpointed or wrapped by other code (it keeps its input anyway), or keeps nothing of its input."""
    while module is not None and plain_sequential(module) and len(module._modules):
        module = next(iter(module._modules.values()))
    if module is None or isinstance(module, RebuiltBatchNormReLU | nn.ModuleList):
        return None
    if is_checkpointed(module) or layout.wrapped_by_someone_else(module) or _keeps_nothing(module):
        return None
    return None if any(isinstance(m, RebuiltConvNormActivation) for m in module.modules()) else module


def recipe_takers(model: nn.Module, layout: Layout) -> list[nn.Module]:
    """The modules of ``model`` that are to be :class:`TakesRecipes`: for each rebuilt unit outside checkpoints, the
    module that runs next on its output, where the model's structure says so and :func:`_taker` finds one. Depends
    on which units are rebuilt and what is checkpointed: :func:`.surgery.link_outputs` follows it after every
    change."""
    after = _following(model, layout)
    takers: dict[int, nn.Module] = {}
    for module in _outside_checkpoints(model):
        if isinstance(module, RebuiltConvNormActivation):
            taker = _taker(after.get(id(module)), layout)
            if taker is not None:
                takers[id(taker)] = taker
    return list(takers.values())
