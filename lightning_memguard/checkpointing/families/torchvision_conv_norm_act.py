"""torchvision's convolution-norm-activation units (``Conv2dNormActivation``: MobileNet, EfficientNet, RegNet).

Blocks of those models are found by structure; this adapter names a unit's parts for the rebuild."""

from __future__ import annotations

from torch import nn

from lightning_memguard.checkpointing.families._base import Family, Unit, original_class


class TorchvisionConvNormActivation(Family):
    name = "torchvision Conv2dNormActivation"
    rebuilds = "Conv2dNormActivation units"

    def unit(self, module: nn.Module) -> Unit | None:
        from torchvision.ops.misc import Conv2dNormActivation

        if not isinstance(module, Conv2dNormActivation) or original_class(module).forward is not nn.Sequential.forward:
            return None
        parts = list(module._modules.values())
        if len(parts) not in (2, 3) or any(part is None for part in parts):
            return None
        return Unit(parts[0], parts[1], parts[2] if len(parts) == 3 else None)  # type: ignore[arg-type]
