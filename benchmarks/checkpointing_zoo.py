"""Activation checkpointing beyond ResNets, on a real GPU. Run on a CUDA machine:

    python benchmarks/checkpointing_zoo.py --out benchmarks/results/checkpointing_zoo.json

mobilenet_v2, efficientnet_b0, regnet_y_400mf, convnext_tiny (channels_last) and vit_b_16; bf16 autocast, SGD, random
data on the device, a plain PyTorch loop (``checkpointing.train_steps``: CUDA-event median step, peak
``torch.cuda.max_memory_allocated()`` over the timed steps). Each model's batch is sized so that its plain training
peak is about 12 GB (measured at batch 32, scaled, rounded to 16). Configurations: no checkpointing; every block
found by ``units="auto"`` checkpointed; a memory budget of 0.6 of the un-checkpointed peak of one pass; and where
the model has Conv2dNormActivation units (MobileNet, EfficientNet, RegNet) the rebuild (``rebuild_bn_relu=True``):
alone in the blocks (as the callback does it), alone in every unit of the model (``rebuild_bn_relu(model)``: also
the stem and the head), alone with PyTorch's kernels instead of the one-pass Triton kernel
(``rebuild_config=RebuildConfig(fused=False)``, as on Windows), and with a budget of 0.6 (whole blocks checkpointed
only for what the rebuild leaves over it). ``--models`` and ``--configs`` pick a part (the plain row always runs: the
others are measured against it).

``--smoke`` runs the same on the CPU at 64 px, batch 4, one step: the script end to end, not a measurement (there
``peak_gb`` is the bytes of activations saved for backward in one step).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torchvision
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import environment, free_memory, write_json  # noqa: E402
from checkpointing import train_steps  # noqa: E402

from lightning_memguard.checkpointing import RebuildConfig, checkpoint_blocks, rebuild_bn_relu  # noqa: E402

MODELS = {  # channels_last
    "mobilenet_v2": True,
    "efficientnet_b0": True,
    "regnet_y_400mf": True,
    "convnext_tiny": True,
    "vit_b_16": False,
}
REBUILT = {"mobilenet_v2", "efficientnet_b0", "regnet_y_400mf"}  # models with Conv2dNormActivation units
CONFIGS = ["every_block", "budget_0.6", "rebuild", "rebuild_all", "rebuild_eager", "rebuild_budget_0.6"]
TARGET_BYTES = 12 * 10**9


@dataclass(frozen=True)
class Setting:
    """Where and at what size: the H200 run, or the CPU smoke run."""

    device: torch.device
    image: int

    def autocast(self) -> Any:
        return torch.autocast(self.device.type, dtype=torch.bfloat16)


def make_model(name: str, channels_last: bool, setting: Setting) -> nn.Module:
    torch.manual_seed(0)
    kwargs: dict[str, Any] = {"image_size": setting.image} if name.startswith("vit") else {}
    model = torchvision.models.get_model(name, weights=None, num_classes=1000, **kwargs).to(setting.device)
    return model.to(memory_format=torch.channels_last) if channels_last else model


def batches(
    size: int, channels_last: bool, setting: Setting, count: int = 4
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    image = setting.image
    return [
        (
            torch.randn(size, 3, image, image, device=setting.device).contiguous(memory_format=fmt),
            torch.randint(0, 1000, (size,), device=setting.device),
        )
        for _ in range(count)
    ]


def cpu_steps(model: nn.Module, data: list, steps: int, warmup: int, setting: Setting) -> dict[str, float]:
    """``train_steps`` on the CPU: wall-clock median step; as peak, the bytes a step saves for backward."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model.train()
    held = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in held:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    times = []
    for i in range(warmup + steps):
        x, y = data[i % len(data)]
        saved.clear()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with setting.autocast(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return {"median_step_ms": statistics.median(times), "peak_gb": sum(saved.values()) / 1e9}


def apply(model: nn.Module, config: str, example: torch.Tensor, setting: Setting) -> dict[str, Any]:
    """Change ``model`` as ``config`` says; what the plan chose."""
    if config == "every_block":
        return {"blocks": len(checkpoint_blocks(model).blocks)}
    if config == "rebuild":
        return {"rebuilt": len(checkpoint_blocks(model, rebuild_bn_relu=True).rebuilt)}
    if config == "rebuild_eager":  # PyTorch's own kernels, as where Triton is missing (Windows)
        plan = checkpoint_blocks(model, rebuild_bn_relu=True, rebuild_config=RebuildConfig(fused=False))
        return {"rebuilt": len(plan.rebuilt)}
    if config == "rebuild_all":
        return {"rebuilt_units": rebuild_bn_relu(model)}
    with setting.autocast():
        plan = checkpoint_blocks(
            model, memory_budget=0.6, example_input=example, rebuild_bn_relu=config == "rebuild_budget_0.6"
        )
    return {
        "blocks": len(plan.blocks),
        "rebuilt": len(plan.rebuilt),
        "candidates": plan.candidates,
        "runs": len(plan.runs),
        "held": plan.held,
        "budget_gb": plan.budget_bytes / 1e9,  # type: ignore[operator]
        "measured_pass_gb": plan.measured_bytes / 1e9,  # type: ignore[operator]
    }


def measure(
    name: str, channels_last: bool, config: str, size: int, steps: int, warmup: int, setting: Setting
) -> dict[str, Any]:
    model = make_model(name, channels_last, setting)
    data = batches(size, channels_last, setting)
    row: dict[str, Any] = {"model": name, "config": config, "batch": size}
    if config != "plain":
        row.update(apply(model, config, data[0][0], setting))
    if setting.device.type == "cuda":
        row.update(train_steps(model, model, data, steps=steps, warmup=warmup))
    else:
        row.update(cpu_steps(model, data, steps, warmup, setting))
    row["img_s"] = size / (row["median_step_ms"] / 1e3)
    del model, data
    free_memory()
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/checkpointing_zoo.json")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated, from: " + ", ".join(MODELS))
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, from: " + ", ".join(CONFIGS))
    parser.add_argument("--smoke", action="store_true", help="the CPU at 64 px, batch 4, one step: the script runs")
    args = parser.parse_args()
    models = args.models.split(",")
    configs = args.configs.split(",")
    unknown = [m for m in models if m not in MODELS] + [c for c in configs if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown model or configuration: {unknown}")
    if args.smoke:
        setting = Setting(torch.device("cpu"), image=64)
        args.steps, args.warmup = 1, 0
    else:
        setting = Setting(torch.device("cuda"), image=224)
        torch.backends.cudnn.benchmark = True
    rows = []
    for name in models:
        channels_last = MODELS[name]
        if args.smoke:
            size = 4
        else:
            probe = measure(name, channels_last, "plain", 32, 2, 2, setting)
            size = max(16, int(32 * TARGET_BYTES / (probe["peak_gb"] * 1e9)) // 16 * 16)
        plain = measure(name, channels_last, "plain", size, args.steps, args.warmup, setting)
        rows.append(plain)
        print(_rounded(plain), flush=True)
        for config in configs:
            if config.startswith("rebuild") and name not in REBUILT:
                continue  # nothing to rebuild: no Conv2dNormActivation with BatchNorm
            row = measure(name, channels_last, config, size, args.steps, args.warmup, setting)
            row["memory_saved"] = 1 - row["peak_gb"] / plain["peak_gb"]
            row["throughput_cost"] = 1 - row["img_s"] / plain["img_s"]
            rows.append(row)
            print(_rounded(row), flush=True)
    write_json(args.out, {"environment": environment(), "config": vars(args), "rows": rows})


def _rounded(row: dict[str, Any]) -> dict[str, Any]:
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}


if __name__ == "__main__":
    main()
