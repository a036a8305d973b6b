"""Measured choices against an exhaustive sweep. Run on a CUDA machine:

    python benchmarks/tuners.py --out benchmarks/results/tuners.json

ResNet50, bf16-mixed, channels_last, Lightning Trainer, one call:
1. oracle: every batch size of the ladder 32..2048 trained for 3 warm-up + 12 timed steps (CUDA events, median);
   BatchSizeTuner on the same ladder: its choice's oracle throughput against the oracle's best, and the wall time
   of its search against the sweep's (a choice off the ladder, e.g. the forecast's largest fit, is measured the
   oracle's way too);
2. the same on an emulated 16 GB card with sysmem fallback (SysmemSpillEmulator), up to 512, with Lightning's
   BatchSizeFinder (power mode, 4 trials from 64) run the same way beside ours;
3. AccumulationTuner at effective batch 256 and 1024, with and without the 16 GB emulation, against an oracle
   that measures every micro-batch x accumulation split.
`--smoke` runs a tiny version on the CPU to check the script.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

from lightning.pytorch.callbacks import BatchSizeFinder

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import environment, free_memory, make_trainer, median, write_json  # noqa: E402

from lightning_memguard import AccumulationTuner, BatchSizeTuner  # noqa: E402
from lightning_memguard.testing import ImageClassifier, StepTimer, SysmemSpillEmulator  # noqa: E402
from lightning_memguard.tuning.search import accumulation_candidates, power_ladder  # noqa: E402

CFG: dict[str, Any] = {"arch": "resnet50", "image_size": 224, "num_classes": 1000, "channels_last": True}


def model(batch: int, steps: int = 64) -> ImageClassifier:
    return ImageClassifier(batch_size=batch, steps_per_epoch=steps, pool_size=256, **CFG)


def measure(batch: int, accumulate: int, warmup: int, timed: int, root: str, capacity: str | None) -> dict[str, Any]:
    """One oracle point: samples/s of optimizer steps, and whether the emulated card spilled."""
    free_memory()
    timer = StepTimer(skip=warmup)
    callbacks: list[Any] = [timer]
    emu = SysmemSpillEmulator(capacity=capacity) if capacity else None
    if emu is not None:
        callbacks.insert(0, emu)
    steps = warmup + timed
    trainer = make_trainer(callbacks, steps, root, accumulate_grad_batches=accumulate)
    trainer.fit(model(batch, steps * accumulate + 1))
    step_ms = median(timer.step_ms(accumulate))
    spilled = bool(emu is not None and emu.total_spilled_bytes > 0)
    peak = emu.probe.read().peak_allocated if emu is not None else None
    return {
        "batch": batch,
        "accumulate": accumulate,
        "step_ms": step_ms,
        "samples_per_sec": batch * accumulate / step_ms * 1e3,
        "spilled": spilled,
        "peak_gb": peak / 1e9 if peak is not None else None,
        # the tuners' rule: no spill, and 5 % of the card left free
        "fits": not spilled and (emu is None or peak <= emu.capacity * 0.95),
    }


class Timed:
    """Wraps a callback's on_fit_start to time it; stops training right after it."""

    def __init__(self, callback: Any) -> None:
        self.callback = callback
        self.seconds = 0.0
        original = callback.on_fit_start

        def on_fit_start(trainer: Any, pl_module: Any) -> None:
            start = time.perf_counter()
            original(trainer, pl_module)
            self.seconds = time.perf_counter() - start

        callback.on_fit_start = on_fit_start


def run_tuner(make: Any, root: str, capacity: str | None, batch: int = 32) -> tuple[Any, float, int]:
    """Fit with one tuning callback, built by ``make(probe)`` (the emulator's probe on an emulated card)."""
    free_memory()
    emu = SysmemSpillEmulator(capacity=capacity) if capacity else None
    callback = make(emu.probe if emu is not None else None)
    timed = Timed(callback)
    callbacks: list[Any] = [callback] if emu is None else [emu, callback]
    m = model(batch)
    make_trainer(callbacks, 1, root).fit(m)
    return callback, timed.seconds, m.batch_size


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/tuners.json")
    parser.add_argument("--smoke", action="store_true", help="a tiny CPU run that checks the script")
    args = parser.parse_args()
    top, emu_top, warmup, timed = 2048, 512, 3, 12
    effectives = (256, 1024)
    capacity = "16GB"
    if args.smoke:
        CFG.update(arch="resnet18", image_size=32, num_classes=10, channels_last=False)
        top, emu_top, warmup, timed, effectives, capacity = 32, 32, 1, 2, (32,), "150MB"
    root = tempfile.mkdtemp()
    result: dict[str, Any] = {"environment": environment(), "config": {"top": top, "warmup": warmup, "timed": timed}}

    for label, cap, limit in (("clean", None, top), ("emulated_16gb", capacity, emu_top)):
        start = time.perf_counter()
        sweep = [measure(b, 1, warmup, timed, root, cap) for b in power_ladder(32 if not args.smoke else 4, limit)]
        sweep_s = time.perf_counter() - start
        for row in sweep:
            print(label, row, flush=True)
        fitting = [r for r in sweep if r["fits"]]
        best = max(fitting, key=lambda r: r["samples_per_sec"])
        by_size = {r["batch"]: r for r in sweep}
        init = 32 if not args.smoke else 4
        ours, ours_s, chosen = run_tuner(
            lambda probe, init=init, limit=limit: BatchSizeTuner(
                init_size=init, max_size=limit, cache=False, probe=probe
            ),
            root,
            cap,
        )
        if chosen not in by_size:  # a size between the ladder's (the forecast's largest fit): measured the same way
            by_size[chosen] = measure(chosen, 1, warmup, timed, root, cap)
            print(label, "off the ladder", by_size[chosen], flush=True)
        entry: dict[str, Any] = {
            "sweep": sweep,
            "chosen_off_ladder": by_size[chosen] if chosen not in {r["batch"] for r in sweep} else None,
            "sweep_seconds": sweep_s,
            "oracle_best": best,
            "ours": {
                "batch_size": chosen,
                "trials": [r.to_dict() for r in ours.results],
                "search_seconds": ours_s,
                "search_cost_vs_sweep": ours_s / sweep_s,
                "oracle_samples_per_sec": by_size.get(chosen, {}).get("samples_per_sec"),
                "fraction_of_oracle_best": (by_size.get(chosen, {}).get("samples_per_sec") or 0)
                / best["samples_per_sec"],
                "spills": by_size.get(chosen, {}).get("spilled"),
            },
        }
        if cap is not None:
            finder = BatchSizeFinder(mode="power", init_val=64 if not args.smoke else 4, max_trials=4)
            _, finder_s, finder_size = run_tuner(lambda probe, finder=finder: finder, root, cap)
            point = by_size.get(finder_size) or measure(finder_size, 1, warmup, timed, root, cap)
            entry["lightning_batch_size_finder"] = {
                "batch_size": finder_size,
                "search_seconds": finder_s,
                "samples_per_sec": point["samples_per_sec"],
                "spills": point["spilled"],
            }
        result[f"batch_size_{label}"] = entry
        write_json(args.out, result)  # each part as it is done: a cut-off run still leaves its results
        print(label, {k: v for k, v in entry.items() if k != "sweep"}, flush=True)

    for cap in (None, capacity):
        for effective in effectives:
            pairs = accumulation_candidates(effective, 32 if not args.smoke else 4)
            oracle = [measure(m, k, 2, 5, root, cap) for m, k in pairs]
            fitting = [r for r in oracle if r["fits"]]
            best = max(fitting, key=lambda r: r["samples_per_sec"]) if fitting else None
            micro = 32 if not args.smoke else 4
            tuner, seconds, _ = run_tuner(
                lambda probe, e=effective, m=micro: AccumulationTuner(e, min_micro_batch=m, cache=False, probe=probe),
                root,
                cap,
            )
            chosen = next((r for r in oracle if r["batch"] == tuner.batch_size), None)
            key = f"accumulation_{effective}_{'emulated_16gb' if cap else 'clean'}"
            result[key] = {
                "oracle": oracle,
                "oracle_best": best,
                "ours": {
                    "micro_batch": tuner.batch_size,
                    "accumulate_grad_batches": tuner.accumulate_grad_batches,
                    "trials": [r.to_dict() for r in tuner.results],
                    "search_seconds": seconds,
                    "oracle_samples_per_sec": chosen["samples_per_sec"] if chosen else None,
                    "fraction_of_oracle_best": chosen["samples_per_sec"] / best["samples_per_sec"]
                    if chosen and best
                    else None,
                },
            }
            print(key, result[key]["ours"], best, flush=True)
            write_json(args.out, result)


if __name__ == "__main__":
    main()
