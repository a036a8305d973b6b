"""Running short training trials inside a Trainer, and putting everything back afterwards."""

from __future__ import annotations

import os
import statistics
import time
import uuid
from collections.abc import Callable
from copy import deepcopy
from typing import Any

import torch
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers.logger import DummyLogger
from lightning.pytorch.utilities.memory import garbage_collection_cuda, is_oom_error
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr

from lightning_memguard.core.search import OOM, TrialResult, classify_trial
from lightning_memguard.probes import MemoryProbe


class _StepClock(Callback):
    """Times each training batch of a trial; on CUDA it waits for the device so each time is the real one.

    After the first optimizer step it reads memory once: a trial whose peak is already above the capacity has
    spilled, whatever its timing, so it ends there instead of spending its remaining (slow) steps.
    """

    def __init__(self, cuda: bool, clock: Callable[[], float], probe: MemoryProbe, capacity: int, accumulate: int):
        self.cuda = cuda
        self.clock = clock
        self.probe, self.capacity, self.accumulate = probe, capacity, accumulate
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.starts.append(self.clock())
        if len(self.starts) == self.accumulate + 1:
            reading = self.probe.read()
            over = reading.used > self.capacity
            if trainer.strategy.reduce_boolean_decision(over, all=False):  # every rank ends the trial together
                trainer.should_stop = True

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.starts.append(self.clock())


def require_batch_size_attribute(trainer: Trainer, batch_arg_name: str) -> None:
    """Fail early, as Lightning's tuner would, when no model, hparams or datamodule attribute holds the size."""
    if not lightning_hasattr(trainer.lightning_module, batch_arg_name):
        raise ValueError(
            f"no `{batch_arg_name}` attribute on the model, its hparams or the datamodule; the tuner sets the batch"
            " size there, as Lightning's BatchSizeFinder does (use `batch_arg_name` to name another attribute)"
        )


def set_batch_size(trainer: Trainer, batch_arg_name: str, size: int) -> None:
    lightning_setattr(trainer.lightning_module, batch_arg_name, size)


def get_batch_size(trainer: Trainer, batch_arg_name: str) -> int:
    return int(lightning_getattr(trainer.lightning_module, batch_arg_name))  # type: ignore[arg-type]


def reload_train_dataloader(trainer: Trainer) -> None:
    loop = trainer.fit_loop
    loop._combined_loader = None  # force a rebuild with the new batch size
    loop.setup_data()


class TrialSession:
    """Inside ``with TrialSession(...) as trials:``, ``trials.run(size, accumulate)`` measures a few training steps.

    On entry the full training state is saved as a checkpoint, with RNG states, the Trainer's limits, loggers and
    callbacks. On exit, whether the trials succeeded, hit OOM or were interrupted, all of it is restored bit for bit
    and the dataloaders are rebuilt. Callbacks with ``memguard_keep_in_trials = True`` (the spill emulator) stay
    active during trials; the others are switched off.
    """

    def __init__(
        self,
        trainer: Trainer,
        batch_arg_name: str,
        probe: MemoryProbe,
        capacity: int,
        headroom: float,
        warmup_steps: int,
        timed_steps: int,
        collapse: float = 2.5,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.trainer = trainer
        self.batch_arg_name = batch_arg_name
        self.probe = probe
        self.capacity = capacity
        self.headroom = headroom
        self.warmup_steps = warmup_steps
        self.timed_steps = timed_steps
        self.collapse = collapse
        self.clock = clock
        self.best_rate: float | None = None
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> TrialSession:
        t = self.trainer
        path = os.path.join(t.default_root_dir, f".memguard_trials_{uuid.uuid4().hex}.ckpt")
        path = t.strategy.broadcast(path)  # one file for all ranks: rank zero writes it, every rank reads it
        t.save_checkpoint(path)
        self._saved = {
            "ckpt": path,
            "rng": _collect_rng_states(include_cuda=torch.cuda.is_initialized()),
            "loggers": t.loggers,
            "callbacks": t.callbacks,  # type: ignore[attr-defined]
            "max_steps": t.fit_loop.epoch_loop.max_steps,
            "limit_train_batches": t.limit_train_batches,
            "limit_val_batches": t.limit_val_batches,
            "accumulate_grad_batches": t.accumulate_grad_batches,
            "loop_state": deepcopy(t.fit_loop.state_dict()),
            "batch_size": get_batch_size(t, self.batch_arg_name),
            "progress_bar": t.progress_bar_callback,
            "should_stop": t.should_stop,
        }
        t.logger = DummyLogger() if t.logger is not None else None
        t.limit_train_batches = 1.0
        t.limit_val_batches = 0
        if t.progress_bar_callback is not None:
            t.progress_bar_callback.disable()
        return self

    def __exit__(self, *exc: object) -> None:
        t, saved = self.trainer, self._saved
        t.loggers = saved["loggers"]
        t.callbacks = saved["callbacks"]  # type: ignore[attr-defined]
        t.fit_loop.epoch_loop.max_steps = saved["max_steps"]
        t.limit_train_batches = saved["limit_train_batches"]
        t.limit_val_batches = saved["limit_val_batches"]
        t.accumulate_grad_batches = saved["accumulate_grad_batches"]
        t.should_stop = saved["should_stop"]  # a trial cut short must not stop the real run
        set_batch_size(t, self.batch_arg_name, saved["batch_size"])
        t.fit_loop.load_state_dict(deepcopy(saved["loop_state"]))
        t.fit_loop.restarting = False
        t._checkpoint_connector.restore(saved["ckpt"])
        t.strategy.barrier("memguard-trials-restored")  # nobody deletes the file while another rank reads it
        t.strategy.remove_checkpoint(saved["ckpt"])
        if saved["progress_bar"] is not None:
            saved["progress_bar"].enable()
        reload_train_dataloader(t)
        t.fit_loop.reset()
        garbage_collection_cuda()
        _set_rng_states(saved["rng"])

    def run(self, size: int, accumulate: int = 1) -> TrialResult:
        """Train ``warmup_steps + timed_steps`` optimizer steps at ``size`` (and ``accumulate``) and measure them."""
        t = self.trainer
        cuda = t.strategy.root_device.type == "cuda"
        clock = _StepClock(cuda, self.clock, self.probe, self.capacity, accumulate)
        keep = [c for c in self._saved["callbacks"] if getattr(c, "memguard_keep_in_trials", False)]
        t.callbacks = [*keep, clock]  # type: ignore[attr-defined]
        t.should_stop = False
        t.accumulate_grad_batches = accumulate
        set_batch_size(t, self.batch_arg_name, size)
        steps = self.warmup_steps + self.timed_steps
        t.fit_loop.load_state_dict(deepcopy(self._saved["loop_state"]))
        t.fit_loop.restarting = False
        t.fit_loop.epoch_loop.max_steps = steps
        t.limit_train_batches = steps * accumulate
        _reset_progress(t)
        reload_train_dataloader(t)
        if cuda:  # the last trial's cached blocks would count as this one's reserved peak
            torch.cuda.empty_cache()  # (a full garbage collection runs only after a failed trial and at the end)
        self.probe.reset_peak()
        try:
            t.fit_loop.run()
        except (torch.OutOfMemoryError, RuntimeError) as err:
            if not (isinstance(err, torch.OutOfMemoryError) or is_oom_error(err)):
                raise
            del err
            garbage_collection_cuda()
            return TrialResult(size, None, None, None, OOM, accumulate)
        reading = self.probe.read()
        peak = reading.used
        times = [b - a for a, b in zip(clock.starts[:-1], clock.starts[1:], strict=True)]
        # one optimizer step is `accumulate` batches: time whole steps, after the warm-up ones
        steps_s = [sum(times[i : i + accumulate]) for i in range(0, len(times) - accumulate + 1, accumulate)]
        timed = steps_s[self.warmup_steps :] or steps_s
        step_s = statistics.median(timed) if timed else float("nan")
        rate = size * accumulate / step_s if step_s > 0 else 0.0
        outcome = classify_trial(peak, self.capacity, self.headroom, rate, self.best_rate, self.collapse)
        result = TrialResult(size, round(step_s * 1e3, 4), peak, round(rate, 3), outcome, accumulate)
        return result


def _reset_progress(trainer: Trainer) -> None:
    loop = trainer.fit_loop
    if trainer.lightning_module.automatic_optimization:
        loop.epoch_loop.automatic_optimization.optim_progress.reset()
    else:
        loop.epoch_loop.manual_optimization.optim_step_progress.reset()
    loop.epoch_progress.reset()
    loop.epoch_loop.batch_progress.reset()
