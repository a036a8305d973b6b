"""Activation checkpointing beyond ResNets, on a real GPU. Run on a CUDA machine:

    python benchmarks/checkpointing_zoo.py --out benchmarks/results/checkpointing_zoo.json

mobilenet_v2, efficientnet_b0, convnext_tiny (channels_last) and vit_b_16; bf16 autocast, SGD, random data on the
device, a plain PyTorch loop (``checkpointing.train_steps``: CUDA-event median step, peak
``torch.cuda.max_memory_allocated()`` over the timed steps). Each model's batch is sized so that its plain training
peak is about 12 GB (measured at batch 32, scaled, rounded to 16). Configurations: no checkpointing; every block
found by ``units="auto"`` checkpointed; a memory budget of 0.6 of the un-checkpointed peak of one pass.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch
import torchvision
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import environment, free_memory, write_json  # noqa: E402
from checkpointing import train_steps  # noqa: E402

from lightning_memguard.checkpointing import checkpoint_blocks  # noqa: E402

MODELS = {"mobilenet_v2": True, "efficientnet_b0": True, "convnext_tiny": True, "vit_b_16": False}  # channels_last
TARGET_BYTES = 12 * 10**9


def make_model(name: str, channels_last: bool) -> nn.Module:
    torch.manual_seed(0)
    model = torchvision.models.get_model(name, weights=None, num_classes=1000).cuda()
    return model.to(memory_format=torch.channels_last) if channels_last else model


def batches(size: int, channels_last: bool, count: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    return [
        (
            torch.randn(size, 3, 224, 224, device="cuda").contiguous(memory_format=fmt),
            torch.randint(0, 1000, (size,), device="cuda"),
        )
        for _ in range(count)
    ]


def measure(name: str, channels_last: bool, config: str, size: int, steps: int, warmup: int) -> dict[str, Any]:
    model = make_model(name, channels_last)
    data = batches(size, channels_last)
    row: dict[str, Any] = {"model": name, "config": config, "batch": size}
    if config == "every_block":
        plan = checkpoint_blocks(model)
        row["blocks"] = len(plan.blocks)
    elif config == "budget_0.6":
        with torch.autocast("cuda", dtype=torch.bfloat16):
            plan = checkpoint_blocks(model, memory_budget=0.6, example_input=data[0][0])
        row.update(blocks=len(plan.blocks), candidates=plan.candidates, runs=len(plan.runs), held=plan.held)
        row.update(budget_gb=plan.budget_bytes / 1e9, measured_pass_gb=plan.measured_bytes / 1e9)  # type: ignore[operator]
    row.update(train_steps(model, model, data, steps=steps, warmup=warmup))
    row["img_s"] = size / (row["median_step_ms"] / 1e3)
    del model, data
    free_memory()
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/checkpointing_zoo.json")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    torch.backends.cudnn.benchmark = True
    rows = []
    for name, channels_last in MODELS.items():
        probe = measure(name, channels_last, "plain", 32, steps=2, warmup=2)
        size = max(16, int(32 * TARGET_BYTES / (probe["peak_gb"] * 1e9)) // 16 * 16)
        plain = measure(name, channels_last, "plain", size, args.steps, args.warmup)
        rows.append(plain)
        for config in ("every_block", "budget_0.6"):
            row = measure(name, channels_last, config, size, args.steps, args.warmup)
            row["memory_saved"] = 1 - row["peak_gb"] / plain["peak_gb"]
            row["throughput_cost"] = 1 - row["img_s"] / plain["img_s"]
            rows.append(row)
        for row in rows[-3:]:
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    write_json(args.out, {"environment": environment(), "config": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
