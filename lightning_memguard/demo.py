"""The main job: a short training run with MemGuard, on the GPU if there is one, else on the CPU."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger

from lightning_memguard.callbacks import MemGuard
from lightning_memguard.testing.models import ImageClassifier


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
        callbacks=[guard],
        logger=CSVLogger(out_dir, name="memguard-demo"),
        enable_checkpointing=False,
        enable_model_summary=False,
        limit_val_batches=0,
        log_every_n_steps=10,
    )
    print(
        f"memguard demo: {cfg.arch}, batch {cfg.batch_size}, {cfg.image_size}px, {cfg.precision}"
        f"{', channels_last' if cfg.channels_last else ''}, {epochs} epochs on {'CUDA' if use_cuda else 'the CPU'}"
    )
    trainer.fit(model)
    assert trainer.logger is not None and trainer.logger.log_dir is not None
    print(f"metrics: {os.path.join(trainer.logger.log_dir, 'metrics.csv')}")
    return guard
