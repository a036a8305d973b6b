"""Helpers for the tuner tests: a clock that moves only when a batch runs, so no test depends on this CPU's speed."""

from __future__ import annotations

import copy
from collections.abc import Callable

from conftest import FakeProbe
from lightning.pytorch import Callback
from lightning.pytorch.utilities.data import extract_batch_size

from lightning_memguard.checkpointing import is_checkpointed
from lightning_memguard.probes import MemoryReading


def ten_ms_and_one_per_sample(n: int) -> float:
    return 0.01 + 0.001 * n


class BatchClock(Callback):
    """Pass it as a tuner's ``clock`` and as a Trainer callback: each training batch of ``n`` samples takes
    ``seconds(n)`` of its time (default 10 ms + 1 ms per sample: throughput rises with the size, ever more slowly)."""

    memguard_keep_in_trials = True  # it runs inside the tuners' trials too

    def __init__(self, seconds: Callable[[int], float] | None = None) -> None:
        self.seconds = seconds or ten_ms_and_one_per_sample  # a module's function: it pickles (ddp_spawn)
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.now += self.seconds(extract_batch_size(batch))


class PerSample(FakeProbe):
    """Peak memory: ``per_sample`` bytes for each sample of the model's (or datamodule's) current batch size."""

    def __init__(self, holder, capacity=int(4e9), per_sample=100 * 10**6):
        super().__init__(capacity=capacity)
        self.holder, self.per_sample = holder, per_sample

    def read(self) -> MemoryReading:
        self.peak = self.holder.batch_size * self.per_sample
        return super().read()


class FirstBatch(Callback):
    """What the real run looks like at its first training batch, after tuning."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if hasattr(self, "epoch"):
            return
        self.epoch, self.global_step = trainer.current_epoch, trainer.global_step
        self.optim = copy.deepcopy(trainer.optimizers[0].state_dict())
        configs = trainer.lr_scheduler_configs
        self.scheduler = configs[0].scheduler.state_dict() if configs else None
        self.batch_samples = len(batch[0]) if isinstance(batch, list | tuple) else len(batch)
        self.checkpointed = any(is_checkpointed(m) for m in pl_module.modules())
        self.ckpt_path = trainer.ckpt_path
