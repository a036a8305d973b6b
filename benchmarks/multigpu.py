"""MemGuard and AccumulationTuner under DDP. Run on a machine with 2 GPUs (NCCL multicast variables as set there):

    python benchmarks/multigpu.py --out benchmarks/results/multigpu.json

ResNet50, bf16-mixed, channels_last, strategy="ddp", 2 GPUs:
1. MemGuard() + AccumulationTuner(effective_batch_size=512): every rank's choice, and the logged samples/s (all
   ranks together) against the sum of each rank's own;
2. overhead: the tuned configuration with and without MemGuard, interleaved, median step time (CUDA events);
3. SysmemSpillEmulator on rank 1 only: both ranks stop within 3 steps, SysmemSpillError with its own report on
   rank 1, no hang.
Every rank writes its own JSON; rank 0 merges them. `--smoke` runs a tiny version on 2 CPU processes (gloo).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
from lightning.pytorch import Trainer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_memguard import AccumulationTuner, MemGuard, SysmemSpillError  # noqa: E402
from lightning_memguard.testing import ImageClassifier, StepTimer, SysmemSpillEmulator  # noqa: E402


def trainer(args: argparse.Namespace, callbacks: list[Any], max_steps: int, **kwargs: Any) -> Trainer:
    return Trainer(
        accelerator="cpu" if args.smoke else "cuda", devices=2, strategy="ddp",
        precision="32-true" if args.smoke else "bf16-mixed",  # type: ignore[arg-type]
        max_steps=max_steps, max_epochs=1, callbacks=callbacks, logger=False, enable_progress_bar=False,
        enable_checkpointing=False, enable_model_summary=False, limit_val_batches=0, default_root_dir=args.tmp,
        **kwargs,
    )  # fmt: skip


def model(args: argparse.Namespace, batch: int, steps: int) -> ImageClassifier:
    if args.smoke:
        return ImageClassifier("resnet18", image_size=32, batch_size=batch, steps_per_epoch=steps, pool_size=32)
    return ImageClassifier("resnet50", image_size=224, num_classes=1000, batch_size=batch, steps_per_epoch=steps,
                           channels_last=True, pool_size=256)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/multigpu.json")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--tmp", default=os.path.join(os.getcwd(), ".multigpu_runs"))
    args = parser.parse_args()
    effective, steps, spill_batch, capacity = (32, 6, 16, "120MB") if args.smoke else (512, 60, 384, "16GB")
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    mine: dict[str, Any] = {"rank": rank}

    # 1. tuning under DDP, then training with MemGuard
    guard = MemGuard()
    tuner = AccumulationTuner(effective, min_micro_batch=8 if args.smoke else 32, cache=False)
    net = model(args, 64, 10_000)
    t = trainer(args, [guard, tuner], steps)
    t.fit(net)
    mine["choice"] = {"micro_batch": tuner.batch_size, "accumulate": tuner.accumulate_grad_batches}
    mine["trials"] = [r.to_dict() for r in tuner.results]
    mine["logged_samples_per_sec"] = float(t.callback_metrics["memguard/samples_per_sec"])
    mine["own_samples_per_sec"] = guard.epochs[-1].samples_per_sec
    micro, accumulate = tuner.batch_size or 64, tuner.accumulate_grad_batches or 1

    # 2. overhead of MemGuard in the tuned configuration
    mine["overhead"] = []
    for round_ in range(2):
        for guarded in (True, False) if round_ % 2 == 0 else (False, True):
            timer = StepTimer(skip=5)
            callbacks: list[Any] = [MemGuard(), timer] if guarded else [timer]
            trainer(args, callbacks, steps, accumulate_grad_batches=accumulate).fit(model(args, micro, 10_000))
            times = timer.step_ms(accumulate)
            mine["overhead"].append({"memguard": guarded, "median_step_ms": statistics.median(times)})

    # 3. a spill on rank 1 only
    emu = SysmemSpillEmulator(capacity=capacity if rank == 1 else "10TB")
    spill_guard = MemGuard(probe=emu.probe, warmup_steps=3)
    spill_trainer = trainer(args, [emu, spill_guard], 40)
    start = time.perf_counter()
    outcome: dict[str, Any] = {"error": None}
    try:
        spill_trainer.fit(model(args, spill_batch, 10_000))
    except SysmemSpillError as err:
        outcome = {"error": "SysmemSpillError", "own_report": err.report is not None, "message": str(err)[:300]}
    outcome["stopped_at_step"] = spill_trainer.global_step
    outcome["seconds"] = time.perf_counter() - start
    mine["spill_on_rank_1"] = outcome

    os.makedirs(args.tmp, exist_ok=True)
    with open(os.path.join(args.tmp, f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(mine, f, indent=2)
    if rank == 0:
        time.sleep(2)
        ranks = []
        for path in sorted(glob.glob(os.path.join(args.tmp, "rank*.json"))):
            with open(path, encoding="utf-8") as f:
                ranks.append(json.load(f))
        with_g = [r["median_step_ms"] for r in mine["overhead"] if r["memguard"]]
        without = [r["median_step_ms"] for r in mine["overhead"] if not r["memguard"]]
        summary = {
            "same_choice_on_every_rank": len({json.dumps(r["choice"], sort_keys=True) for r in ranks}) == 1,
            "choice": mine["choice"],
            "logged_samples_per_sec": mine["logged_samples_per_sec"],
            "sum_of_ranks_samples_per_sec": sum(r["own_samples_per_sec"] for r in ranks),
            "overhead_ratio": statistics.median(with_g) / statistics.median(without),
            "spill": {r["rank"]: r["spill_on_rank_1"] for r in ranks},
            "gpus": torch.cuda.device_count(),
        }
        print(json.dumps(summary, indent=2))
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"summary": summary, "ranks": ranks}, f, indent=2)


if __name__ == "__main__":
    main()
