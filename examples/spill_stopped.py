"""See MemGuard stop a run that spills, on any machine: an emulated card too small for the run. On a GPU the batch
does not fit it; on the CPU (100 MB) not even the weights, gradients and momentum do, and the message says what can
help there (a lighter optimizer state, a smaller model, sharding), not a smaller batch or checkpointing.

python examples/spill_stopped.py              # CPU or GPU, whichever is here
python examples/spill_stopped.py --capacity 16GB --batch 384   # the write-up's cliff, on a large GPU
python examples/spill_stopped.py --out spill_run   # keep the checkpoint MemGuard writes before it stops the run

Without ``--out`` the run's folder (MemGuard's spill checkpoint, about 90 MB on the CPU) is a temporary one, removed
when the example ends.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from lightning.pytorch import Trainer

from lightning_memguard import MemGuard, SysmemSpillError
from lightning_memguard.testing import ImageClassifier, SysmemSpillEmulator


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--capacity", default=None, help="emulated card size; default: a bit less than the run needs")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--out", default=None, help="the run's folder, kept; default: a temporary one, removed")
    args = parser.parse_args()
    if args.out is None:
        with tempfile.TemporaryDirectory(prefix="memguard-spill-example-", ignore_cleanup_errors=True) as folder:
            run(args, folder)
        print(f"(the run's folder, {folder}, was a temporary one: removed now, checkpoint and all; --out DIR keeps it)")
    else:
        run(args, args.out)


def run(args: argparse.Namespace, folder: str) -> None:
    cuda = torch.cuda.is_available()
    batch = args.batch or (128 if cuda else 16)
    capacity = args.capacity or ("4GB" if cuda else "100MB")
    model = ImageClassifier(
        "resnet50" if cuda else "resnet18", image_size=224 if cuda else 32, batch_size=batch, steps_per_epoch=50,
        channels_last=cuda,
    )  # fmt: skip
    emu = SysmemSpillEmulator(capacity=capacity)
    trainer = Trainer(
        accelerator="auto", devices=1, precision="bf16-mixed" if cuda else "32-true", max_epochs=1,
        callbacks=[emu, MemGuard(probe=emu.probe)], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, default_root_dir=folder,
    )  # fmt: skip
    try:
        trainer.fit(model)
        print(f"no spill: batch {batch} fits in {capacity}")
    except SysmemSpillError as err:
        print(f"stopped at step {trainer.global_step}:\n{err}")


if __name__ == "__main__":
    main()
