"""Activation checkpointing for block-structured models, BatchNorm-correct."""

from lightning_memguard.checkpointing.entrances import apply_plan, checkpoint_blocks, checkpoint_resnet
from lightning_memguard.checkpointing.families import find_units
from lightning_memguard.checkpointing.recipes import RebuildConfig
from lightning_memguard.checkpointing.result import CheckpointPlan
from lightning_memguard.checkpointing.surgery import rebuild_bn_relu, remove_checkpointing, remove_rebuild
from lightning_memguard.checkpointing.wrap import is_checkpointed

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
