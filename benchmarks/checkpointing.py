"""Activation checkpointing on a real GPU. Run on a CUDA machine:

    python benchmarks/checkpointing.py --out benchmarks/results/checkpointing.json --plot docs/checkpointing.png

ResNet50, bf16 autocast, channels_last, SGD, batch 256, random data on the device, a plain PyTorch loop.
Configurations: no checkpointing; the write-up's `checkpoint_sequential` over the four stages (4 segments);
ours with every block (and the stem); ours at memory budgets 0.8, 0.7, 0.6, 0.57, 0.5 and 0.4 of the un-checkpointed
peak of one pass (0.57 of it is about the 4-segment version's saving of the training peak); and the same with
`rebuild_bn_relu=True` (every Bottleneck left unchecked rebuilds its BatchNorm + ReLU outputs, and its output where
the next block is rebuilt too, in backward instead of keeping them), alone and at budgets 0.8, 0.7, 0.6, 0.57, 0.5
and 0.4; and the rebuild alone done other ways (`VARIANTS`): with PyTorch's own kernels instead of the one-pass
Triton kernel, and keeping 1 or all of a stage's earlier outputs when its last is rebuilt
(`RebuildConfig.chain_kept`, default 2). Each is timed with
CUDA events (median step) in two interleaved rounds; peak is `torch.cuda.max_memory_allocated()` over the timed
steps. Also: whether BatchNorm buffers stay bit-identical to the plain model under bf16 and channels_last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torchvision
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import environment, free_memory, median, sequential_forward, write_json  # noqa: E402

from lightning_memguard import checkpoint_resnet  # noqa: E402
from lightning_memguard.checkpointing import RebuildConfig, apply_plan  # noqa: E402

VARIANTS = {  # the rebuild alone, other ways
    "ours_rebuild_eager": RebuildConfig(fused=False),  # PyTorch's own kernels
    "ours_rebuild_chain_kept_1": RebuildConfig(chain_kept=1),
    "ours_rebuild_chain_kept_all": RebuildConfig(chain_kept=100),
}


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return torchvision.models.resnet50(num_classes=1000).cuda().to(memory_format=torch.channels_last)


def train_steps(model: nn.Module, forward: Callable, batches: list, steps: int, warmup: int) -> dict[str, float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model.train()
    times, events = [], []
    for i in range(warmup + steps):
        if i == warmup:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        x, y = batches[i % len(batches)]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(forward(x), y)
        loss.backward()
        opt.step()
        end.record()
        if i >= warmup:
            events.append((start, end))
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) for s, e in events]
    return {"median_step_ms": median(times), "peak_gb": torch.cuda.max_memory_allocated() / 1e9}


def bn_identity(batches: list) -> dict[str, bool]:
    """Three steps from the same weights on the same batches; are BatchNorm buffers bit-identical to plain?"""
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    results = {}
    reference = None
    for name in ("plain", "plain_again", "ours_every_block", "ours_runs", "checkpoint_sequential_4"):
        model = make_model(seed=1)
        forward: Callable = model
        if name == "ours_every_block":
            checkpoint_resnet(model)
        elif name == "ours_runs":  # blocks joined into runs, one checkpoint each, as budgets choose them
            apply_plan(model, [["stem"], ["layer1.0", "layer1.1", "layer1.2"], ["layer3.0", "layer3.1", "layer3.2"]])
        elif name == "checkpoint_sequential_4":
            forward = sequential_forward(model)
        train_steps(model, forward, batches[:3], steps=3, warmup=0)
        buffers = [b.clone() for b in model.buffers()]
        if reference is None:
            reference = buffers
        else:
            results[name] = all(torch.equal(a, b) for a, b in zip(reference, buffers, strict=True))
        del model
        free_memory()
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = False, True
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/checkpointing.json")
    parser.add_argument("--plot", default="docs/checkpointing.png")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--replot", action="store_true", help="only redraw the plot from --out's results")
    args = parser.parse_args()
    if args.replot:
        with open(args.out, encoding="utf-8") as f:
            plot(json.load(f)["summary"], args.plot)
        return
    torch.backends.cudnn.benchmark = True
    gen = torch.Generator(device="cuda").manual_seed(0)
    batches = [
        (
            torch.randn(args.batch, 3, 224, 224, device="cuda", generator=gen).contiguous(
                memory_format=torch.channels_last
            ),
            torch.randint(0, 1000, (args.batch,), device="cuda", generator=gen),
        )
        for _ in range(4)
    ]
    plans: dict[str, Any] = {}

    def build(name: str) -> tuple[nn.Module, Callable]:
        model = make_model()
        if name == "baseline":
            return model, model
        if name == "checkpoint_sequential_4":
            return model, sequential_forward(model)
        if name == "ours_every_block":
            checkpoint_resnet(model)
            return model, model
        rebuild = name.startswith("ours_rebuild")  # BatchNorm + ReLU outputs rebuilt in the blocks left unchecked
        if name in ("ours_rebuild", *VARIANTS):
            checkpoint_resnet(model, rebuild_bn_relu=True, rebuild_config=VARIANTS.get(name))
            return model, model
        budget = float(name.split("_")[-1])
        with torch.autocast("cuda", dtype=torch.bfloat16):
            plan = checkpoint_resnet(model, memory_budget=budget, example_input=batches[0][0], rebuild_bn_relu=rebuild)
        earlier = plans.get(name, {}).get("runs_each_round", [])  # planned anew each round: keep every choice
        plans[name] = {
            "runs_each_round": [*earlier, plan.runs],
            "blocks": plan.blocks,
            "runs": plan.runs,
            "rebuilt": plan.rebuilt,
            "budget_gb": plan.budget_bytes / 1e9,  # type: ignore[operator]
            "baseline_gb": plan.baseline_bytes / 1e9,  # type: ignore[operator]
            "predicted_gb": plan.predicted_bytes / 1e9,  # type: ignore[operator]
            "measured_gb": plan.measured_bytes / 1e9,  # type: ignore[operator]
            "held": plan.held,
        }
        key = "profiles_with_rebuild" if rebuild else "profiles"  # what the planner measured, link by link
        plans.setdefault(key, [dataclasses.asdict(p) for p in plan.profiles])
        return model, model

    names = [
        "baseline",
        "checkpoint_sequential_4",
        "ours_every_block",
        "ours_budget_0.8",
        "ours_budget_0.7",
        "ours_budget_0.6",
        "ours_budget_0.57",
        "ours_budget_0.5",
        "ours_budget_0.4",
        "ours_rebuild",
        *VARIANTS,
        "ours_rebuild_budget_0.8",
        "ours_rebuild_budget_0.7",
        "ours_rebuild_budget_0.6",
        "ours_rebuild_budget_0.57",
        "ours_rebuild_budget_0.5",
        "ours_rebuild_budget_0.4",
    ]
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for _ in range(args.rounds):
        for name in names:
            free_memory()
            model, forward = build(name)
            row = train_steps(model, forward, batches, args.steps, args.warmup)
            runs[name].append(row)
            print(name, row, flush=True)
            del model, forward
    base_ms = median([r["median_step_ms"] for r in runs["baseline"]])
    base_peak = median([r["peak_gb"] for r in runs["baseline"]])
    summary = {}
    for name in names:
        ms = median([r["median_step_ms"] for r in runs[name]])
        peak = median([r["peak_gb"] for r in runs[name]])
        summary[name] = {
            "median_step_ms": ms,
            "images_per_sec": args.batch / ms * 1e3,
            "peak_gb": peak,
            "memory_saved": 1 - peak / base_peak,
            "throughput_cost": 1 - base_ms / ms,
        }
        print(name, summary[name], flush=True)
    result = {
        "environment": environment(),
        "config": vars(args),
        "summary": summary,
        "plans": plans,
        "batchnorm_bit_identical_to_plain": bn_identity(batches),
        "runs": runs,
    }
    print(result["plans"], result["batchnorm_bit_identical_to_plain"], flush=True)
    write_json(args.out, result)
    plot(summary, args.plot)


def plot(summary: dict[str, dict[str, float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 5.5))
    markers = {"baseline": "s", "checkpoint_sequential_4": "D"}
    colors = plt.get_cmap("tab20").colors  # one color each (the default cycle repeats after ten)
    for (name, row), color in zip(summary.items(), colors * 2, strict=False):
        label = name.replace("_", " ")
        if name != "baseline":
            label += f": {row['memory_saved']:.0%} less memory, {row['throughput_cost']:.0%} slower"
        ax.scatter(
            row["peak_gb"],
            row["images_per_sec"],
            s=70,
            marker=markers.get(name, "^" if "rebuild" in name else "o"),
            color=color,
            label=label,
        )
    for prefix, style in (("ours_budget", ":"), ("ours_rebuild", "--")):  # each mode's memory-for-speed curve
        points = sorted(
            (r["peak_gb"], r["images_per_sec"])
            for n, r in summary.items()
            if n.startswith(prefix) and n not in VARIANTS
        )
        if points:
            ax.plot(*zip(*points, strict=True), style, color="gray", linewidth=1, zorder=0)
    ax.set_xlabel("peak memory (GB)")
    ax.set_ylabel("throughput (images/s)")
    ax.set_title("Checkpointing ResNet50 (bf16, channels_last, batch 256) on one H200")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
