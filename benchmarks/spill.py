"""Spill detection on a real GPU. Run on a CUDA machine:

    python benchmarks/spill.py --out benchmarks/results/spill.json

ResNet50, bf16-mixed, channels_last, Lightning Trainer:
1. an emulated 16 GB card with sysmem fallback (SysmemSpillEmulator: saved activations beyond 16 GB go to pinned
   host memory), batches 64..512, MemGuard(on_spill="warn") so each run goes on: the step at which MemGuard
   called the spill and the throughput of the run; then one run with the default on_spill="raise";
2. the card as it is (no emulator), batches 32..2048: MemGuard must raise no alarm;
3. MemGuard(capacity="16GB", prevent=True), no emulator: a batch that would spill fails with an immediate OOM.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import environment, free_memory, make_trainer, median, write_json  # noqa: E402

from lightning_memguard import MemGuard, SysmemSpillError  # noqa: E402
from lightning_memguard.testing import ImageClassifier, StepTimer, SysmemSpillEmulator  # noqa: E402

WARMUP = 3


def model(batch: int, steps: int) -> ImageClassifier:
    return ImageClassifier(
        "resnet50",
        image_size=224,
        batch_size=batch,
        steps_per_epoch=steps + 1,
        channels_last=True,
        pool_size=256,
        num_classes=1000,
    )


def emulated(batch: int, steps: int, root: str, on_spill: str) -> dict[str, Any]:
    free_memory()
    emu = SysmemSpillEmulator(capacity="16GB")
    guard = MemGuard(probe=emu.probe, on_spill=on_spill, warmup_steps=WARMUP)
    timer = StepTimer(skip=WARMUP)
    row: dict[str, Any] = {"batch": batch, "on_spill": on_spill, "error": None}
    start = time.perf_counter()
    try:
        make_trainer([emu, guard, timer], steps, root).fit(model(batch, steps))
    except SysmemSpillError as err:
        row["error"] = type(err).__name__
        row["message_head"] = str(err).splitlines()[0]
        row["stopped_at_step"] = err.report.step if err.report else None
    row["wall_s"] = time.perf_counter() - start
    times = timer.step_ms()
    row["median_step_ms"] = median(times)
    row["samples_per_sec"] = batch / (median(times) / 1e3) if times else None
    row["spilled_gb_per_step"] = emu.spilled_bytes / 1e9
    row["detected_at_step"] = guard.spill.step if guard.spill else None
    row["reference_samples_per_sec"] = guard.spill.reference_rate if guard.spill else None
    row["current_samples_per_sec"] = guard.spill.current_rate if guard.spill else None
    row["reported_peak_gb"] = guard.spill.used_bytes / 1e9 if guard.spill else None
    return row


def plain(batch: int, steps: int, root: str) -> dict[str, Any]:
    free_memory()
    guard = MemGuard(warmup_steps=WARMUP)
    timer = StepTimer(skip=WARMUP)
    make_trainer([guard, timer], steps, root).fit(model(batch, steps))
    times = timer.step_ms()
    return {
        "batch": batch,
        "alarm": guard.spill is not None,
        "median_step_ms": median(times),
        "samples_per_sec": batch / (median(times) / 1e3),
        "peak_allocated_gb": guard.epochs[-1].peak_allocated_gb,
        "capacity_gb": guard.epochs[-1].capacity_gb,
    }


def prevented(batch: int, root: str) -> dict[str, Any]:
    free_memory()
    guard = MemGuard(capacity="16GB", prevent=True)
    row: dict[str, Any] = {"batch": batch, "error": None}
    start = time.perf_counter()
    try:
        make_trainer([guard], 5, root).fit(model(batch, 5))
    except torch.OutOfMemoryError as err:
        row["error"] = "OutOfMemoryError"
        row["explained"] = "MemGuard(prevent=True) capped PyTorch" in str(err)
    row["seconds_to_outcome"] = time.perf_counter() - start
    torch.cuda.set_per_process_memory_fraction(1.0)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/spill.json")
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    root = tempfile.mkdtemp()
    result: dict[str, Any] = {"environment": environment(), "config": vars(args)}
    result["emulated_16gb"] = []
    for batch in (64, 128, 256, 320, 384, 448, 512):
        row = emulated(batch, args.steps, root, "warn")
        print(row, flush=True)
        result["emulated_16gb"].append(row)
    result["emulated_16gb_raise"] = emulated(384, args.steps, root, "raise")
    print(result["emulated_16gb_raise"], flush=True)
    result["no_emulator"] = []
    for batch in (32, 64, 128, 256, 512, 1024, 2048):
        row = plain(batch, args.steps, root)
        print(row, flush=True)
        result["no_emulator"].append(row)
    result["prevent_16gb"] = [prevented(b, root) for b in (256, 384)]
    print(result["prevent_16gb"], flush=True)
    write_json(args.out, result)


if __name__ == "__main__":
    main()
