"""`memguard sweep`: the write-up's table on this machine, one short training run per batch size."""

from __future__ import annotations

import contextlib
import csv
import difflib
import importlib
import os
import signal
import statistics
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.parsing import lightning_hasattr, lightning_setattr
from torch import nn
from typing_extensions import override

from lightning_memguard import _compiler
from lightning_memguard.callbacks import MemGuard
from lightning_memguard.callbacks._reporting import StepReport
from lightning_memguard.core.epoch_record import SweepRow
from lightning_memguard.core.files import written_atomically
from lightning_memguard.core.units import GB, size_formatter, size_unit
from lightning_memguard.emulation.emulator import SysmemSpillEmulator
from lightning_memguard.emulation.models import ImageClassifier
from lightning_memguard.emulation.timing import StepTimer


@dataclass(frozen=True)
class ModelSource:
    """What ``--model`` names, and how to build it.

    ``family`` is ``"torchvision"`` or ``"timm"`` (a classifier of 1000 classes, built by name), ``"network"`` (the
    user's own ``nn.Module`` from images to class scores) or ``"LightningModule"`` (the user's own, with its data).
    ``own_size`` is the image size the model is made for, where it names one (torchvision's ``vit_b_16``: 224 px).
    """

    text: str
    family: str
    build: Callable[[], nn.Module]
    own_size: int | None = None

    @property
    def lightning(self) -> bool:
        return self.family == "LightningModule"


def model_source(text: str) -> ModelSource:
    """The model ``--model`` names: ``package.module:Callable``, else a torchvision classification model, else a timm
    one. Raises ``ValueError`` with a message that quotes ``text`` where it names none (or timm is not installed)."""
    if ":" in text:
        return _own_model(text)
    import torchvision

    names = torchvision.models.list_models(module=torchvision.models)
    if text in names:
        try:  # the smallest size its weights were trained for: vit_b_16's only size, Inception's minimum
            sizes = [w.meta.get("min_size") for w in torchvision.models.get_model_weights(text)]
        except ValueError:  # a model without weights names none
            sizes = []
        own = min((size[-1] for size in sizes if size), default=None)
        return ModelSource(text, "torchvision", partial(torchvision.models.get_model, text, weights=None), own)
    try:
        import timm
    except ImportError:
        raise ValueError(
            f"unknown model {text!r}: not a torchvision classification model such as resnet50, and timm is not"
            " installed for timm's (pip install timm); or give your own as package.module:Callable"
        ) from None
    if not timm.is_model(text):
        raise ValueError(
            f"unknown model {text!r}{_did_you_mean(text, [*names, *timm.list_models()])}: neither a torchvision nor a"
            " timm classification model (such as resnet50, or resnet10t); or give your own as package.module:Callable"
        )
    cfg = timm.get_pretrained_cfg(text)
    own = (cfg.min_input_size or cfg.input_size)[-1] if cfg is not None else None
    return ModelSource(text, "timm", partial(timm.create_model, text, pretrained=False, num_classes=1000), own)


def _did_you_mean(text: str, names: Sequence[str]) -> str:
    """ " (did you mean resnet50?)" where one of ``names`` is close to a mistyped ``text`` (restnet50), else ""."""
    close = difflib.get_close_matches(text.lower(), names, n=1, cutoff=0.8)
    return f" (did you mean {close[0]}?)" if close else ""


@contextlib.contextmanager
def _current_folder_importable() -> Iterator[None]:
    """``package.module`` is looked for in the folder the command runs in, as ``python -m`` would (the ``memguard``
    script alone would not)."""
    here = os.getcwd()
    added = here not in sys.path
    if added:
        sys.path.insert(0, here)
    try:
        yield
    finally:
        if added and here in sys.path:
            sys.path.remove(here)


def _own_model(text: str) -> ModelSource:
    """``package.module:Callable``, built once here with no arguments, to know what it builds."""
    module_name, _, name = text.partition(":")
    if not module_name or not name:
        raise ValueError(f"--model {text!r}: give your own model as package.module:Callable")
    try:
        with _current_folder_importable():
            found: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"--model {text}: cannot import {module_name!r} ({err})") from None
    for part in name.split("."):
        if not hasattr(found, part):
            raise ValueError(f"--model {text}: {module_name} has no {name!r}")
        found = getattr(found, part)
    if not callable(found):
        raise ValueError(f"--model {text}: {name} is not a class or a function, but {type(found).__name__}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            built = found()
    except Exception as err:
        raise ValueError(f"--model {text} cannot be built with no arguments: {_first_line(err)}") from None
    if isinstance(built, LightningModule):
        if not lightning_hasattr(built, "batch_size"):
            raise ValueError(
                f"--model {text}: a LightningModule without a batch_size attribute; sweep and plan set it for each"
                " run, and its train_dataloader() must build its batches from it"
            )
        return ModelSource(text, "LightningModule", found)
    if not isinstance(built, nn.Module):
        raise ValueError(f"--model {text} builds a {type(built).__name__}, not an nn.Module or a LightningModule")
    return ModelSource(text, "network", found)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def training_module(
    source: ModelSource,
    num_classes: int,
    image_size: int,
    batch_size: int,
    steps_per_epoch: int,
    channels_last: bool,
    pool_size: int = 64,
) -> LightningModule:
    """What sweep and plan train: torchvision's models, timm's and the user's own networks in an
    :class:`~lightning_memguard.emulation.models.ImageClassifier` (a network built here passed as its ``net``), each on
    random
    images; the user's LightningModule as it is, ``batch_size`` set."""
    if source.family == "torchvision":
        return ImageClassifier(
            source.text, num_classes=num_classes, image_size=image_size, batch_size=batch_size,
            steps_per_epoch=steps_per_epoch, channels_last=channels_last, pool_size=pool_size,
        )  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(0)
        built = source.build()
    if isinstance(built, LightningModule):
        lightning_setattr(built, "batch_size", batch_size)
        return built
    return ImageClassifier(
        source.text, num_classes=num_classes, image_size=image_size, batch_size=batch_size,
        steps_per_epoch=steps_per_epoch, channels_last=channels_last, pool_size=pool_size, net=built,
    )  # fmt: skip


@dataclass(frozen=True)
class SweepConfig:
    model: str = "resnet50"
    batch_sizes: tuple[int, ...] = (32, 64, 128, 256)
    image_size: int = 224
    precision: str = "bf16-mixed"
    channels_last: bool = False
    checkpoint: bool = False
    accumulate: int = 1
    steps: int = 16
    warmup: int = 5
    emulate_capacity: int | None = None
    device: str = "auto"
    compile: str | None = None  # a torch.compile backend ("inductor", "aot_eager", ...); None: eager
    num_classes: int = 1000  # the classes the network scores (a torchvision or timm model: 1000)
    source: ModelSource | None = None  # what `model` names, resolved already (None: resolved from `model`)
    report: str | None = None  # a folder for a memory report per batch size (None: none)


CPU_SPILL_COST = 5  # on the CPU a spilled byte costs, each way, 5x the step's time per byte saved: see emulated_card


def emulated_card(capacity: int | None, cuda: bool) -> SysmemSpillEmulator | None:
    """The card ``--emulate-capacity`` names (None: none). On CUDA its spilled tensors cross PCIe for real; on the
    CPU their round trip is charged relative to the step's own time (``spill_cost``), as a spill slows a card: at a
    fixed 25 GB/s it would vanish in the CPU's slow compute, and a larger batch, spilling, would still look faster
    beside its "cliff: spill" mark."""
    if not capacity:
        return None
    return SysmemSpillEmulator(capacity=capacity, spill_cost=None if cuda else CPU_SPILL_COST)


MAX_COMPILE_STEPS = 20  # a compiled run that keeps compiling is timed on what it has after this many more steps


class _TimeStepsThatRan(Callback):
    """A compiled run: an optimizer step during which Dynamo compiled (its graph counter moved,
    :func:`lightning_memguard._compiler.compiles`) is compile time, not step time, as in the tuners' trials. After
    ``minimum`` warm-up steps, ``steps`` steps that compiled nothing are timed, then training stops. Reads the
    counter, not the timer: no device sync while training."""

    def __init__(self, minimum: int, steps: int, accumulate: int) -> None:
        self.minimum, self.steps, self.accumulate = minimum, steps, accumulate
        self.compiled: list[bool] = []  # per optimizer step: whether Dynamo compiled during it
        self._compiles = _compiler.CompileWatch()
        self._batches = 0
        self._compiling = False

    @property
    def most(self) -> int:
        return self.minimum + self.steps + MAX_COMPILE_STEPS

    def timed(self) -> list[int]:
        """The optimizer steps to time: past the warm-up, and compiling nothing."""
        return [i for i, compiled in enumerate(self.compiled) if i >= self.minimum and not compiled]

    def split(self, times: Sequence[float]) -> tuple[list[float], float]:
        """The timed steps' times, and the compile time: the sum of the steps that compiled (``times`` per optimizer
        step, as the timer measured them)."""
        compiling = sum(t for t, compiled in zip(times, self.compiled, strict=False) if compiled)
        return [times[i] for i in self.timed() if i < len(times)], compiling

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._compiles = _compiler.CompileWatch()

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._compiling |= self._compiles.moved()  # since the last batch's end: a compile between batches counts
        self._batches += 1
        if self._batches % self.accumulate:
            return
        self.compiled.append(self._compiling)
        self._compiling = False
        if len(self.timed()) >= self.steps or len(self.compiled) >= self.most:
            trainer.should_stop = True


class _CtrlC(Callback):
    """Ctrl+C during a run, given back to the sweep as the ``KeyboardInterrupt`` it was: Lightning answers it inside
    ``fit`` with ``sys.exit(1)``, and ignores Ctrl+C from then on, which would end the command with no table."""

    def __init__(self) -> None:
        self.pressed = False

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self.pressed |= isinstance(exception, KeyboardInterrupt)

    @contextlib.contextmanager
    def given_back(self) -> Iterator[None]:
        handler = signal.getsignal(signal.SIGINT)
        try:
            yield
        except SystemExit:
            if not self.pressed:
                raise
            raise KeyboardInterrupt from None
        finally:
            if self.pressed and handler is not None and threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGINT, handler)  # Ctrl+C works again, as before the run


def run_one(cfg: SweepConfig, batch: int, root: str) -> tuple[SweepRow, float]:
    """Train at ``batch``; return its row and the capacity in GB. Eager: ``warmup + steps`` optimizer steps, the
    first ``warmup`` untimed. Compiled: a fresh static graph for this size (``dynamic=False``), ``warmup`` steps, then
    ``steps`` timed steps that compiled nothing; the steps that compiled are the row's ``compile_s``."""
    cuda = torch.cuda.is_available() if cfg.device == "auto" else cfg.device == "cuda"
    compiled = cfg.compile is not None
    steps = cfg.warmup + cfg.steps + (MAX_COMPILE_STEPS if compiled else 0)
    source = cfg.source or model_source(cfg.model)
    model = training_module(source, cfg.num_classes, cfg.image_size, batch, steps * cfg.accumulate + 1,
                            cfg.channels_last, pool_size=max(64, batch))  # fmt: skip
    if cfg.checkpoint:
        from lightning_memguard.checkpointing import checkpoint_blocks

        checkpoint_blocks(model if source.lightning else model.net)  # type: ignore[arg-type]
    if cfg.compile is not None:
        _compiler.forget_compiled()  # this size's own graph, compiled (and timed) here
        model = torch.compile(model, backend=cfg.compile, dynamic=False)  # type: ignore[assignment]
    emu = emulated_card(cfg.emulate_capacity, cuda)
    guard = MemGuard(
        probe=emu.probe if emu is not None else None, on_spill="warn", warmup_steps=1, reference_steps=2,
        memory_report=False,
    )  # fmt: skip
    timer = StepTimer(skip=0 if compiled else cfg.warmup)
    warmup = _TimeStepsThatRan(cfg.warmup, cfg.steps, cfg.accumulate) if compiled else None
    callbacks: list[Callback] = [c for c in (emu, guard, timer, warmup) if c is not None]
    if cfg.report is not None:  # measured on the first step, a warm-up step (untimed where there is one)
        # named as the user's model names its modules, not through the wrapper built here
        within = "" if source.lightning else "net"
        callbacks.append(StepReport(cfg.report, f"memguard-report-batch={batch}", within=within))
    interrupt = _CtrlC()
    callbacks.append(interrupt)
    trainer = Trainer(
        accelerator="cuda" if cuda else "cpu", devices=1, precision=cfg.precision,  # type: ignore[arg-type]
        max_steps=steps, max_epochs=-1 if source.lightning else 1, accumulate_grad_batches=cfg.accumulate,
        callbacks=callbacks, logger=False,
        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False, limit_val_batches=0,
        default_root_dir=root,
    )  # fmt: skip
    try:
        with warnings.catch_warnings(), interrupt.given_back():
            warnings.simplefilter("ignore")
            trainer.fit(model)
    except torch.OutOfMemoryError:
        timeline = guard._timeline
        capacity = guard.capacity or (timeline.detector.capacity if timeline is not None else 0)
        return SweepRow(batch, None, None, None, "oom", cfg.compile), capacity / 1e9
    finally:
        if compiled:
            _compiler.forget_compiled()
        if cuda:
            torch.cuda.empty_cache()
    times = timer.step_ms(cfg.accumulate)
    compile_s = None
    if warmup is not None:
        times, compiling_ms = warmup.split(times)
        compile_s = round(compiling_ms / 1e3, 3)
    step_ms = statistics.median(times) if times else None
    record = guard.epochs[-1]
    spilled = guard.spill is not None or (emu is not None and emu.total_spilled_bytes > 0)
    rate = batch * cfg.accumulate / step_ms * 1e3 if step_ms else None
    status = "spill" if spilled else "ok"
    return SweepRow(batch, step_ms, record.peak_allocated_gb, rate, status, cfg.compile, compile_s), record.capacity_gb


def write_csv(rows: Sequence[SweepRow], path: str) -> None:
    with written_atomically(path) as temporary, open(temporary, "w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(SweepRow.__dataclass_fields__))
        writer.writeheader()
        for row in rows:
            writer.writerow(row.to_dict())


def plot(rows: Sequence[SweepRow], capacity_gb: float, path: str, title: str) -> bool:
    """Throughput and peak memory against batch size, the capacity as a line, the cliff marked. False without
    matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in rows if r.samples_per_sec is not None]
    known = [capacity_gb] if capacity_gb > 0 else [r.peak_gb or 0.0 for r in ran]
    unit, scale, _ = size_unit(max(known, default=1.0) * GB)
    size = size_formatter(capacity_gb * GB, gb_digits=1)
    fig, ax = plt.subplots(figsize=(8, 4.8))
    ax.plot([r.batch for r in ran], [r.samples_per_sec or 0.0 for r in ran], "o-", color="tab:blue", label="samples/s")
    ax.set_xscale("log", base=2)
    ax.set_xticks([r.batch for r in rows], labels=[str(r.batch) for r in rows])
    ax.minorticks_off()
    ax.set_xlabel("batch size")
    ax.set_ylabel("samples/s", color="tab:blue")
    mem = ax.twinx()
    peaks = [(r.peak_gb or 0.0) * GB / scale for r in ran]
    mem.plot([r.batch for r in ran], peaks, "s--", color="tab:orange", label="peak memory")
    mem.axhline(capacity_gb * GB / scale, color="tab:red", linewidth=1, label=f"capacity {size(capacity_gb * GB)}")
    mem.set_ylabel(f"peak memory ({unit})", color="tab:orange")
    bad = [r for r in rows if r.status != "ok"]
    if bad:
        ax.axvspan(min(r.batch for r in bad) / 1.2, max(r.batch for r in rows) * 1.2, color="tab:red", alpha=0.08)
        ax.annotate("cliff: " + bad[0].status, (bad[0].batch, max(r.samples_per_sec or 0 for r in ran) * 0.95),
                    color="tab:red", fontsize=9)  # fmt: skip
    handles = ax.get_legend_handles_labels()[0] + mem.get_legend_handles_labels()[0]
    ax.legend(handles, [str(h.get_label()) for h in handles], fontsize=8, loc="upper left")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    try:
        with written_atomically(path) as temporary:
            fig.savefig(temporary, dpi=120, format="png")
    finally:
        plt.close(fig)
    return True


def sweep_title(cfg: SweepConfig, device: str) -> str:
    extras = [cfg.precision]
    if cfg.channels_last:
        extras.append("channels_last")
    if cfg.checkpoint:
        extras.append("checkpointed")
    if cfg.accumulate > 1:
        extras.append(f"x{cfg.accumulate} accumulation")
    if cfg.compile:
        extras.append(f"torch.compile ({cfg.compile}, one static graph per batch size)")
    if cfg.emulate_capacity:
        unit, scale, _ = size_unit(cfg.emulate_capacity)
        extras.append(f"emulated {cfg.emulate_capacity / scale:.4g} {unit} card with sysmem fallback")
    return f"{cfg.model} on {device}: " + ", ".join(extras)


def run_folders(command: str = "sweep") -> tempfile.TemporaryDirectory[str]:
    """Where the Trainers of ``memguard sweep`` (or ``plan``) keep their (unused) run folders: a temporary
    directory, not the output folder, removed when the command ends."""
    return tempfile.TemporaryDirectory(prefix=f"memguard-{command}-", ignore_cleanup_errors=True)
