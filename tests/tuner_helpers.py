"""Helpers for the tuner tests: a clock that moves only when a batch runs, so no test depends on this CPU's speed."""

from __future__ import annotations

from collections.abc import Callable

from lightning.pytorch import Callback
from lightning.pytorch.utilities.data import extract_batch_size


class BatchClock(Callback):
    """Pass it as a tuner's ``clock`` and as a Trainer callback: each training batch of ``n`` samples takes
    ``seconds(n)`` of its time (default 10 ms + 1 ms per sample: throughput rises with the size, ever more slowly)."""

    memguard_keep_in_trials = True  # it runs inside the tuners' trials too

    def __init__(self, seconds: Callable[[int], float] | None = None) -> None:
        self.seconds = seconds or (lambda n: 0.01 + 0.001 * n)
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.now += self.seconds(extract_batch_size(batch))
