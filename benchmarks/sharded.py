"""Checkpointing under FSDPStrategy on one GPU: ours against FSDP's own switch, in the same run.

    python benchmarks/sharded.py --out benchmarks/results/sharded.json

ResNet50 at 224 px, bf16-mixed, batch 128, ``FSDPStrategy`` on one device. Rows, each trained 5 warm-up + 25 timed
steps, in turns over ``--rounds`` rounds (the order reversed every other round): no checkpointing;
``FSDPStrategy(activation_checkpointing_policy={Bottleneck})`` (what an FSDP user already has); our
``ActivationCheckpointing()`` (every block), ``ActivationCheckpointing(memory_budget=0.6)``, and
``ActivationCheckpointing(memory_budget=B)`` with B the switch's own peak against the plain row's, as measured in the
first round (ours at the switch's memory: the like-for-like comparison). Per row: the median step time over the
rounds' medians and the training step's forward-and-backward peak. ``--smoke``: a tiny version on
the CPU under ``ModelParallelStrategy`` (Lightning builds FSDPStrategy only on a GPU; there is no switch to compare
there), to check the script.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import StepPeak, environment, free_memory, make_trainer, median, write_json  # noqa: E402

from lightning_memguard import ActivationCheckpointing  # noqa: E402
from lightning_memguard.testing import ShardedClassifier, StepTimer  # noqa: E402

ROWS = ("plain", "fsdp_switch", "ours_every_block", "ours_budget_0.6", "ours_at_switch_memory")


def _strategy(row: str, smoke: bool) -> Any:
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
    from torchvision.models.resnet import Bottleneck

    if smoke:
        return ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
    return FSDPStrategy(activation_checkpointing_policy={Bottleneck}) if row == "fsdp_switch" else FSDPStrategy()


def run_row(row: str, args: argparse.Namespace, switch_share: float | None) -> dict[str, Any]:
    """One fit of ``row``; ``switch_share`` is the switch's peak as a share of the plain row's (None before known,
    or on the CPU, where the budget row of that name takes 0.5)."""
    if args.smoke and row == "fsdp_switch":
        return {"skipped": "no FSDPStrategy on the CPU"}
    batch, size, steps, warmup = (4, 32, 4, 3) if args.smoke else (128, 224, 30, 5)
    torch.manual_seed(0)
    arch = "resnet18" if args.smoke else "resnet50"
    model = ShardedClassifier(arch, image_size=size, batch_size=batch, steps_per_epoch=100, channels_last=False)
    model.example_input_array = model.images[:batch].clone()
    callbacks: list[Any] = []
    if row == "ours_every_block":
        callbacks.append(ActivationCheckpointing())
    elif row == "ours_budget_0.6":
        callbacks.append(ActivationCheckpointing(memory_budget=0.6))
    elif row == "ours_at_switch_memory":
        callbacks.append(ActivationCheckpointing(memory_budget=switch_share or 0.5))
    peak, timer = StepPeak(), StepTimer(skip=warmup)
    trainer = make_trainer([*callbacks, peak, timer], steps, args.tmp, strategy=_strategy(row, args.smoke))
    trainer.fit(model)
    out = {"step_ms": median(timer.step_ms()), "step_peak_bytes": max(peak.peaks, default=None)}
    if row == "ours_at_switch_memory":
        out["memory_budget"] = switch_share or 0.5
    del trainer, model
    free_memory()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/sharded.json")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--tmp", default=os.path.join(os.getcwd(), ".sharded_runs"))
    args = parser.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {row: [] for row in ROWS}
    switch_share = None  # the first round runs plain and the switch before the row that takes their ratio
    for round_ in range(args.rounds):
        for row in ROWS if round_ % 2 == 0 else tuple(reversed(ROWS)):
            runs[row].append(run_row(row, args, switch_share))
            first = runs["plain"][:1] + runs["fsdp_switch"][:1]
            if switch_share is None and len(first) == 2 and "step_peak_bytes" in first[1]:
                switch_share = round(first[1]["step_peak_bytes"] / first[0]["step_peak_bytes"], 3)
    summary = {}
    for row, results in runs.items():
        measured = [r for r in results if "skipped" not in r]
        if not measured:
            summary[row] = results[0]
            continue
        summary[row] = {
            "step_ms": round(median([r["step_ms"] for r in measured]), 2),
            "step_peak_bytes": max(r["step_peak_bytes"] or 0 for r in measured) or None,
        }
        if "memory_budget" in measured[0]:
            summary[row]["memory_budget"] = measured[0]["memory_budget"]
    plain = summary["plain"]
    for row in ROWS[1:]:
        if "step_ms" in summary[row] and plain.get("step_peak_bytes") and summary[row]["step_peak_bytes"]:
            summary[row]["peak_vs_plain"] = round(summary[row]["step_peak_bytes"] / plain["step_peak_bytes"], 3)
            summary[row]["time_vs_plain"] = round(summary[row]["step_ms"] / plain["step_ms"], 3)
    print(summary)
    write_json(args.out, {"environment": environment(), "summary": summary, "runs": runs})


if __name__ == "__main__":
    main()
