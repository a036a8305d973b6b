"""Tools for users' own test suites: the spill emulator, a small image classifier and a step timer.

They live in :mod:`lightning_memguard.emulation`, which the commands (``memguard demo``, ``sweep``, ``plan``) use too;
this package is their public name for tests.
"""

from lightning_memguard.emulation.emulator import EmulatedProbe, SysmemSpillEmulator
from lightning_memguard.emulation.models import ImageClassifier, ShardedClassifier
from lightning_memguard.emulation.timing import StepTimer

__all__ = ["EmulatedProbe", "ImageClassifier", "ShardedClassifier", "StepTimer", "SysmemSpillEmulator"]
