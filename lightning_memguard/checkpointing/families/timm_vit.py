"""timm's plain vision transformers: ViT and DeiT (``timm.models.vision_transformer.VisionTransformer`` and its
subclasses, such as DeiT's distilled one) and EVA (``timm.models.eva.Eva``, EVA-02): the elements of ``blocks``."""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_memguard.checkpointing.families._base import Family, Named, elements, flagged, loaded, switched_parts


class TimmViT(Family):
    name = "timm ViT / DeiT / EVA"

    def claims(self, module: nn.Module) -> bool:
        vit, eva = loaded("timm.models.vision_transformer"), loaded("timm.models.eva")
        return (vit is not None and isinstance(module, vit.VisionTransformer)) or (
            eva is not None and isinstance(module, eva.Eva)
        )

    def blocks(self, module: nn.Module) -> list[Named]:
        blocks: Any = module.blocks  # an nn.Sequential (ViT) or nn.ModuleList (EVA)
        return switched_parts(module, elements("blocks", blocks))

    def switched_on(self, module: nn.Module) -> bool:
        return flagged(module)
