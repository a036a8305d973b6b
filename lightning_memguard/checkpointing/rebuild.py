"""Keep convolution outputs, rebuild BatchNorm + ReLU outputs in backward instead of saving them.

In a torchvision Bottleneck, ``relu(bn1(conv1(x)))`` and ``relu(bn2(conv2(.)))`` are kept for backward (by the
ReLU and by the next convolution) although BatchNorm has already saved its input. Here those tensors are saved as
a recipe instead (the BatchNorm input and the batch's mean and inverse deviation) and the ReLU output is rebuilt,
once, when backward first needs it: one element-wise pass instead of a second copy of the tensor, where block
checkpointing re-runs the block's convolutions. BatchNorm's running statistics are untouched (nothing runs
BatchNorm in training mode again). Gradients match the plain model to rounding, not bit for bit: the rebuilt
tensor comes from BatchNorm's inference kernel. A torchvision ResNet's stem gets the same: the output of its
``relu(bn1(.))``, kept by the ReLU and by the max-pooling after it, is rebuilt once for both.

Saved-tensor hooks around the model (a profiler, an offloader) still see every other tensor the block saves.
Inside a checkpoint, and under ``torch.compile``, a block runs as usual.

"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_memguard.checkpointing.wrap import _compiling, is_checkpointed, stock_resnet, swapped_class


class _Recipe:
    """How to rebuild one ReLU output: ``relu(batch_norm(source))`` with the batch's own statistics."""

    __slots__ = ("source", "bn", "mean", "invstd", "packed", "unpacked", "rebuilt")

    def __init__(self, source: torch.Tensor, bn: nn.BatchNorm2d, mean: torch.Tensor, invstd: torch.Tensor) -> None:
        self.source, self.bn, self.mean, self.invstd = source, bn, mean, invstd
        self.packed = 0
        self.unpacked = 0
        self.rebuilt: torch.Tensor | None = None

    def rebuild(self) -> torch.Tensor:
        if self.rebuilt is None:
            bn = self.bn
            var = self.invstd.float().pow(-2) - bn.eps  # the batch's variance, from what BatchNorm saved
            cudnn = torch.backends.cudnn.enabled
            out = torch.batch_norm(self.source, bn.weight, bn.bias, self.mean.float(), var, False, 0.0, bn.eps, cudnn)
            self.rebuilt = out.relu_()
        out = self.rebuilt
        self.unpacked += 1
        if self.unpacked >= self.packed:  # every saved copy has been used: let it go
            self.rebuilt = None
        return out


def _batch_stats(output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The batch mean and inverse deviation that training-mode BatchNorm saved for its backward."""
    node = output.grad_fn
    mean, invstd = getattr(node, "_saved_result1", None), getattr(node, "_saved_result2", None)
    if isinstance(mean, torch.Tensor) and isinstance(invstd, torch.Tensor) and mean.numel() == output.shape[1]:
        return mean, invstd
    return None


def _outer_hooks() -> tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]] | None:
    """The saved-tensor hooks in force around a block's forward (None if there are none)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else None


def _checkpoint_internal(pack: Any) -> bool:
    """Whether a pack hook is ``torch.utils.checkpoint``'s own (forward or recomputation), on any torch version."""
    return bool(getattr(pack, "_checkpoint_internal", False)) or getattr(pack, "__module__", "") == (
        "torch.utils.checkpoint"
    )


class _Passed:
    """A tensor packed by the hooks around the block, to be unpacked by them."""

    __slots__ = ("packed",)

    def __init__(self, packed: Any) -> None:
        self.packed = packed


_Outer = tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]] | None


def _may_rebuild(module: nn.Module) -> tuple[bool, _Outer]:
    """Whether a forward of ``module`` may save recipes (training with gradients, not compiling, not inside a
    checkpoint, which frees everything already), and the saved-tensor hooks around it."""
    if not torch.is_grad_enabled() or not module.training or _compiling():
        return False, None
    outer = _outer_hooks()
    return outer is None or not _checkpoint_internal(outer[0]), outer


def _saving_recipes(find: Callable[[torch.Tensor], _Recipe | None], outer: _Outer) -> Any:
    """Saved-tensor hooks that save a recipe where ``find`` has one, and hand anything else to ``outer``. The graph
    keeps these hooks: ``find`` must not hold the tensors it recognises."""

    def pack(t: torch.Tensor) -> Any:
        recipe = find(t)
        if recipe is not None:
            recipe.packed += 1
            return recipe
        return t if outer is None else _Passed(outer[0](t))

    def unpack(saved: Any) -> torch.Tensor:
        if isinstance(saved, _Recipe):
            return saved.rebuild()
        return saved if outer is None else outer[1](saved.packed)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


class RebuiltBatchNormReLU(nn.Module):
    """Mixin placed in front of a block's class: within its forward, the outputs of ``memguard_bns`` (each followed
    by an in-place ReLU) are saved as recipes."""

    memguard_prefix = "RebuiltBNReLU"

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        active, outer = _may_rebuild(self)
        if not active:
            return super().forward(*args, **kwargs)
        # by tensor object: the in-place ReLU returns BatchNorm's output object itself; a weak reference tells a
        # live tensor from a new one that got the same id after the first was freed
        recipes: dict[int, tuple[weakref.ref[torch.Tensor], _Recipe]] = {}

        def remember(bn: nn.Module, inputs: Any, output: torch.Tensor) -> None:
            stats = _batch_stats(output)
            if stats is not None:
                recipes[id(output)] = (weakref.ref(output), _Recipe(inputs[0], bn, *stats))  # type: ignore[arg-type]

        def find(t: torch.Tensor) -> _Recipe | None:
            entry = recipes.get(id(t))
            return entry[1] if entry is not None and entry[0]() is t else None

        handles = [bn.register_forward_hook(remember) for bn in self.__dict__["memguard_bns"]]
        try:
            with _saving_recipes(find, outer):
                return super().forward(*args, **kwargs)
        finally:
            for handle in handles:
                handle.remove()


class RebuiltStemReLU(nn.Module):
    """Mixin for the ReLU of a torchvision ResNet's stem (conv1, bn1, relu, maxpool): its output, BatchNorm's output
    made non-negative in place, is saved as a recipe, and handed to the max-pooling that follows (``memguard_pool``),
    which saves it again."""

    memguard_prefix = "RebuiltStem"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        active, outer = _may_rebuild(self)
        stats = _batch_stats(x) if active and isinstance(x, torch.Tensor) else None
        source = getattr(x.grad_fn, "_saved_input", None) if stats is not None else None
        if not isinstance(source, torch.Tensor):
            return super().forward(x)
        recipe = _Recipe(source, self.__dict__["memguard_bn"], *stats)  # type: ignore[misc]
        target = weakref.ref(x)  # the hooks live as long as the graph: no strong reference to what they free
        with _saving_recipes(lambda t: recipe if t is target() else None, outer):
            out = super().forward(x)
        if out is x:  # in place, as in torchvision: the same tensor goes on to the pooling
            self.__dict__["memguard_pool"].__dict__["_memguard_recipe"] = (weakref.ref(out), recipe)
        return out


class RebuiltStemPool(nn.Module):
    """Mixin for the max-pooling of a ResNet's stem: its input is saved as the recipe the stem's ReLU made."""

    memguard_prefix = "RebuiltStem"

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_memguard_recipe", None)  # one forward pass's hand-over: not state, and not picklable
        return state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        entry = self.__dict__.pop("_memguard_recipe", None)
        active, outer = _may_rebuild(self)
        if entry is None or entry[0]() is not x or not active:
            return super().forward(x)
        target, recipe = entry
        with _saving_recipes(lambda t: recipe if t is target() else None, outer):
            return super().forward(x)


def stem_modules(resnet: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module] | None:
    """The stem's BatchNorm, ReLU and max-pooling of a torchvision ResNet with torchvision's forward, when they are
    the stock layers the stem rebuild knows (None otherwise)."""
    if not stock_resnet(resnet):
        return None
    parts: tuple[nn.Module, nn.Module, nn.Module] = (resnet.bn1, resnet.relu, resnet.maxpool)  # type: ignore[assignment]
    return parts if stem_rebuildable(*parts) else None


def stem_rebuildable(bn: nn.Module, relu: nn.Module, pool: nn.Module) -> bool:
    return type(bn) is nn.BatchNorm2d and isinstance(relu, nn.ReLU) and isinstance(pool, nn.MaxPool2d)


def rebuild_stem(bn: nn.Module, relu: nn.Module, pool: nn.Module) -> bool:
    """Rebuild a ResNet stem's ReLU output in backward instead of keeping it; False if already done or the stem is
    checkpointed."""
    if isinstance(relu, RebuiltStemReLU) or any(is_checkpointed(m) for m in (bn, relu, pool)):
        return False
    relu.__dict__["memguard_bn"], relu.__dict__["memguard_pool"] = bn, pool  # plain references, not submodules
    relu.__class__ = swapped_class(type(relu), RebuiltStemReLU)
    pool.__class__ = swapped_class(type(pool), RebuiltStemPool)
    return True


def rebuildable(module: nn.Module) -> bool:
    """Whether :func:`rebuild_bn_relu` applies to this block (a torchvision BasicBlock or Bottleneck with
    ``nn.BatchNorm2d``)."""
    return _eligible(module) is not None


def _eligible(module: nn.Module) -> tuple[nn.Module, ...] | None:
    """The BatchNorms whose ReLU outputs can be rebuilt, for a torchvision BasicBlock or Bottleneck."""
    from torchvision.models.resnet import BasicBlock, Bottleneck

    if isinstance(module, Bottleneck):
        bns: tuple[nn.Module, ...] = (module.bn1, module.bn2)
    elif isinstance(module, BasicBlock):
        bns = (module.bn1,)
    else:
        return None
    return bns if all(type(bn) is nn.BatchNorm2d for bn in bns) else None  # not a frozen or other norm layer


def rebuild_bn_relu(model: nn.Module) -> int:
    """Rebuild BatchNorm + ReLU outputs in backward in every torchvision Bottleneck (after bn1 and bn2), BasicBlock
    (after bn1) and ResNet stem (after bn1) of ``model`` that is not checkpointed, in place; return how many blocks
    and stems changed.

    ``state_dict`` keys do not change; :func:`remove_rebuild` undoes it.

    Example:
        >>> import torchvision
        >>> rebuild_bn_relu(torchvision.models.resnet50(num_classes=10))  # 16 blocks and the stem
        17
    """
    count = 0
    for module in model.modules():
        stem = stem_modules(module)
        if stem is not None:
            count += rebuild_stem(*stem)
        bns = _eligible(module)
        if bns is None or isinstance(module, RebuiltBatchNormReLU) or is_checkpointed(module):
            continue  # a checkpointed block is recomputed whole in backward already
        module.__dict__["memguard_bns"] = bns  # plain references, not submodules
        module.__class__ = swapped_class(type(module), RebuiltBatchNormReLU)
        count += 1
    return count


def remove_rebuild(model: nn.Module) -> int:
    """Undo :func:`rebuild_bn_relu` everywhere in ``model``; return how many blocks changed back."""
    count = 0
    for module in model.modules():
        if isinstance(module, RebuiltBatchNormReLU | RebuiltStemReLU | RebuiltStemPool):
            count += not isinstance(module, RebuiltStemPool)  # a stem counts once
            module.__class__ = type(module)._memguard_original  # type: ignore[union-attr]
            for key in ("memguard_bns", "memguard_bn", "memguard_pool", "_memguard_recipe"):
                module.__dict__.pop(key, None)
    return count
