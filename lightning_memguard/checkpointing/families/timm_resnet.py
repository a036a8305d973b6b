"""timm's ResNet family (``timm.models.resnet.ResNet``: resnet18..200, the -b/-c/-d/-s/-t stems, ResNeXts, SE- and
ECA-ResNets and ResNeXts, ResNet-RS, wide ResNets): BasicBlock / Bottleneck blocks in four stages, a stem of conv1 (one
convolution, or a deep stem), bn1, act1 and maxpool, and the global pooling after the last block.

The rebuild takes a block's norm layers whose output goes straight (through timm's empty ``drop_block`` and ``aa``
slots) to its activation, and its output where nothing (squeeze-excitation, drop path) sits between the last norm
layer and the residual sum; ``rebuild`` decides which layer types it can rebuild (``nn.BatchNorm2d``, an in-place
``nn.ReLU``)."""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_memguard.checkpointing.families._base import (
    Family,
    Named,
    Stem,
    Tail,
    elements,
    flagged,
    loaded,
    original_class,
    stage_successors,
    stock,
)

STAGES = ("layer1", "layer2", "layer3", "layer4")


def _empty(module: nn.Module | None) -> bool:
    return module is None or type(module) is nn.Identity


class TimmResNet(Family):
    name = "timm ResNet"
    rebuilds = "timm ResNet blocks and stems"

    def claims(self, module: nn.Module) -> bool:
        resnet = loaded("timm.models.resnet")
        return resnet is not None and stock(module, resnet.ResNet, "forward", "forward_features", "forward_head")

    def blocks(self, module: nn.Module) -> list[Named]:
        return [block for stage in STAGES for block in elements(stage, getattr(module, stage))]

    def switched_on(self, module: nn.Module) -> bool:
        return flagged(module)

    def stem(self, module: nn.Module) -> Stem | None:
        resnet: Any = module
        if not len(resnet.layer1):
            return None
        return Stem(tuple((part, getattr(resnet, part)) for part in ("conv1", "bn1", "act1", "maxpool")), "layer1.0")

    def following(self, module: nn.Module) -> dict[int, nn.Module]:
        stages = [getattr(module, stage) for stage in STAGES]
        after = stage_successors(stages)
        pool: Any = module.global_pool
        layers = loaded("timm.layers")
        if len(stages[-1]) and layers is not None:
            # SelectAdaptivePool2d's forward pools first (``self.pool``: nn.AdaptiveAvgPool2d(1) for "avg")
            first = pool.pool if stock(pool, layers.SelectAdaptivePool2d, "forward") else pool
            after[id(stages[-1][-1])] = first
        return after

    def norm_activations(self, module: nn.Module) -> tuple[tuple[nn.Module, nn.Module], ...] | None:
        resnet = loaded("timm.models.resnet")
        block: Any = module
        if resnet is None or not (_empty(getattr(block, "drop_block", None)) and _empty(getattr(block, "aa", None))):
            return None
        if stock(module, resnet.Bottleneck, "forward"):
            return ((block.bn1, block.act1), (block.bn2, block.act2))
        if stock(module, resnet.BasicBlock, "forward"):
            return ((block.bn1, block.act1),)
        return None

    def tail(self, module: nn.Module) -> Tail | None:
        resnet = loaded("timm.models.resnet")
        if resnet is None:
            return None
        block: Any = module
        forward = original_class(module).forward
        if forward is resnet.Bottleneck.forward:
            last, act = block.bn3, block.act3
        elif forward is resnet.BasicBlock.forward:
            last, act = block.bn2, block.act2
        else:
            return None
        if block.se is not None or not _empty(block.drop_path):
            return None  # the last norm's output is changed before the sum
        shortcut = block.downsample
        if shortcut is None:
            return Tail(last, act, None)
        if type(shortcut) is nn.Sequential and len(shortcut):  # [pooling,] convolution, norm layer
            return Tail(last, act, shortcut[-1])
        return None
