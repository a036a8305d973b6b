"""MemGuard's memory report: on a spill, an out-of-memory error, allocator thrash and each adaptation, which modules
hold the step's memory, written beside the spill checkpoint.

Nothing is measured while training goes well: no hook exists until a report is wanted. Then one step is measured:

- *armed* on the batch in flight, where one is still coming and will train anyway (``"stop"``, ``"warn"``, thrash, an
  adaptation): the LightningModule's ``training_step`` is wrapped for that one step (every forward it runs, each
  micro-batch's under ``on_spill="adapt"``, is recorded), and the report is written when the batch has trained;
- *redone* where no batch will train (``"raise"``, a spill settled at an epoch's end, an out-of-memory error): the
  batch in hand (the epoch's last, kept for this), or after an out-of-memory error a part of it (halved until it
  fits, the activations scaled back), runs forward and backward through ``training_step`` with logging off, and the
  gradients, buffers and random generators are put back (:func:`~lightning_memguard.forensics.attribution.step_undone`).
  Before an out-of-memory error's step is redone, what the failed step held is let go: the frames of the error's
  traceback drop their local variables (the activations they kept; a post-mortem debugger then sees none), and the
  allocator's cache is emptied. The report says how often ``training_step`` ran again, and on how many samples, and
  is written even where no part fits (weights, gradients and optimizer state, no activations).

Each report says what happened on the card
(:class:`~lightning_memguard.forensics.memory_report.Situation`): the capacity
MemGuard judges against, other processes' memory at its latest reading, a spill's peak as its message gives it, and
the batch.

Every rank measures its own step; under several processes each writes its own report, its rank in the file name.
A report that cannot be measured or written never hides what it reports on: the message then says why.
"""

from __future__ import annotations

import dataclasses
import os
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from typing_extensions import override

from lightning_memguard import _autograd, _compiler
from lightning_memguard._lightning.batches import samples_in, split_batch
from lightning_memguard._lightning.spill_checkpoint import checkpoint_folder
from lightning_memguard.core.spill import SpillReport
from lightning_memguard.forensics.attribution import (
    Forward,
    SavedTensorRecorder,
    StepMemory,
    assemble,
    inside,
    measure_step,
    model_facts,
    resting_bytes,
)
from lightning_memguard.forensics.memory_report import MemoryReport, Situation
from lightning_memguard.probes.cuda import CudaProbe
from lightning_memguard.tuning.adapter import free_memory

HISTORY_ENTRIES = 100_000  # allocator events kept by ``record_memory=True``: the latest, a ring


class MemoryReports:
    """The reports of one fit: when to measure, how, and where they go.

    Args:
        enabled: write reports (``MemGuard(memory_report=...)``).
        record: record the CUDA allocator's history from fit start to teardown (``MemGuard(record_memory=...)``).
        spill_checkpoint: the spill checkpoint's folder choice (``True``, a folder, or ``False``: Lightning's folder).
    """

    def __init__(self, enabled: bool, record: bool, spill_checkpoint: bool | str | os.PathLike[str]) -> None:
        self.enabled = enabled
        self.record = record
        self.spill_checkpoint = spill_checkpoint
        self.paths: list[str] = []  # each report's JSON file, in order
        self._recording = False
        self._warned_record = False
        self._in_flight: tuple[Any, int] | None = None  # the batch whose training step has not run yet
        self._last: tuple[Any, int] | None = None  # the epoch's last batch, kept for a report at the epoch's end
        self._armed: _Armed | None = None
        self._thrash: int | None = None  # the allocator's retries at the last reading
        self._thrash_said = False
        # the allocator's peaks (allocated, reserved) before an armed step reset them on CUDA: MemGuard's readings,
        # which read the same counters, take them into account until MemGuard resets the peak itself
        self.carried: tuple[int, int] | None = None
        self._counts_cuda = False
        self._probe: Any = None
        self.capacity: int | None = None  # the memory MemGuard judges against (set at fit start)
        self.others: int | None = None  # other processes' memory at MemGuard's latest reading

    # ------------------------------------------------------------------ fit

    def start(self, trainer: Trainer, probe: Any) -> None:
        """Fit start: forget the last fit's reports; record the allocator's history where asked. ``probe``:
        MemGuard's; where it reads PyTorch's CUDA counters, a measured step's reset of them is carried over."""
        self._counts_cuda = isinstance(probe, CudaProbe)
        self._probe = probe
        self.others = None
        self.carried = None
        self.paths = []
        self._in_flight = self._last = self._armed = None
        self._thrash, self._thrash_said = None, False
        if not self.record:
            return
        if trainer.strategy.root_device.type != "cuda":
            if not self._warned_record:
                self._warned_record = True
                rank_zero_warn(
                    "MemGuard(record_memory=True) records the CUDA allocator's history, and this Trainer runs on"
                    f" {trainer.strategy.root_device.type!r}: nothing is recorded; the reports are measured as usual"
                )
            return
        _autograd.record_memory_history(HISTORY_ENTRIES)
        self._recording = True

    def stop(self) -> None:
        """Teardown: the step wrapper and the allocator's history recording removed."""
        self._disarm()
        self._in_flight = self._last = None
        if self._recording:
            self._recording = False
            _autograd.record_memory_history(None)

    # ------------------------------------------------------------------ batches

    def batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.enabled:
            self._in_flight = (batch, batch_idx)

    def batch_end(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> str | None:
        """The batch trained: an armed measurement is written, and its note (naming the report) returned (None where
        none was armed); the epoch's last batch is kept (a spill found at the epoch's end is measured on it), any
        other forgotten."""
        self._in_flight = None
        armed = self._armed
        note = None
        if armed is not None:
            self._disarm()
            note = self._armed_report(trainer, pl_module, armed)
        if self.enabled:
            last = batch_idx + 1 >= trainer.num_training_batches
            self._last = (batch, batch_idx) if last else None
        return note

    def epoch_start(self) -> None:
        self._last = None

    @property
    def can_arm(self) -> bool:
        """Whether a batch is in flight whose training step is still to run (MemGuard is in its batch start)."""
        return self.enabled and self._in_flight is not None

    # ------------------------------------------------------------------ the triggers

    def situation(self, batch: Any = None, spill: SpillReport | None = None, grew_back: str | None = None) -> Situation:
        """What happened on the card: a spill's own figures (those its message gives), else MemGuard's capacity and
        latest reading of other processes; ``batch``: the batch that ran."""
        samples = samples_in(batch) if batch is not None else None
        if spill is not None:
            return Situation(spill.capacity, spill.other_bytes, spill.used_bytes, samples, grew_back)
        return Situation(self.capacity, self.others, None, samples, grew_back)

    def arm(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        why: str,
        spill: SpillReport | None = None,
        grew_back: str | None = None,
    ) -> None:
        """Measure the batch in flight as it trains (one report for every reason armed in one step: the first
        one's); :meth:`batch_end` returns its note once it is written. ``spill``: the spill reported on;
        ``grew_back``: an adaptation to fewer micro-batches, in words."""
        if self._armed is not None:
            return
        flight = self._in_flight[0] if self._in_flight is not None else None
        armed = _Armed(why, trainer.global_step, pl_module, self.situation(flight, spill, grew_back))
        self._armed = armed
        armed.install()
        if armed.prior is not None:
            self._carry(armed.prior)

    def _carry(self, prior: tuple[int, int] | None = None) -> None:
        """The allocator's peaks before a measured step resets them on CUDA (``prior``, else read now), kept for
        MemGuard's readings."""
        if prior is None:
            if not torch.cuda.is_available() or not torch.cuda.is_initialized():
                return
            prior = (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())
        previous = self.carried or (0, 0)
        self.carried = (max(previous[0], prior[0]), max(previous[1], prior[1]))

    def with_carried(self, reading: Any) -> Any:
        """``reading`` (a ``MemoryReading``) with the peaks an armed step's reset took from the allocator's counters.

        Only a reading of those counters (MemGuard's CUDA probe) is changed: another probe's figures are its own."""
        carried = self.carried
        if carried is None or not self._counts_cuda:
            return reading
        return dataclasses.replace(
            reading,
            peak_allocated=max(reading.peak_allocated, carried[0]),
            peak_reserved=max(reading.peak_reserved, carried[1]),
        )

    def now(self, trainer: Trainer, pl_module: LightningModule, why: str, spill: SpillReport | None = None) -> str:
        """Measure at once, on the batch in flight or the epoch's last, by redoing its step; the note naming the
        report (or why there is none). ``spill``: the spill reported on."""
        if not self.enabled:
            return ""
        held = self._in_flight or self._last
        if held is None:
            return "\nNo memory report: no training batch was at hand to measure."
        if not pl_module.automatic_optimization:
            return "\nNo memory report: a model that optimizes manually cannot have a step redone without training."
        batch, batch_idx = held
        self._carry()
        try:
            memory = _redo(trainer, pl_module, batch, batch_idx)
        except Exception as err:  # a report never hides the spill
            return f"\nNo memory report: its measurement failed ({type(err).__name__}: {err})."
        return self._write(trainer, memory, why, situation=self.situation(batch, spill))

    def out_of_memory(self, trainer: Trainer, pl_module: LightningModule, error: BaseException) -> None:
        """An out-of-memory error ended the run: what the failed step held freed, a part of its batch measured and
        scaled (halved while it runs out of memory, each run said in the report), the report written even where no
        part fits; the error's message names the report."""
        if not self.enabled or not isinstance(error, torch.OutOfMemoryError):
            return
        self._disarm()
        held, self._in_flight = self._in_flight, None
        if held is None or not pl_module.automatic_optimization:
            return
        batch, batch_idx = held
        situation = self._failed_situation(batch)
        _let_go(error)  # before anything runs again: the failed step's activations, held by its frames
        samples = samples_in(batch) or 1
        runs: list[str] = []
        memory, note = None, ""
        chunks = 2
        while chunks <= samples and memory is None:
            free_memory()
            part = _part(batch, samples, chunks)
            measured = samples_in(part) or 1
            try:
                memory = _redo(trainer, pl_module, part, batch_idx, scale=samples / measured)
            except torch.OutOfMemoryError as failed:
                _let_go(failed)  # its frames hold its activations as the failed step's did
                runs.append(f"{measured} samples: out of memory")
                chunks = samples + 1 if chunks == samples else min(chunks * 2, samples)  # down to one sample
                continue
            except Exception as err:
                runs.append(f"{measured} samples: failed, {type(err).__name__}: {err}")
                break
            runs.append(f"{measured} samples: measured")
        if memory is None:  # what rests on the card, without activations: still the report of this error
            free_memory()
            memory = _resting(trainer, pl_module)
            note = "no part of the batch could be measured: activations unknown"
        memory.samples = samples
        again = (
            f"training_step ran {len(runs)} time{'s' if len(runs) > 1 else ''} more to measure this ({'; '.join(runs)})"
            if runs
            else "training_step did not run again"
        )
        note = f"{note}; {again}" if note else again
        said = self._write(trainer, memory, "out_of_memory", note=note, situation=situation)
        if error.args and isinstance(error.args[0], str):
            error.args = (error.args[0] + "\n" + said.lstrip("\n"), *error.args[1:])

    def read_now(self) -> Any:
        """MemGuard's probe, read now (a :class:`~lightning_memguard.core.reading.MemoryReading`).

        Raises:
            RuntimeError: outside a fit (no probe yet).
        """
        if self._probe is None:
            raise RuntimeError("MemoryReports.read_now: no probe outside a fit")
        return self._probe.read()

    def _failed_situation(self, batch: Any) -> Situation:
        """The card when the step failed, read before anything is freed: the failed step's peak (on CUDA, where
        MemGuard's probe reads PyTorch's counters) with other processes' memory."""
        situation = self.situation(batch)
        if self._probe is None:
            return situation
        try:
            reading = self.with_carried(self._probe.read())
        except Exception:  # a report never hides the error
            return situation
        others = reading.other_processes if reading.other_processes is not None else self.others
        return dataclasses.replace(situation, others=others, judged=reading.used if self._counts_cuda else None)

    def retries_grew(self, retries: int | None) -> bool:
        """Whether the allocator retried more allocations (freeing its cache to make room) since the last reading:
        thrash. Said once a fit."""
        if retries is None:
            return False
        before, self._thrash = self._thrash, retries
        if before is None or retries <= before or self._thrash_said:
            return False
        self._thrash_said = True
        return True

    # ------------------------------------------------------------------ measuring and writing

    def _armed_report(self, trainer: Trainer, pl_module: LightningModule, armed: _Armed) -> str:
        try:
            memory = armed.memory(trainer)
        except Exception as err:  # a report never hides what it reports on
            return f"\nNo memory report: its measurement failed ({type(err).__name__}: {err})."
        return self._write(trainer, memory, armed.why, armed.step, situation=armed.situation)

    def _write(
        self,
        trainer: Trainer,
        memory: StepMemory,
        why: str,
        step: int | None = None,
        note: str = "",
        situation: Situation | None = None,
    ) -> str:
        step = trainer.global_step if step is None else step
        chosen = None if isinstance(self.spill_checkpoint, bool) else self.spill_checkpoint
        rank = f"-rank={trainer.global_rank}" if trainer.world_size > 1 else ""
        stem = f"memguard-report-step={step}-{why}{rank}"
        report = MemoryReport.from_step(memory, why, step, note=note, situation=situation)
        snapshot = _autograd.dump_memory_snapshot if self._recording else None
        try:
            paths = report.write(checkpoint_folder(trainer, chosen), stem, snapshot)
        except Exception as err:  # a full disk: the message still carries the verdict
            return f"\nThe memory report could not be written ({type(err).__name__}: {err}):\n{report.verdict()}"
        self.paths.append(paths[0])
        lines = report.verdict(situation=False).splitlines()
        return f"\nMemory report: {paths[1]} (and .json)\n" + "\n".join(lines[:2] + lines[-1:])

    def _disarm(self) -> None:
        if self._armed is not None:
            self._armed.remove()
            self._armed = None


class _Armed:
    """The LightningModule's ``training_step`` wrapped on the instance for one step: each call is one recorded
    forward pass (a micro-batch's under ``on_spill="adapt"``)."""

    def __init__(
        self,
        why: str,
        step: int,
        pl_module: LightningModule,
        situation: Situation | None = None,
    ) -> None:
        self.why = why
        self.situation = situation
        self.step = step
        self.module = pl_module
        self.compiled = _compiler.is_compiled(pl_module)
        self.recorder = SavedTensorRecorder(pl_module, modules=not self.compiled)
        self.prior: tuple[int, int] | None = None  # the allocator's peaks before this step reset them (CUDA)
        self.active = False
        self.wrapper: Callable[..., Any] | None = None
        self.cuda = pl_module.device.type == "cuda" and torch.cuda.is_available()
        self._own = pl_module.__dict__.get("training_step")

    def install(self) -> None:
        module, recorder = self.module, self.recorder
        step = module.training_step

        def training_step(*args: Any, **kwargs: Any) -> Any:
            if not self.active:  # removed, while another wrapper set after this one still calls it
                return step(*args, **kwargs)
            with recorder.on(args[0] if args else None):  # the batch is not an activation
                recorder.forwards[-1].samples = samples_in(args[0]) if args else None
                return step(*args, **kwargs)

        self.wrapper = training_step
        self.active = True
        module.training_step = training_step  # type: ignore[method-assign]
        if self.cuda:  # the step's own peak: reset here, what came before kept in `prior`
            self.prior = (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())
            torch.cuda.reset_peak_memory_stats()

    def remove(self) -> None:
        """Unwrapped: the instance's own ``training_step`` back, where no one wrapped it after this; else this
        wrapper only calls through from now on."""
        self.active = False
        if self.module.__dict__.get("training_step") is not self.wrapper:
            return
        if self._own is not None:
            self.module.training_step = self._own  # type: ignore[method-assign]
        else:
            del self.module.__dict__["training_step"]

    def memory(self, trainer: Trainer) -> StepMemory:
        """The step's figures: its largest forward, the resting parts now, the peak where the allocator moved it."""
        module = self.module
        classes, blocks, vocabularies = model_facts(module)
        weights, gradients, optimizer = resting_bytes(module, list(trainer.optimizers))
        forward = self.recorder.largest()
        peak = torch.cuda.max_memory_allocated() if self.prior is not None else None
        memory = assemble(forward, weights, gradients, optimizer, peak, classes, blocks, vocabularies)
        memory.samples = forward.samples
        memory.device = str(module.device)
        memory.compiled = self.compiled
        return memory


def _redo(trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, scale: float = 1) -> StepMemory:
    """The step of ``batch`` run again through ``training_step`` (logging off, the Trainer's precision), measured and
    undone."""

    def run() -> Any:
        with trainer.precision_plugin.train_step_context():
            return pl_module.training_step(batch, batch_idx)

    with _logging_off(pl_module):
        compiled = _compiler.is_compiled(pl_module)
        memory = measure_step(pl_module, run, list(trainer.optimizers), scale, samples_in(batch), compiled, batch)
    memory.device = str(pl_module.device)
    return memory


@contextmanager
def _logging_off(pl_module: LightningModule) -> Iterator[None]:
    """``self.log`` and ``self.log_dict`` do nothing inside: a redone step logs nothing twice. Set on the instance,
    removed on exit."""
    own = {name: pl_module.__dict__[name] for name in ("log", "log_dict") if name in pl_module.__dict__}

    def nothing(*args: Any, **kwargs: Any) -> None:
        return None

    pl_module.log = nothing  # type: ignore[method-assign]
    pl_module.log_dict = nothing  # type: ignore[method-assign]
    try:
        yield
    finally:
        for name in ("log", "log_dict"):
            if name in own:
                setattr(pl_module, name, own[name])
            else:
                pl_module.__dict__.pop(name, None)


def _let_go(error: BaseException) -> None:
    """The frames of ``error``'s traceback, and of the errors it arose from, drop their local variables (a failed
    step's activations); the frames still running keep theirs."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)
        current = current.__cause__ or current.__context__
    free_memory()


def _resting(trainer: Trainer, pl_module: LightningModule) -> StepMemory:
    """The step without its activations: the weights, gradients and optimizer state held now."""
    classes, blocks, vocabularies = model_facts(pl_module)
    weights, gradients, optimizer = resting_bytes(pl_module, list(trainer.optimizers))
    memory = assemble(Forward(), weights, gradients, optimizer, None, classes, blocks, vocabularies)
    memory.device = str(pl_module.device)
    return memory


def _part(batch: Any, samples: int, chunks: int) -> Any:
    return split_batch(batch, samples, chunks)[0][0]


def resized(batch: Any, samples: int, size: int) -> Any:
    """``batch`` with ``size`` samples: its first ``size``, or its samples repeated (every tensor holding ``samples``
    rows; the others as they are). A batch of another size that costs the memory a real one would.

    Example:
        >>> x, y = torch.arange(6).reshape(3, 2), torch.arange(3)
        >>> [tuple(t.shape) for t in resized((x, y), 3, 7)], resized((x, y), 3, 2)[1].tolist()
        ([(7, 2), (7,)], [0, 1])
    """

    def cut(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0 or t.shape[0] != samples:
            return t
        repeats = -(-size // samples)
        return t.repeat(repeats, *([1] * (t.dim() - 1)))[:size] if repeats > 1 else t[:size]

    return apply_to_collection(batch, torch.Tensor, cut)


class StepReport(Callback):
    """``memguard sweep --report``: the run's training batch ``at`` measured as it trains (one of the sweep's untimed
    warm-up steps), its report (``why="sweep"``) written to ``folder`` as ``<stem>.json`` and ``.html``. ``within``:
    the attribute of the LightningModule that holds the user's own model (the sweep's wrapper's ``net``): modules are
    named as that model names them."""

    def __init__(self, folder: str, stem: str, at: int = 0, within: str = "") -> None:
        self.folder, self.stem, self.at, self.within = folder, stem, at, within
        self.paths: list[str] = []
        self._armed: _Armed | None = None

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.at and not self.paths and self._armed is None:
            self._armed = _Armed("sweep", trainer.global_step, pl_module)
            self._armed.install()

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        armed, self._armed = self._armed, None
        if armed is None:
            return
        armed.remove()
        memory = armed.memory(trainer)
        if self.within:
            memory = inside(memory, self.within)
        situation = Situation(batch=samples_in(batch))
        self.paths = MemoryReport.from_step(memory, "sweep", situation=situation).write(self.folder, self.stem)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._armed is not None:
            self._armed.remove()
            self._armed = None


def report_sizes(
    trainer: Trainer, pl_module: LightningModule, batch: Any, sizes: list[int], folder: str, note: str = ""
) -> list[str]:
    """``memguard plan --report``: for each micro-batch size, the batch in hand at that size (cut or repeated) redone
    and undone, measured (on a part, scaled, where it runs out of memory) and its report written as
    ``memguard-report-micro-batch=<size>``. Returns the JSON files written."""
    samples = samples_in(batch) or 1
    written = []
    for size in sizes:
        chunks, memory = 1, None
        while memory is None and chunks <= size:
            free_memory()
            part = resized(batch, samples, max(1, size // chunks))
            try:
                memory = _redo(trainer, pl_module, part, 0, scale=size / max(1, size // chunks))
            except torch.OutOfMemoryError:
                chunks *= 2
        if memory is None:
            continue
        memory.samples = size
        report = MemoryReport.from_step(memory, "plan", note=note)
        written.append(report.write(folder, f"memguard-report-micro-batch={size}")[0])
    return written
