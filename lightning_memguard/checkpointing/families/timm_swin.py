"""timm's Swin Transformer (``timm.models.swin_transformer.SwinTransformer``): its blocks are the
SwinTransformerBlocks inside each stage's ``blocks``, as timm's own switch checkpoints them, not the stages."""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_memguard.checkpointing.families._base import Family, Named, flagged, loaded, staged_blocks


class TimmSwin(Family):
    name = "timm Swin Transformer"

    def claims(self, module: nn.Module) -> bool:
        swin = loaded("timm.models.swin_transformer")
        return swin is not None and isinstance(module, swin.SwinTransformer)

    def blocks(self, module: nn.Module) -> list[Named]:
        return staged_blocks(module, "layers")

    def switched_on(self, module: nn.Module) -> bool:
        stages: Any = module.layers
        return flagged(module, *stages.children())
