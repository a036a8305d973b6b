"""The main job: a short training run with MemGuard, on the GPU if there is one, else on the CPU."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger
from typing_extensions import override

from lightning_memguard.callbacks import MemGuard
from lightning_memguard.emulation.models import ImageClassifier


@dataclass(frozen=True)
class DemoConfig:
    arch: str
    image_size: int
    batch_size: int
    precision: str
    channels_last: bool
    steps_per_epoch: int
    epochs: int


CUDA_DEMO = DemoConfig("resnet50", 224, 128, "bf16-mixed", True, 60, 3)
CPU_DEMO = DemoConfig("resnet18", 32, 32, "32-true", False, 15, 3)


def _say(text: str) -> None:
    print(f"memguard demo: {text}", flush=True)  # at once, also where stdout is a pipe or a file


class _Progress(Callback):
    """A line when the first step is done (it carries the start-up: the first kernels, CUDA's), one at least every
    ``every_s`` seconds within an epoch and one per epoch, so that the demo is never silent for long, with or without
    a terminal for Lightning's progress bar."""

    def __init__(self, every_s: float = 10.0, clock: Callable[[], float] = time.perf_counter) -> None:
        self.every_s, self.clock = every_s, clock
        self._started = self._said = 0.0

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._started = self._said = self.clock()

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = self.clock()
        if trainer.current_epoch == 0 and batch_idx == 0:
            _say(f"first step done in {now - self._started:.1f} s (it carries the start-up)")
        elif now - self._said >= self.every_s:
            _say(f"epoch {trainer.current_epoch + 1} of {trainer.max_epochs}: step {batch_idx + 1} of"
                 f" {trainer.num_training_batches}")  # fmt: skip
        else:
            return
        self._said = now

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        steps = trainer.fit_loop.epoch_loop.batch_progress.current.completed
        took = self.clock() - self._started
        _say(f"epoch {trainer.current_epoch + 1} of {trainer.max_epochs}: {_count(steps, 'step')} in {took:.1f} s")


def _count(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def run_demo(device: str = "auto", epochs: int | None = None, out_dir: str = "demo_logs") -> MemGuard:
    """Train a torchvision ResNet on synthetic images with :class:`MemGuard` and print its table.

    On CUDA: ResNet50, bf16-mixed, channels_last, batch 128 at 224 px. On the CPU: ResNet18 at 32 px, batch 32,
    well under two minutes on two cores.
    """
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"`device` must be 'auto', 'cpu' or 'cuda', got {device!r}")
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    cfg = CUDA_DEMO if use_cuda else CPU_DEMO
    epochs = cfg.epochs if epochs is None else epochs
    _say(
        f"{cfg.arch}, batch {cfg.batch_size}, {cfg.image_size} px, {cfg.precision}"
        f"{', channels_last' if cfg.channels_last else ''}, {_count(epochs, 'epoch')} of {cfg.steps_per_epoch} steps"
        f" on {'CUDA' if use_cuda else 'the CPU'}; then MemGuard's table"
    )
    seed_everything(0, verbose=False)
    model = ImageClassifier(
        cfg.arch,
        image_size=cfg.image_size,
        batch_size=cfg.batch_size,
        steps_per_epoch=cfg.steps_per_epoch,
        channels_last=cfg.channels_last,
        pool_size=max(64, cfg.batch_size),
    )
    guard = MemGuard()
    trainer = Trainer(
        accelerator="cuda" if use_cuda else "cpu",
        devices=1,
        precision=cfg.precision,  # type: ignore[arg-type]
        max_epochs=epochs,
        callbacks=[guard, _Progress()],
        logger=CSVLogger(out_dir, name="memguard-demo"),
        enable_checkpointing=False,
        enable_model_summary=False,
        limit_val_batches=0,
        log_every_n_steps=10,
    )
    trainer.fit(model)
    assert trainer.logger is not None and trainer.logger.log_dir is not None
    print(f"metrics: {os.path.join(trainer.logger.log_dir, 'metrics.csv')}")
    return guard
