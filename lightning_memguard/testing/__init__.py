"""Tools for tests, demos and measurements, importable from users' own test suites."""

from lightning_memguard.testing.emulator import EmulatedProbe, SysmemSpillEmulator
from lightning_memguard.testing.models import ImageClassifier, ShardedClassifier
from lightning_memguard.testing.timing import StepTimer

__all__ = ["EmulatedProbe", "ImageClassifier", "ShardedClassifier", "StepTimer", "SysmemSpillEmulator"]
