"""timm's EfficientNet and MobileNet families (``timm.models.efficientnet.EfficientNet``: EfficientNet, MobileNetV2,
MNASNet, TinyNet, ...; ``timm.models.mobilenetv3.MobileNetV3``): every block of every stage of ``blocks``, as
timm's own switch checkpoints them (structure leaves out the kinds that appear once, such as EfficientNet's first
DepthwiseSeparableConv)."""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_memguard.checkpointing.families._base import Family, Named, composite, elements, flagged, loaded


class TimmEfficientNet(Family):
    name = "timm EfficientNet / MobileNet"

    def claims(self, module: nn.Module) -> bool:
        efficientnet, mobilenet = loaded("timm.models.efficientnet"), loaded("timm.models.mobilenetv3")
        return (efficientnet is not None and isinstance(module, efficientnet.EfficientNet)) or (
            mobilenet is not None and isinstance(module, mobilenet.MobileNetV3)
        )

    def blocks(self, module: nn.Module) -> list[Named]:
        stages: Any = module.blocks
        found: list[Named] = []
        for name, stage in stages.named_children():
            if type(stage) is nn.Sequential:  # a stage of blocks
                found += elements(f"blocks.{name}", stage)
            elif composite(stage):  # a block on its own
                found.append((f"blocks.{name}", stage))
        return found

    def switched_on(self, module: nn.Module) -> bool:
        return flagged(module)
