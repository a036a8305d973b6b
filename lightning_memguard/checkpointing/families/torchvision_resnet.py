"""torchvision's ResNet family (resnet18..152, ResNeXt, Wide ResNet): BasicBlock / Bottleneck blocks in four
stages, a stem of conv1, bn1, relu and maxpool, and the average pooling after the last block."""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_memguard.checkpointing.families._base import (
    Family,
    Named,
    Stem,
    Tail,
    elements,
    original_class,
    stage_successors,
    stock,
)

STAGES = ("layer1", "layer2", "layer3", "layer4")


def stock_resnet(module: nn.Module) -> bool:
    """A torchvision ResNet whose forward is torchvision's: stem, then the four stages, each feeding the next."""
    from torchvision.models import ResNet

    return stock(module, ResNet, "forward", "_forward_impl")


class TorchvisionResNet(Family):
    name = "torchvision ResNet"
    rebuilds = "torchvision BasicBlock or Bottleneck blocks, a ResNet stem"

    def claims(self, module: nn.Module) -> bool:
        return stock_resnet(module)

    def blocks(self, module: nn.Module) -> list[Named]:
        return [block for stage in STAGES for block in elements(stage, getattr(module, stage))]

    def stem(self, module: nn.Module) -> Stem | None:
        resnet: Any = module
        if not len(resnet.layer1):
            return None
        return Stem(tuple((part, getattr(resnet, part)) for part in ("conv1", "bn1", "relu", "maxpool")), "layer1.0")

    def following(self, module: nn.Module) -> dict[int, nn.Module]:
        stages = [getattr(module, stage) for stage in STAGES]
        after = stage_successors(stages)
        if len(stages[-1]):
            after[id(stages[-1][-1])] = module.get_submodule("avgpool")
        return after

    def norm_activations(self, module: nn.Module) -> tuple[tuple[nn.Module, nn.Module], ...] | None:
        from torchvision.models.resnet import BasicBlock, Bottleneck

        block: Any = module
        if isinstance(module, Bottleneck):
            return ((block.bn1, block.relu), (block.bn2, block.relu))
        if isinstance(module, BasicBlock):
            return ((block.bn1, block.relu),)
        return None

    def tail(self, module: nn.Module) -> Tail | None:
        from torchvision.models.resnet import BasicBlock, Bottleneck

        block: Any = module
        forward = original_class(module).forward
        name = "bn3" if forward is Bottleneck.forward else "bn2" if forward is BasicBlock.forward else None
        if name is None:
            return None
        shortcut = block.downsample
        if shortcut is None:
            return Tail(getattr(block, name), block.relu, None)
        if type(shortcut) is nn.Sequential and len(shortcut) == 2:  # a convolution and its norm layer
            return Tail(getattr(block, name), block.relu, shortcut[1])
        return None
