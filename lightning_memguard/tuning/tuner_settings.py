"""The settings both tuners share, declared once and checked once: what they measure against and how."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lightning_memguard.core.checks import (
    MIN_CAPACITY,
    PROBE_NEEDS,
    check_bool,
    check_callable,
    check_fraction,
    check_instance,
    check_int,
    check_size,
)
from lightning_memguard.tuning.cache import cache_folder
from lightning_memguard.tuning.search import TrialResult

if TYPE_CHECKING:
    from lightning_memguard.probes.base import MemoryProbe


@dataclass
class TunerSettings:
    """``BatchSizeTuner``'s and ``AccumulationTuner``'s shared arguments, as their docstrings describe them; checked
    on construction (``ValueError`` / ``TypeError`` naming the argument), ``capacity`` read into bytes and
    ``cache_dir`` into a folder (``~`` expanded, the default filled in). A tuner reads and sets each one as an
    attribute of its own (``tuner.probe``).

    Example:
        >>> TunerSettings(headroom=0.1).headroom
        0.1
        >>> TunerSettings(timed_steps=0)
        Traceback (most recent call last):
        ...
        ValueError: `timed_steps` must be >= 1, got 0
    """

    capacity: int | str | None = None
    headroom: float = 0.05
    probe: MemoryProbe | None = None
    batch_arg_name: str = "batch_size"
    warmup_steps: int = 2
    timed_steps: int = 4
    min_gain: float = 0.05
    tolerance: float = 0.01
    cache: bool = True
    cache_dir: str | os.PathLike[str] | None = None
    clock: Callable[[], float] | None = None
    predict: bool = True
    on_trial: Callable[[TrialResult], None] | None = None

    def __post_init__(self) -> None:
        self.capacity = None if self.capacity is None else check_size("capacity", self.capacity, MIN_CAPACITY)
        if self.probe is not None:
            from lightning_memguard.probes.base import MemoryProbe  # here: the probes package loads Lightning Fabric

            check_instance("probe", self.probe, MemoryProbe, PROBE_NEEDS)
        if not isinstance(self.batch_arg_name, str):
            raise TypeError(f"`batch_arg_name` must be a string, got {self.batch_arg_name!r}")
        if not self.batch_arg_name:
            raise ValueError(f"`batch_arg_name` must be a non-empty string, got {self.batch_arg_name!r}")
        check_bool("cache", self.cache)
        check_bool("predict", self.predict)
        cache_dir = self.cache_dir
        if cache_dir is not None and not isinstance(cache_dir, str | os.PathLike):
            raise TypeError(f"`cache_dir` must be a path (str or os.PathLike) or None, got {cache_dir!r}")
        if cache_dir is not None and not os.fspath(cache_dir):
            raise ValueError(f"`cache_dir` must be a non-empty path or None, got {cache_dir!r}")
        check_callable("clock", self.clock, "a callable returning seconds,", optional=True)
        check_callable("on_trial", self.on_trial, "a callable taking a TrialResult,", optional=True)
        self.headroom = check_fraction("headroom", self.headroom)
        self.warmup_steps = check_int("warmup_steps", self.warmup_steps, 0)
        self.timed_steps = check_int("timed_steps", self.timed_steps, 1)
        self.min_gain = check_fraction("min_gain", self.min_gain)
        self.tolerance = check_fraction("tolerance", self.tolerance)
        self.cache_dir = cache_folder(cache_dir)  # `~` expanded
