"""Checkpoint a torchvision ResNet to a memory budget without Lightning, and print the plan.

python examples/checkpoint_budget.py --budget 0.6
python examples/checkpoint_budget.py --budget 0.8 --rebuild   # BatchNorm + ReLU rebuilt first: fewer blocks
"""

from __future__ import annotations

import argparse

import torch
import torchvision

from lightning_memguard import checkpoint_resnet


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget", type=float, default=0.6, help="fraction of the un-checkpointed peak")
    parser.add_argument("--rebuild", action="store_true", help="rebuild BatchNorm + ReLU outputs in the other blocks")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    model = torchvision.models.resnet50(num_classes=1000).to(device)
    batch = torch.randn(64 if cuda else 4, 3, 224 if cuda else 64, 224 if cuda else 64, device=device)
    where = f"{'CUDA' if cuda else 'the CPU'}, batch {len(batch)} at {batch.shape[-1]} px"
    print(f"measuring resnet50 on {where}, to plan its checkpoints", flush=True)
    with torch.autocast(device, dtype=torch.bfloat16, enabled=cuda):
        plan = checkpoint_resnet(model, memory_budget=args.budget, example_input=batch, rebuild_bn_relu=args.rebuild)
    print(plan.summary())
    print("runs, one checkpoint each:", "; ".join(" + ".join(run) for run in plan.runs) or "none")
    if plan.rebuilt:
        print("BatchNorm + ReLU rebuilt in:", ", ".join(plan.rebuilt))


if __name__ == "__main__":
    main()
