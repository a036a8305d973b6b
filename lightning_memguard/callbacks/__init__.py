"""Lightning callbacks: thin adapters between the Trainer and the pure core."""

from lightning_memguard.callbacks.checkpointing import ActivationCheckpointing
from lightning_memguard.callbacks.memguard import MemGuard
from lightning_memguard.callbacks.tuners import AccumulationTuner, BatchSizeTuner

__all__ = ["AccumulationTuner", "ActivationCheckpointing", "BatchSizeTuner", "MemGuard"]
