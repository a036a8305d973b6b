"""Lightning callbacks: thin adapters between the Trainer and the pure core."""

from lightning_memguard.callbacks.checkpointing import ActivationCheckpointing
from lightning_memguard.callbacks.memguard import MemGuard

__all__ = ["ActivationCheckpointing", "MemGuard"]
