"""Let AccumulationTuner measure micro-batch x accumulation for an effective batch, then train with MemGuard.

python examples/tune_accumulation.py --effective-batch 256
"""

from __future__ import annotations

import argparse

import torch
from lightning.pytorch import Trainer

from lightning_memguard import AccumulationTuner, MemGuard
from lightning_memguard.testing import ImageClassifier


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--effective-batch", type=int, default=None)
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    effective = args.effective_batch or (256 if cuda else 32)
    model = ImageClassifier(
        "resnet50" if cuda else "resnet18", image_size=224 if cuda else 32, batch_size=effective,
        steps_per_epoch=20, channels_last=cuda,
    )  # fmt: skip
    tuner = AccumulationTuner(effective_batch_size=effective, min_micro_batch=8, cache=False)
    trainer = Trainer(
        accelerator="auto", devices=1, precision="bf16-mixed" if cuda else "32-true", max_epochs=args.epochs,
        callbacks=[MemGuard(), tuner], logger=False, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(model)
    print(f"chose micro-batch {tuner.batch_size} x accumulate_grad_batches {tuner.accumulate_grad_batches}")
    for row in tuner.results:
        print(f"  {row.size:>5} x {row.accumulate:<3} {row.outcome:<13} {row.samples_per_sec or 0:.1f} samples/s")


if __name__ == "__main__":
    main()
