"""`memguard plan`: AccumulationTuner's search for one effective batch, each trial printed as it is measured, then
the choice and the lines to paste; with ``--levers``, the levers' plan for one batch instead (:func:`run_levers`)."""

from __future__ import annotations

import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_memguard.callbacks import AccumulationTuner
from lightning_memguard.callbacks._reporting import report_sizes
from lightning_memguard.commands.sweep import ModelSource, emulated_card, run_folders, training_module
from lightning_memguard.core.units import format_size, size_formatter
from lightning_memguard.tuning.search import TrialResult


@dataclass(frozen=True)
class PlanConfig:
    """What one ``memguard plan`` measures, its arguments checked by the command."""

    source: ModelSource
    num_classes: int
    image_size: int | None
    effective_batch: int
    min_micro_batch: int
    channels_last: bool
    precision: str
    cuda: bool
    backend: str | None  # torch.compile's, or None: eager
    capacity: int | None  # an emulated card's, or None: the device's
    warmup: int  # untimed optimizer steps per micro-batch
    steps: int  # timed optimizer steps per micro-batch
    report: str | None = None  # a folder for a memory report per micro-batch tried (None: none)


class _Measured(Exception):
    """The search is done and the training it set up is not wanted."""


class _StopBeforeTraining(Callback):
    """The search is done when training starts: with ``report``, each micro-batch tried is measured first, on the
    first batch at that size, in the configuration chosen (checkpointed where the plan checkpoints)."""

    def __init__(self, tuner: AccumulationTuner, report: str | None) -> None:
        self.tuner, self.report = tuner, report
        self.reports: list[str] = []

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.report is not None:
            sizes = sorted({r.size for r in self.tuner.results})
            note = "with activation checkpointing" if self.tuner.checkpointing else ""
            self.reports = report_sizes(trainer, pl_module, batch, sizes, self.report, note)
        raise _Measured


class _Progress(Callback):
    """Each trial's row on stderr as soon as it is measured (the tuner's ``on_trial``): on a slow device the search
    takes a while, and would otherwise be silent until the end."""

    tuner: AccumulationTuner
    size: Callable[[float], str] | None = None  # writes a peak in bytes

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.started = time.perf_counter()

    def __call__(self, result: TrialResult) -> None:
        took = time.perf_counter() - self.started
        checkpointed = ", activation checkpointing on" if self.tuner.checkpointing else ""
        print(f"memguard plan: {trial_row(result, self.size)}  ({took:.1f} s{checkpointed})", file=sys.stderr,
              flush=True)  # fmt: skip
        self.started = time.perf_counter()


def run_plan(cfg: PlanConfig, smallest: int) -> int:
    """Measures, then prints the choice, what it is expected to run at, every trial and the lines to paste; 1 (with
    the reason on stderr) where nothing fits. ``smallest``: the smallest micro-batch the search may try."""
    emu = emulated_card(cfg.capacity, cfg.cuda)
    progress = _Progress()
    tuner = AccumulationTuner(cfg.effective_batch, min_micro_batch=cfg.min_micro_batch, allow_checkpointing=True,
                              probe=emu.probe if emu is not None else None, cache=False, warmup_steps=cfg.warmup,
                              timed_steps=cfg.steps, on_trial=progress)  # fmt: skip
    progress.tuner, progress.size = tuner, _size(cfg)
    module = training_module(cfg.source, cfg.num_classes, cfg.image_size or 0, cfg.effective_batch, 64,
                             cfg.channels_last)  # fmt: skip
    stop = _StopBeforeTraining(tuner, cfg.report)
    callbacks: list[Callback] = [c for c in (emu, progress, tuner, stop) if c is not None]
    try:
        with run_folders("plan") as root:
            trainer = Trainer(
                accelerator="cuda" if cfg.cuda else "cpu", devices=1, precision=cfg.precision,  # type: ignore[arg-type]
                max_epochs=1, callbacks=callbacks, logger=False, enable_progress_bar=False,
                enable_checkpointing=False, enable_model_summary=False, limit_val_batches=0, default_root_dir=root,
            )  # fmt: skip
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                trainer.fit(module if cfg.backend is None else torch.compile(module, backend=cfg.backend))  # type: ignore[arg-type]
    except _Measured:
        pass
    except RuntimeError as err:
        if tuner.batch_size is None and tuner.results and not any(r.fits for r in tuner.results):
            print(f"memguard: {_nothing_fits(cfg, tuner.results, smallest)}", file=sys.stderr)
        else:
            print(f"memguard: {err}", file=sys.stderr)
        return 1
    (chosen,) = [r for r in tuner.results if r.size == tuner.batch_size and r.fits][-1:]
    extra = ", with activation checkpointing" if tuner.checkpointing else ""
    print(f"effective batch {cfg.effective_batch}: micro-batch {tuner.batch_size} x accumulate_grad_batches "
          f"{tuner.accumulate_grad_batches}{extra}")  # fmt: skip
    size = _size(cfg)
    print(f"expected: {chosen.samples_per_sec:.1f} samples/s, peak {size(chosen.peak_bytes or 0)}")
    if cfg.backend is not None:
        print(
            f"compiled ({cfg.backend}): the search took {tuner.search_s:.1f} s, {tuner.compile_s:.1f} s of it compiling"
        )
    print("measured:")
    for r in tuner.results:
        print(f"  {trial_row(r, size)}")
    print("paste:")
    print(f"  model.batch_size = {tuner.batch_size}")
    lines = f"Trainer(accumulate_grad_batches={tuner.accumulate_grad_batches}, callbacks=[MemGuard()"
    lines += ", ActivationCheckpointing()])" if tuner.checkpointing else "])"
    print(f"  {lines}")
    if stop.reports:
        print(f"memory reports: {', '.join(stop.reports)} (and .html beside each)")
    return 0


def run_levers(source: ModelSource, image_size: int, batch: int, budget: float | int, cuda: bool) -> int:
    """``memguard plan --levers``: :func:`~lightning_memguard.levers.plan_levers.plan_levers` on the network and one
    batch of random images; prints the plan, every set measured and the calls to paste; 1 where the budget is not
    met (the floor said)."""
    from lightning_memguard.levers.plan_levers import plan_levers

    device = torch.device("cuda" if cuda else "cpu")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        net = source.build().to(device).train()
        images = torch.randn(batch, 3, image_size, image_size, device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_levers(net, images, memory_budget=budget)
    size = size_formatter(plan.baseline_bytes)
    print(plan.summary())
    print("measured:")
    for what, peak in plan.tried:
        print(f"  {what}: peak {size(peak)}")
    print("paste:")
    for line in plan.calls() or ["nothing: the step already meets the budget"]:
        print(f"  {line}")
    return 0 if plan.held else 1


def _size(cfg: PlanConfig) -> Callable[[float], str]:
    """Peak memory in the unit that fits the card (an emulated one's capacity, the GPU's memory): "70.3 MB" on a card
    of 150 MB, not "0.07 GB"; on the CPU, each figure in its own."""
    capacity = cfg.capacity or (torch.cuda.get_device_properties(0).total_memory if cfg.cuda else None)
    if capacity is not None:
        return size_formatter(capacity, gb_digits=2)
    return format_size


def trial_row(r: Any, size: Callable[[float], str] | None = None) -> str:
    """One trial of plan's search: micro-batch x accumulation, outcome, throughput, peak memory (``size`` writes it;
    by default in the unit that fits it)."""
    size = size or format_size
    compiled = f"  compiled, {r.compile_s:.1f} s compiling" if r.compiled else ""
    return (f"{r.size:>5} x {r.accumulate:<3} {r.outcome:<13} {r.samples_per_sec or 0:>10.1f} samples/s"
            f"  peak {size(r.peak_bytes or 0)}{compiled}")  # fmt: skip


def _nothing_fits(cfg: PlanConfig, results: Sequence[Any], smallest: int) -> str:
    """Plan already falls back to activation checkpointing: what is left to change is the command's own input (a
    LightningModule's images are its own)."""
    tried = ", ".join(f"{r.size} x {r.accumulate}: {r.outcome}" for r in results)
    advice = [f"a smaller --effective-batch (now {cfg.effective_batch})"]
    if cfg.image_size is not None:
        advice.insert(0, f"a smaller --image-size (now {cfg.image_size})")
    if smallest > 1:
        advice.insert(0, f"a smaller --min-micro-batch (now {cfg.min_micro_batch})")
    return (
        f"nothing fits: not even a micro-batch of {smallest} trains on this device without spilling, with activation"
        f" checkpointing as well ({tried}); try {', or '.join(advice)}"
    )
