"""Activation checkpointing for block-structured models, BatchNorm-correct."""

from lightning_memguard.checkpointing.plan import CheckpointPlan, apply_plan, checkpoint_blocks, checkpoint_resnet
from lightning_memguard.checkpointing.rebuild import RebuildConfig
from lightning_memguard.checkpointing.surgery import rebuild_bn_relu, remove_checkpointing, remove_rebuild
from lightning_memguard.checkpointing.wrap import find_units, is_checkpointed

__all__ = [
    "CheckpointPlan",
    "RebuildConfig",
    "apply_plan",
    "checkpoint_blocks",
    "checkpoint_resnet",
    "find_units",
    "is_checkpointed",
    "rebuild_bn_relu",
    "remove_checkpointing",
    "remove_rebuild",
]
