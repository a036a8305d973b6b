"""Pointwise recomputation inside every block against the plain model, whole-block checkpointing and the family's own
switch (timm's ``set_grad_checkpointing``): the activation memory of one training step (the peak above the weights,
bf16 autocast) and its time, on ViT, Swin, ConvNeXt, ResNet-50 and a Llama-style model; then, for one model, each
block's freed bytes and added milliseconds as ``measure_pointwise`` gives them to a planner.

Writes ``benchmarks/results/pointwise.json``. Run on a GPU: ``python benchmarks/pointwise.py`` (``--smoke``: tiny
models on the CPU, to check the script). ``--blocks`` (any device, float32): one block of each kind at its model's
width, the bytes its plain step saves (the ledger) and the bytes pointwise recomputation frees of them, written to
``benchmarks/results/pointwise_blocks.json``.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import environment, free_memory, median, write_json  # noqa: E402

from lightning_memguard._ledger import Ledger  # noqa: E402
from lightning_memguard.checkpointing import checkpoint_blocks  # noqa: E402
from lightning_memguard.checkpointing.model_map import map_model  # noqa: E402
from lightning_memguard.levers.pointwise import measure_pointwise, recompute_pointwise  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "pointwise.json")


def models(smoke: bool) -> dict[str, tuple[Callable[[], nn.Module], Callable[[], Any], str]]:
    """Each model: how to build it, its batch, and its family's own switch (None: none)."""
    import timm
    import torchvision
    from transformers import LlamaConfig, LlamaForCausalLM

    batch, size = (2, 32) if smoke else (64, 224)
    images = lambda: torch.randn(batch, 3, size, size)  # noqa: E731
    small = {"img_size": size} if smoke else {}
    llama = LlamaConfig(
        vocab_size=1000 if smoke else 32000,
        hidden_size=64 if smoke else 1024,
        intermediate_size=172 if smoke else 2816,
        num_hidden_layers=2 if smoke else 8,
        num_attention_heads=4 if smoke else 16,
        num_key_value_heads=4 if smoke else 16,
    )
    tokens = lambda: torch.randint(0, llama.vocab_size, (2 if smoke else 8, 64 if smoke else 2048))  # noqa: E731
    return {
        "vit_base_patch16_224": (lambda: timm.create_model("vit_base_patch16_224", **small), images, "timm"),
        "swin_tiny_patch4_window7_224": (
            lambda: timm.create_model("swin_tiny_patch4_window7_224", **({"img_size": 224} if smoke else {})),
            (lambda: torch.randn(1, 3, 224, 224)) if smoke else images,
            "timm",
        ),
        "convnext_tiny": (lambda: timm.create_model("convnext_tiny"), images, "timm"),
        "resnet50": (lambda: torchvision.models.resnet50(), images, "none"),
        "llama_1024x8": (lambda: LlamaForCausalLM(llama), tokens, "hf"),
    }


def loss_of(output: Any) -> torch.Tensor:
    logits = getattr(output, "logits", output)
    return logits.float().square().mean()


def run(model: nn.Module, batch: Any, device: str, steps: int) -> dict[str, float]:
    """Peak activation bytes of a step (above what was allocated before it) and its median milliseconds."""
    times = []
    peak = 0
    for i in range(steps + 1):
        free_memory()
        before = torch.cuda.memory_allocated() if device == "cuda" else 0
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        with torch.autocast(device, dtype=torch.bfloat16):
            out = model(batch)
        loss_of(out).backward()
        if device == "cuda":
            end.record()
            torch.cuda.synchronize()
            if i:  # the first step warms up
                times.append(start.elapsed_time(end))
            peak = max(peak, torch.cuda.max_memory_allocated() - before)
        model.zero_grad(set_to_none=True)
    return {"activation_gb": round(peak / 1e9, 3), "step_ms": round(median(times), 2)}


class SwiGLUBlock(nn.Module):
    """A Llama-style MLP block: RMSNorm, then down(silu(gate(y)) * up(y)), added to the residual stream."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(width)
        self.gate = nn.Linear(width, hidden, bias=False)
        self.up = nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        return x + self.down(nn.functional.silu(self.gate(y)) * self.up(y))


def plain_saved(block: nn.Module, x: torch.Tensor) -> int:
    """The bytes one plain step of ``block`` saves for backward, as the ledger counts them."""
    ledger: Ledger[str] = Ledger([*block.parameters(), *block.buffers(), x])

    def pack(t: torch.Tensor) -> torch.Tensor:
        ledger.save(t, "")
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x).float().sum().backward()
    block.zero_grad(set_to_none=True)
    return ledger.on_device


def blocks(device: str) -> None:
    """One block of each kind at its model's width (batch 8, 224 px images; a Llama-7B MLP on 512 tokens)."""
    import timm
    import torchvision

    kinds = {
        "ViT-B/16 layer (197 tokens)": (
            lambda: timm.models.vision_transformer.Block(768, 12),
            lambda: torch.randn(8, 197, 768),
        ),
        "Swin-T stage-1 block (56x56, window 7)": (
            lambda: timm.models.swin_transformer.SwinTransformerBlock(96, (56, 56), num_heads=3),
            lambda: torch.randn(8, 56, 56, 96),
        ),
        "ConvNeXt-T stage-1 block (56x56)": (
            lambda: timm.models.convnext.ConvNeXtBlock(96),
            lambda: torch.randn(8, 96, 56, 56),
        ),
        "Llama-7B SwiGLU MLP (512 tokens)": (lambda: SwiGLUBlock(4096, 11008), lambda: torch.randn(1, 512, 4096)),
        "ResNet-50 layer2 bottleneck (28x28)": (
            lambda: torchvision.models.resnet.Bottleneck(512, 128),
            lambda: torch.randn(8, 512, 28, 28),
        ),
    }
    rows = []
    for name, (build, input_of) in kinds.items():
        torch.manual_seed(0)
        block = build().train().to(device)
        x = input_of().to(device).requires_grad_()
        saved = plain_saved(block, x)
        [cost] = measure_pointwise(block, x)
        row = {"block": name, "plain_saved_mb": round(saved / 1e6, 2), "freed_mb": round(cost.freed_bytes / 1e6, 2)}
        row["freed_share"] = round(cost.freed_bytes / saved, 3)
        rows.append(row)
        print(row, flush=True)
    write_json(OUT.replace(".json", "_blocks.json"), {"environment": environment(), "dtype": "float32", "rows": rows})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny models on the CPU, to check the script")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per row")
    parser.add_argument("--only", nargs="*", default=None, help="the models to run (default: all)")
    parser.add_argument("--blocks", action="store_true", help="one block of each kind: its saved and freed bytes")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if args.blocks:
        blocks(device)
        return
    rows = []
    for name, (build, batch_of, family) in models(args.smoke).items():
        if args.only and name not in args.only:
            continue
        torch.manual_seed(0)
        base = build().train()
        batch = batch_of().to(device)
        variants: dict[str, Callable[[nn.Module], None]] = {
            "plain": lambda m: None,
            "pointwise every block": lambda m: recompute_pointwise(m, units="auto") and None,
            "whole every block": lambda m: checkpoint_blocks(m, units="auto") and None,
        }
        if family == "timm":
            variants["timm set_grad_checkpointing"] = lambda m: m.set_grad_checkpointing(True)
        row: dict[str, Any] = {"model": name, "batch": list(batch.shape)}
        for label, apply in variants.items():
            model = copy.deepcopy(base).to(device)
            apply(model)
            row[label] = run(model, batch, device, args.steps)
            del model
            print(name, label, row[label], flush=True)
        rows.append(row)
        free_memory()
    # one model's links as a planner reads them
    build, batch_of, _ = models(args.smoke)["vit_base_patch16_224"]
    torch.manual_seed(0)
    model = build().train().to(device)
    links = [link for link in map_model(model, "auto").links][:4]
    with torch.autocast(device, dtype=torch.bfloat16):
        costs = measure_pointwise(model, batch_of().to(device), links=links, loss_fn=loss_of)
    per_link = [{"link": c.name, "freed_mb": round(c.freed_bytes / 1e6, 2), "extra_ms": c.extra_ms} for c in costs]
    print(per_link, flush=True)
    write_json(OUT, {"environment": environment(), "rows": rows, "vit_base_links": per_link})


if __name__ == "__main__":
    main()
