"""Experimental: keep convolution outputs, recompute BatchNorm + ReLU in backward instead of saving their output.

In a torchvision Bottleneck, ``relu(bn1(conv1(x)))`` and ``relu(bn2(conv2(.)))`` are saved twice over for backward
(by the ReLU and by the next convolution) although BatchNorm has already saved its input. Here those two saves
become a recipe (the BatchNorm input and the batch's mean and inverse deviation) and the ReLU output is rebuilt,
once, when backward first needs it: one element-wise pass instead of a second copy of the tensor. BatchNorm's
running statistics are untouched (nothing runs BatchNorm in training mode again). Gradients match the plain model
to rounding, not bit for bit: the rebuilt tensor comes from BatchNorm's inference kernel.

Not public yet: ``benchmarks/checkpointing.py`` measures it against block checkpointing first.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from lightning_memguard.checkpointing.wrap import is_checkpointed, swapped_class


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


class RecomputedBatchNormReLU(nn.Module):
    """Mixin placed in front of a block's class: within its forward, the outputs of ``memguard_bns`` (each followed
    by an in-place ReLU) are saved as recipes."""

    memguard_prefix = "RecomputedBNReLU"

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled() or not self.training:
            return super().forward(*args, **kwargs)
        # by tensor object: the in-place ReLU returns BatchNorm's output object itself; a weak reference tells a
        # live tensor from a new one that got the same id after the first was freed
        recipes: dict[int, tuple[weakref.ref[torch.Tensor], _Recipe]] = {}

        def remember(bn: nn.Module, inputs: Any, output: torch.Tensor) -> None:
            stats = _batch_stats(output)
            if stats is not None:
                recipes[id(output)] = (weakref.ref(output), _Recipe(inputs[0], bn, *stats))  # type: ignore[arg-type]

        def pack(t: torch.Tensor) -> Any:
            entry = recipes.get(id(t))
            if entry is None or entry[0]() is not t:
                return t
            entry[1].packed += 1
            return entry[1]

        def unpack(saved: Any) -> torch.Tensor:
            return saved.rebuild() if isinstance(saved, _Recipe) else saved

        handles = [bn.register_forward_hook(remember) for bn in self.__dict__["memguard_bns"]]
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                return super().forward(*args, **kwargs)
        finally:
            for handle in handles:
                handle.remove()


def recompute_bn_relu(model: nn.Module) -> int:
    """Apply the recipe to every torchvision Bottleneck (bn1, bn2) and BasicBlock (bn1) in ``model`` that is not
    checkpointed, in place; return how many blocks changed."""
    from torchvision.models.resnet import BasicBlock, Bottleneck

    count = 0
    for module in model.modules():
        if not isinstance(module, Bottleneck | BasicBlock) or isinstance(module, RecomputedBatchNormReLU):
            continue
        if is_checkpointed(module):  # recomputed whole in backward already
            continue
        bns = (module.bn1, module.bn2) if isinstance(module, Bottleneck) else (module.bn1,)
        module.__dict__["memguard_bns"] = bns
        module.__class__ = swapped_class(type(module), RecomputedBatchNormReLU)
        count += 1
    return count
