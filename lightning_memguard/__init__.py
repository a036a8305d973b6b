"""lightning-memguard: PyTorch Lightning callbacks that keep GPU training fast and honest about memory."""

from lightning_memguard.callbacks import MemGuard
from lightning_memguard.core.detector import SysmemSpillError

__version__ = "0.1.0"
__all__ = ["MemGuard", "SysmemSpillError", "__version__"]
