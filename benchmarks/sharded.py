"""Checkpointing under FSDPStrategy on one GPU: ours against FSDP's own switch, in the same run.

    python benchmarks/sharded.py --out benchmarks/results/sharded.json

ResNet50 at 224 px, bf16-mixed, batch 64, ``FSDPStrategy`` on one device. Rows, each trained 3 warm-up + 12 timed
steps, in turns over ``--rounds`` rounds (the order reversed every other round): no checkpointing;
``FSDPStrategy(activation_checkpointing_policy={Bottleneck})`` (what an FSDP user already has); our
``ActivationCheckpointing()`` (every block) and ``ActivationCheckpointing(memory_budget=0.6)``. Per row: the median
step time over the rounds' medians and the training step's forward-and-backward peak. ``--smoke``: a tiny version on
the CPU under ``ModelParallelStrategy`` (Lightning builds FSDPStrategy only on a GPU; there is no switch to compare
there), to check the script.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import StepPeak, environment, free_memory, make_trainer, write_json  # noqa: E402

from lightning_memguard import ActivationCheckpointing  # noqa: E402
from lightning_memguard.testing import ShardedClassifier, StepTimer  # noqa: E402

ROWS = ("plain", "fsdp_switch", "ours_every_block", "ours_budget_0.6")


def _strategy(row: str, smoke: bool) -> Any:
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
    from torchvision.models.resnet import Bottleneck

    if smoke:
        return ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
    return FSDPStrategy(activation_checkpointing_policy={Bottleneck}) if row == "fsdp_switch" else FSDPStrategy()


def run_row(row: str, args: argparse.Namespace) -> dict[str, Any]:
    if args.smoke and row == "fsdp_switch":
        return {"skipped": "no FSDPStrategy on the CPU"}
    batch, size, steps = (4, 32, 4) if args.smoke else (64, 224, 15)
    torch.manual_seed(0)
    arch = "resnet18" if args.smoke else "resnet50"
    model = ShardedClassifier(arch, image_size=size, batch_size=batch, steps_per_epoch=100, channels_last=False)
    model.example_input_array = model.images[:batch].clone()
    callbacks: list[Any] = []
    if row == "ours_every_block":
        callbacks.append(ActivationCheckpointing())
    elif row == "ours_budget_0.6":
        callbacks.append(ActivationCheckpointing(memory_budget=0.6))
    peak, timer = StepPeak(), StepTimer(skip=3)
    trainer = make_trainer([*callbacks, peak, timer], steps, args.tmp, strategy=_strategy(row, args.smoke))
    trainer.fit(model)
    out = {"step_ms": statistics.median(timer.step_ms()), "step_peak_bytes": max(peak.peaks, default=None)}
    del trainer, model
    free_memory()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/sharded.json")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--tmp", default=os.path.join(os.getcwd(), ".sharded_runs"))
    args = parser.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {row: [] for row in ROWS}
    for round_ in range(args.rounds):
        for row in ROWS if round_ % 2 == 0 else tuple(reversed(ROWS)):
            runs[row].append(run_row(row, args))
    summary = {}
    for row, results in runs.items():
        measured = [r for r in results if "skipped" not in r]
        if not measured:
            summary[row] = results[0]
            continue
        summary[row] = {
            "step_ms": round(statistics.median(r["step_ms"] for r in measured), 2),
            "step_peak_bytes": max(r["step_peak_bytes"] or 0 for r in measured) or None,
        }
    plain = summary["plain"]
    for row in ROWS[1:]:
        if "step_ms" in summary[row] and plain.get("step_peak_bytes") and summary[row]["step_peak_bytes"]:
            summary[row]["peak_vs_plain"] = round(summary[row]["step_peak_bytes"] / plain["step_peak_bytes"], 3)
            summary[row]["time_vs_plain"] = round(summary[row]["step_ms"] / plain["step_ms"], 3)
    print(summary)
    write_json(args.out, {"environment": environment(), "summary": summary, "runs": runs})


if __name__ == "__main__":
    main()
