"""Tools for tests and demos, importable from users' own test suites."""

from lightning_memguard.testing.emulator import EmulatedProbe, SysmemSpillEmulator
from lightning_memguard.testing.models import ImageClassifier

__all__ = ["EmulatedProbe", "ImageClassifier", "SysmemSpillEmulator"]
