"""timm's ConvNeXt (``timm.models.convnext.ConvNeXt``): its blocks are the ConvNeXtBlocks inside each stage's
``blocks``, not the stages that structure finds first (a stage holds 3 to 27 blocks: checkpointing stages leaves
most of the saving out of reach)."""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_memguard.checkpointing.families._base import Family, Named, flagged, loaded, staged_blocks


class TimmConvNeXt(Family):
    name = "timm ConvNeXt"

    def claims(self, module: nn.Module) -> bool:
        convnext = loaded("timm.models.convnext")
        return convnext is not None and isinstance(module, convnext.ConvNeXt)

    def blocks(self, module: nn.Module) -> list[Named]:
        return staged_blocks(module, "stages")

    def switched_on(self, module: nn.Module) -> bool:
        stages: Any = module.stages
        return flagged(module, *stages.children())
