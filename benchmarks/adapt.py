"""MemGuard(on_spill="adapt") on a real GPU: a run that meets less memory in the middle goes on instead of stopping.

    python benchmarks/adapt.py --out benchmarks/results/adapt.json

1. ResNet50, bf16-mixed, channels_last, batch 256, on an emulated 16 GB card with the fallback (saved activations
   beyond 16 GB go to pinned host memory, as the driver's fallback moves them): another allocation (a ballast, as
   another application taking memory would) is taken at step ``--take`` and freed at step ``--free``. Its size is
   set from this card's own measured peaks so that the batch of 256 spills and 128 x 2 fits. Rows, each a fresh
   Trainer, in turns over ``--rounds`` rounds:
   - ``adapt``: MemGuard(on_spill="adapt", adapt_batchnorm=True), batch 256: it adapts, then grows back;
   - ``adapt_from_start``: the same with the ballast held from the first step: the adapted configuration from the
     beginning, the pace to match while the ballast is held;
   - ``accumulate_from_start``: what a user would set by hand instead, Lightning's own accumulation (128 x 2) from
     the first step, with the same ballast;
   - ``stop``: MemGuard(on_spill="stop"), batch 256, the same ballast: what the run did before (it stops).
   Reported: steps trained and samples per optimizer step (none lost), each adaptation's line, the adapted pace
   against ``split_from_start`` over the same steps (a ratio measured in the same run), and the seconds lost to
   the spill and the switch (the steps from the ballast to the adaptation, beyond the adapted pace).
2. A Hugging Face GPT-2 (small, from its config, no download) whose batches grow from ``--short`` to ``--long``
   tokens at step ``--grow``, under MemGuard(capacity=..., prevent=True, on_spill="adapt"): the capacity is set
   between the two lengths' measured peaks, so the longer batches raise CUDA's out-of-memory error, and the step is
   redone split.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
import warnings
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import environment, free_memory, make_trainer, median, write_json  # noqa: E402

from lightning_memguard import MemGuard  # noqa: E402
from lightning_memguard.testing import ImageClassifier, StepTimer, SysmemSpillEmulator  # noqa: E402

CAPACITY = 16 * 10**9
GB = 1e9


class Ballast(Callback):
    """Another allocation of ``nbytes`` on the device from optimizer step ``take`` to ``free``: a real one on CUDA;
    on the CPU (the script's smoke test) the emulated card's memory held by another application."""

    def __init__(self, nbytes: int, take: int, free: int, emulator: SysmemSpillEmulator) -> None:
        self.nbytes, self.take, self.free, self.emulator = nbytes, take, free, emulator
        self.held: torch.Tensor | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        step, cuda = trainer.global_step, pl_module.device.type == "cuda"
        if step == self.take:
            if cuda:
                self.held = torch.empty(self.nbytes, dtype=torch.uint8, device=pl_module.device)
            else:
                self.emulator.other_processes = self.nbytes
        if step == self.free:
            self.held, self.emulator.other_processes = None, 0


class Samples(Callback):
    """The samples each optimizer step trained on: the batches since the last step, as the loader delivered them."""

    def __init__(self) -> None:
        self.pending = 0
        self.per_step: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.pending += int(batch.shape[0])

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.per_step.append(self.pending)
        self.pending = 0


def resnet(batch: int, batches: int) -> ImageClassifier:
    if not torch.cuda.is_available():  # the smoke test on the CPU
        return ImageClassifier("resnet18", image_size=128, batch_size=batch, steps_per_epoch=batches, pool_size=16)
    return ImageClassifier(
        "resnet50", image_size=224, batch_size=batch, steps_per_epoch=batches, channels_last=True, pool_size=256,
        num_classes=1000,
    )  # fmt: skip


def emulated_peak(batch: int, root: str) -> float:
    """The emulated probe's step peak of a plain run at ``batch`` (nothing spills on a card of 1 TB)."""
    free_memory()
    emu = SysmemSpillEmulator(capacity="1TB")
    make_trainer([emu], 4, root).fit(resnet(batch, 5))
    return float(emu.probe.read().peak_allocated)


def resnet_row(kind: str, args: argparse.Namespace, ballast: int, root: str) -> dict[str, Any]:
    gc.collect()  # the last row's Trainer (and what its callbacks held) goes before this row measures
    free_memory()
    split = kind == "accumulate_from_start"
    take = 0 if kind.endswith("from_start") else args.take
    emu = SysmemSpillEmulator(capacity=args.capacity)
    guard = MemGuard(
        probe=emu.probe, on_spill="stop" if kind == "stop" else "adapt", adapt_batchnorm=True,
        grow_every=args.grow_every, spill_checkpoint=False,
    )  # fmt: skip
    timer, samples = StepTimer(), Samples()
    accumulate = 2 if split else 1
    batch = args.batch // accumulate
    held_memory = Ballast(ballast, take, args.free, emu)
    callbacks = [emu, guard, held_memory, timer, samples]
    trainer = make_trainer(callbacks, args.steps, root, accumulate_grad_batches=accumulate)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(resnet(batch, args.steps * accumulate + 1))
    wall = time.perf_counter() - start
    held_memory.held = None  # a run stopped before the ballast's end
    steps = timer.step_ms(accumulate)
    held = steps[args.take + 5 : args.free]  # the ballast held, the adaptation done
    after = steps[args.free + 2 * args.grow_every + 2 :]  # the ballast freed, grown back
    row: dict[str, Any] = {
        "kind": kind,
        "batch": f"{batch} x {accumulate}",
        "steps_trained": trainer.global_step,
        "samples_per_step": sorted(set(samples.per_step)),
        "wall_s": round(wall, 2),
        "step_ms": [round(s, 2) for s in steps],
        "held_median_ms": median(held),
        "held_samples_per_sec": args.batch / (median(held) / 1e3) if held else None,
        "after_median_ms": median(after),
        "adaptations": [a.line() for a in guard.adaptations],
        "spill_step": guard.spill.step if guard.spill else None,
        "emulated_gb_spilled_total": emu.total_spilled_bytes / GB,
    }
    if guard.adaptations:
        adapted = guard.adaptations[0].step
        row["adapted_at_step"] = adapted
        pace = median(held)
        row["seconds_lost"] = round(sum(s - pace for s in steps[args.take : adapted + 1]) / 1e3, 3)
    print({k: v for k, v in row.items() if k != "step_ms"}, flush=True)
    return row


class GrowingText(Dataset):
    """Random token ids: the first ``short_batches`` batches of ``short`` tokens, the rest of ``long``."""

    def __init__(self, batch: int, batches: int, short_batches: int, short: int, long: int, vocab: int) -> None:
        self.batch, self.batches, self.short_batches, self.short, self.long, self.vocab = (
            batch, batches, short_batches, short, long, vocab,
        )  # fmt: skip
        self.gen = torch.Generator().manual_seed(0)

    def __len__(self) -> int:
        return self.batch * self.batches

    def __getitem__(self, i: int) -> torch.Tensor:
        length = self.short if i // self.batch < self.short_batches else self.long
        return torch.randint(0, self.vocab, (length,), generator=self.gen)


class Gpt2(LightningModule):
    def __init__(self, batch: int, batches: int, short_batches: int, short: int, long: int) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_positions=max(long, 1024), use_cache=False)
        self.model = GPT2LMHeadModel(config)
        self.data = GrowingText(batch, batches, short_batches, short, long, config.vocab_size)
        self.batch_size = batch

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size)


def gpt2_peak(args: argparse.Namespace, length: int, root: str) -> float:
    free_memory()
    make_trainer([], 3, root).fit(Gpt2(args.gpt2_batch, 4, 4, length, length))
    return float(torch.cuda.max_memory_allocated())


def gpt2_row(args: argparse.Namespace, capacity: int, root: str) -> dict[str, Any]:
    free_memory()
    guard = MemGuard(capacity=capacity, prevent=True, prevent_margin=0, on_spill="adapt", spill_checkpoint=False)
    timer, samples = StepTimer(), Samples()
    model = Gpt2(args.gpt2_batch, args.gpt2_steps + 1, args.grow, args.short, args.long)
    trainer = make_trainer([guard, timer, samples], args.gpt2_steps, root)
    row: dict[str, Any] = {"capacity_gb": capacity / GB, "error": None}
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(model)
    except torch.OutOfMemoryError as err:
        row["error"] = str(err).splitlines()[0]
    torch.cuda.set_per_process_memory_fraction(1.0)
    steps = timer.step_ms()
    row.update(
        wall_s=round(time.perf_counter() - start, 2),
        steps_trained=trainer.global_step,
        samples_per_step=sorted(set(samples.per_step)),
        adaptations=[a.line() for a in guard.adaptations],
        short_median_ms=median(steps[2 : args.grow]),
        long_median_ms=median(steps[args.grow + 2 :]),
    )
    print(row, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/adapt.json")
    parser.add_argument("--parts", default="resnet,gpt2")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=130)
    parser.add_argument("--take", type=int, default=30)
    parser.add_argument("--free", type=int, default=80)
    parser.add_argument("--grow-every", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--gpt2-batch", type=int, default=8)
    parser.add_argument("--gpt2-steps", type=int, default=40)
    parser.add_argument("--grow", type=int, default=15)
    parser.add_argument("--short", type=int, default=256)
    parser.add_argument("--long", type=int, default=1024)
    parser.add_argument("--smoke", action="store_true", help="a small run of the ResNet part on the CPU")
    args = parser.parse_args()
    args.capacity = CAPACITY
    if args.smoke:
        args.batch, args.steps, args.take, args.free, args.grow_every, args.rounds = 16, 30, 5, 15, 3, 1
    root = tempfile.mkdtemp()
    result: dict[str, Any] = {"environment": environment(), "config": vars(args)}
    parts = args.parts.split(",")
    if "resnet" in parts:
        full, half = emulated_peak(args.batch, root), emulated_peak(args.batch // 2, root)
        # the batch of 256 must spill beside the ballast, its half fit with the headroom MemGuard keeps
        if args.smoke:  # a card the CPU's small batch fills as 256 fills 16 GB
            args.capacity = int(half + (full - half) * 1.6)
        ballast = int((args.capacity - full + args.capacity * 0.93 - half) / 2)
        result["resnet"] = {
            "peak_gb": {str(args.batch): full / GB, str(args.batch // 2): half / GB}, "capacity_gb": args.capacity / GB,
            "ballast_gb": ballast / GB, "rows": [],
        }  # fmt: skip
        print(result["resnet"], flush=True)
        for _ in range(args.rounds):
            for kind in ("adapt", "adapt_from_start", "accumulate_from_start", "stop"):
                result["resnet"]["rows"].append(resnet_row(kind, args, ballast, root))
        rows = result["resnet"]["rows"]

        def pace(kind: str) -> float:
            return median([r["held_samples_per_sec"] for r in rows if r["kind"] == kind and r["held_samples_per_sec"]])

        for reference in ("adapt_from_start", "accumulate_from_start"):
            ratio = pace("adapt") / pace(reference)
            result["resnet"][f"adapt_over_{reference}"] = ratio
            print(f"adapted pace / {reference}: {ratio:.3f}", flush=True)
        write_json(args.out, result)
    if "gpt2" in parts:
        short, long = gpt2_peak(args, args.short, root), gpt2_peak(args, args.long, root)
        capacity = int((short + long) / 2)
        result["gpt2"] = {"peak_gb": {str(args.short): short / GB, str(args.long): long / GB}}
        result["gpt2"]["run"] = gpt2_row(args, capacity, root)
    write_json(args.out, result)


if __name__ == "__main__":
    main()
