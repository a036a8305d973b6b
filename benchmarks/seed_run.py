"""The seed's situation with a language model: GPT-2 small fine-tuned at 16 x 1024 tokens on an emulated 16 GB card
whose driver spills into system RAM. Run on a CUDA machine (about 3 minutes on an H200):

    PYTHONPATH=$PWD python3 benchmarks/seed_run.py --out benchmarks/results/seed_run.json

GPT-2 small built from its config (``GPT2Config()``, no download), a Lightning Trainer, bf16-mixed, AdamW, random
tokens, the same batch of 16 sequences of 1,024 tokens in every row (no row takes a smaller batch, none accumulates).
Each row runs on a fresh model from the same seed under :class:`~lightning_memguard.testing.SysmemSpillEmulator`
(``capacity="16GB"``: saved activations beyond it go to pinned host memory and come back, as the Windows driver's
fallback does) and ``MemGuard(on_spill="warn")`` (so a spilling row goes on and is timed):

- ``plain``: the model as it is;
- ``family_switch``: Hugging Face's own switch (``_common.hugging_face_switch``: ``use_reentrant=False``);
- ``ours``: the library's levers for a budget that fits the card: ``plan_levers(model, <the batch>,
  memory_budget=...)``, which takes the fused loss (the loss without its logits) first and then, per block, the
  cheapest of checkpointing it whole, its parts, or recomputing its pointwise chains, each set measured (under bf16
  autocast, on the card); the budget is the card's 16 GB less what the step starts with (weights, AdamW's state, the
  batch) and a margin of 1.5 GB. Offload is not offered: its pinned host copies would stand beside the emulated
  driver's spill, which this run measures. The plan's ``summary()`` and ``calls()`` are recorded.

Each row: the spilled bytes per step, whether MemGuard called a spill, the median step time (after 3 warm-up steps),
the samples in each optimizer step, and the ratio of its step time to the switch's (``vs_switch``). ``--smoke`` runs
a two-layer GPT-2 on the CPU with a capacity scaled down: the code path, not a measurement.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

import torch
from lightning import LightningModule
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import environment, free_memory, hugging_face_switch, make_trainer, median, write_json  # noqa: E402

from lightning_memguard import MemGuard  # noqa: E402
from lightning_memguard.levers import plan_levers  # noqa: E402
from lightning_memguard.testing import StepTimer, SysmemSpillEmulator  # noqa: E402

WARMUP = 3
ROWS = ("plain", "family_switch", "ours")


class Tokens(Dataset[torch.Tensor]):
    """``length`` random sequences of ``tokens`` token ids, the same for every row (seeded)."""

    def __init__(self, length: int, tokens: int, vocab: int) -> None:
        generator = torch.Generator().manual_seed(1)
        self.data = torch.randint(0, vocab, (length, tokens), generator=generator)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.data[index]


class FineTune(LightningModule):
    """A causal language model's own loss on its input tokens, AdamW."""

    def __init__(self, model: torch.nn.Module, batch: int, steps: int, tokens: int) -> None:
        super().__init__()
        self.model = model
        self.batch, self.steps, self.tokens = batch, steps, tokens

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss  # type: ignore[no-any-return]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-5)

    def train_dataloader(self) -> DataLoader[torch.Tensor]:
        vocab = int(self.model.config.vocab_size)  # type: ignore[union-attr, arg-type]
        return DataLoader(Tokens(self.batch * (self.steps + 1), self.tokens, vocab), batch_size=self.batch)


def gpt2(smoke: bool) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    if smoke:
        config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=64)
    else:
        config = transformers.GPT2Config()
    return transformers.GPT2LMHeadModel(config)


def resting_bytes(model: torch.nn.Module) -> int:
    """What a step starts with: the weights, their gradients and AdamW's two moments, all float32."""
    return 4 * sum(p.numel() for p in model.parameters()) * 4


def prepare(row: str, model: torch.nn.Module, capacity: int, batch: torch.Tensor, margin: int) -> dict[str, Any]:
    """Apply the row's change to ``model``; what was chosen, for the record."""
    if row == "family_switch":
        hugging_face_switch(model)
        return {}
    if row != "ours":
        return {}
    budget = capacity - resting_bytes(model) - margin
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device)
    with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        plan = plan_levers(
            model,
            {"input_ids": batch.to(device), "labels": batch.to(device)},
            memory_budget=budget,
            loss_fn=lambda output: output.loss,
            offload=False,
        )
    model.cpu()
    return {"budget_bytes": budget, "plan": plan.summary(), "calls": plan.calls(), "held": plan.held}


def measure(row: str, args: argparse.Namespace, root: str) -> dict[str, Any]:
    free_memory()
    model = gpt2(args.smoke)
    batch = Tokens(args.batch, args.tokens, int(model.config.vocab_size)).data  # type: ignore[union-attr, arg-type]
    capacity = int(args.capacity_gb * 1e9)
    result: dict[str, Any] = {"row": row, "batch": args.batch, "tokens": args.tokens, "error": None}
    start = time.perf_counter()
    try:
        result.update(prepare(row, model, capacity, batch, int(args.margin_gb * 1e9)))
        emulator = SysmemSpillEmulator(capacity=capacity)
        guard = MemGuard(probe=emulator.probe, on_spill="warn", warmup_steps=WARMUP)
        timer = StepTimer(skip=WARMUP)
        module = FineTune(model, args.batch, args.steps, args.tokens)
        make_trainer([emulator, guard, timer], args.steps, root).fit(module)
    except Exception as err:  # a row that fails is recorded and the others go on
        result["error"] = f"{type(err).__name__}: {err}"[:2000]
        return result
    times = timer.step_ms()
    result["median_step_ms"] = median(times)
    result["samples_per_optimizer_step"] = args.batch
    result["spilled_gb_per_step"] = emulator.spilled_bytes / 1e9
    result["spill_called"] = guard.spill is not None
    result["peak_allocated_gb"] = guard.epochs[-1].peak_allocated_gb if guard.epochs else None
    result["wall_s"] = time.perf_counter() - start
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/seed_run.json")
    parser.add_argument("--smoke", action="store_true", help="a two-layer GPT-2 on the CPU: the code path only")
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    if args.smoke:
        args.batch, args.tokens, args.capacity_gb, args.margin_gb, args.steps = 2, 64, 0.0055, 0.0005, 5
    else:
        if not torch.cuda.is_available():
            parser.error("needs a CUDA device (or --smoke)")
        args.batch, args.tokens, args.capacity_gb, args.margin_gb = 16, 1024, 16.0, 1.5
    root = tempfile.mkdtemp()
    result: dict[str, Any] = {"environment": environment(), "config": vars(args), "rows": {}}
    for row in ROWS:
        result["rows"][row] = measure(row, args, root)
        print(result["rows"][row], flush=True)
        write_json(args.out, result)  # a run cut short keeps what it measured
    switch = result["rows"]["family_switch"].get("median_step_ms")
    for entry in result["rows"].values():
        if switch and entry.get("median_step_ms"):
            entry["vs_switch"] = entry["median_step_ms"] / switch
    write_json(args.out, result)


if __name__ == "__main__":
    main()
