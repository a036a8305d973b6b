"""lightning-memguard: PyTorch Lightning callbacks that keep GPU training fast and honest about memory.

The public names are loaded on first use, so ``import lightning_memguard.core`` stays free of Lightning.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "AccumulationTuner": "lightning_memguard.callbacks",
    "ActivationCheckpointing": "lightning_memguard.callbacks",
    "BatchSizeTuner": "lightning_memguard.callbacks",
    "MemGuard": "lightning_memguard.callbacks",
    "checkpoint_blocks": "lightning_memguard.checkpointing",
    "checkpoint_resnet": "lightning_memguard.checkpointing",
    "fused_linear_cross_entropy": "lightning_memguard.levers.fused_loss",
    "apply_fused_loss": "lightning_memguard.levers.huggingface_loss",
    "remove_fused_loss": "lightning_memguard.levers.huggingface_loss",
    "recompute_pointwise": "lightning_memguard.levers.pointwise",
    "remove_pointwise": "lightning_memguard.levers.pointwise",
    "SysmemSpillError": "lightning_memguard.core.messages",
}

if TYPE_CHECKING:
    from lightning_memguard.callbacks import AccumulationTuner as AccumulationTuner
    from lightning_memguard.callbacks import ActivationCheckpointing as ActivationCheckpointing
    from lightning_memguard.callbacks import BatchSizeTuner as BatchSizeTuner
    from lightning_memguard.callbacks import MemGuard as MemGuard
    from lightning_memguard.checkpointing import checkpoint_blocks as checkpoint_blocks
    from lightning_memguard.checkpointing import checkpoint_resnet as checkpoint_resnet
    from lightning_memguard.core.messages import SysmemSpillError as SysmemSpillError
    from lightning_memguard.levers.fused_loss import fused_linear_cross_entropy as fused_linear_cross_entropy
    from lightning_memguard.levers.huggingface_loss import apply_fused_loss as apply_fused_loss
    from lightning_memguard.levers.huggingface_loss import remove_fused_loss as remove_fused_loss
    from lightning_memguard.levers.pointwise import recompute_pointwise as recompute_pointwise
    from lightning_memguard.levers.pointwise import remove_pointwise as remove_pointwise

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'lightning_memguard' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
