"""A step timer for measurements: CUDA events on the GPU (no host sync), the host clock on the CPU."""

from __future__ import annotations

import time
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override


class StepTimer(Callback):
    """Marks every training batch's start (and the end of training); times are read after ``fit``.

    Args:
        skip: optimizer steps at the start left out of :meth:`step_ms` (warm-up).
    """

    def __init__(self, skip: int = 0) -> None:
        self.skip = skip
        self.marks: list[Any] = []

    def _mark(self) -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._mark()

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._mark()

    def batch_ms(self) -> list[float]:
        """Every batch's time in milliseconds, warm-up included."""
        pairs = list(zip(self.marks[:-1], self.marks[1:], strict=True))
        if pairs and isinstance(pairs[0][0], torch.cuda.Event):
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in pairs]
        return [(b - a) * 1e3 for a, b in pairs]

    def step_ms(self, accumulate: int = 1) -> list[float]:
        """Optimizer-step times after the first ``skip`` steps (``accumulate`` batches make one step)."""
        times = self.batch_ms()
        steps = [sum(times[i : i + accumulate]) for i in range(0, len(times) - accumulate + 1, accumulate)]
        return steps[self.skip :]
