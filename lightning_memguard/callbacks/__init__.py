"""Lightning callbacks: thin adapters between the Trainer and the pure core.

The top floor with the strategies: no wing imports this package (tests/project/test_import_graph.py). The names are
loaded on first use, so ``import lightning_memguard`` loads no callback until one is asked for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "AccumulationTuner": "lightning_memguard.callbacks.tuners",
    "ActivationCheckpointing": "lightning_memguard.callbacks.activation_checkpointing",
    "BatchSizeTuner": "lightning_memguard.callbacks.tuners",
    "MemGuard": "lightning_memguard.callbacks.memguard",
}

if TYPE_CHECKING:
    from lightning_memguard.callbacks.activation_checkpointing import ActivationCheckpointing as ActivationCheckpointing
    from lightning_memguard.callbacks.memguard import MemGuard as MemGuard
    from lightning_memguard.callbacks.tuners import AccumulationTuner as AccumulationTuner
    from lightning_memguard.callbacks.tuners import BatchSizeTuner as BatchSizeTuner

__all__ = ["AccumulationTuner", "ActivationCheckpointing", "BatchSizeTuner", "MemGuard"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'lightning_memguard.callbacks' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
