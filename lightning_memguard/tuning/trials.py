"""Running short training trials inside a Trainer, and putting everything back afterwards."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from copy import deepcopy
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers.logger import DummyLogger
from lightning.pytorch.utilities.memory import garbage_collection_cuda, is_oom_error
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_memguard import _compiler
from lightning_memguard._lightning.batches import Path, loader_name, loader_parts, loader_paths, samples_in
from lightning_memguard._lightning.loaders import about_the_run_only, reload_train_dataloader, rng_kept
from lightning_memguard._lightning.privates import (
    load_loop_state,
    loader_passed_to_fit,
    loop_limits,
    loop_state,
    one_more_step,
    reset_fit_loop,
    reset_progress,
    rng_states,
    run_fit_loop,
    set_loop_limits,
    set_rng_states,
    strategy_methods_replaced,
)
from lightning_memguard.core.capacity import judged_capacity
from lightning_memguard.core.spill import Evidence, shared_baseline
from lightning_memguard.core.throughput import group_steps, time_trial
from lightning_memguard.probes import MemoryProbe, probe_for
from lightning_memguard.tuning.search import OK, OOM, TrialResult, trial_outcome
from lightning_memguard.tuning.sharded_agreement import (
    AgreedOutOfMemory,
    OutOfMemoryEndsRun,
    UnitPoints,
    fsdp_units,
)
from lightning_memguard.tuning.training_state import (
    holds_shards,
    host_copy,
    interrupts_held,
    load_training_state,
    training_state,
)
from lightning_memguard.tuning.tuner_settings import TunerSettings


class _StepClock(Callback):
    """Times each training batch of a trial and counts the samples it really holds, every loader's where several
    make one batch (a ``CombinedLoader``).

    On CUDA it waits for the device so each time is the real one. After the first optimizer step it reads memory
    once: a trial whose peak already leaves no headroom (or is above the capacity: a spill) does not fit, whatever
    its timing, so every rank ends it there instead of spending its remaining (slow) steps.

    A step in which ``torch.compile`` compiled (the first at a new size) is compile time, not step time: it is
    marked, and the trial gets one more step in its place (at most ``max_compile_steps`` of them).
    """

    max_compile_steps = 3

    def __init__(
        self,
        cuda: bool,
        clock: Callable[[], float],
        probe: MemoryProbe,
        capacity: int,
        headroom: float,
        size: int,
        accumulate: int,
        baseline: int = 0,
    ) -> None:
        self.baseline = baseline  # what the driver counted in system RAM before the trials (Windows)
        self.cuda = cuda
        self.size = size
        self.clock = clock
        self.probe, self.capacity, self.headroom, self.accumulate = probe, capacity, headroom, accumulate
        # (time, samples of each loader's part) at each batch start; (time, None): an epoch's end
        self.marks: list[tuple[float, tuple[int, ...] | None]] = []
        self.paths: list[Path] | None = None  # where each loader's part sits in a batch; None: a single loader
        self.compiled: list[bool] = []  # per batch: whether torch.compile compiled during it
        self._compiles = _compiler.CompileWatch()
        self.extended = 0
        self.batches = 0
        self.cut = False

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return self.clock()

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.paths = loader_paths(trainer.train_dataloader)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        parts = [samples_in(part) for part in loader_parts(batch, self.paths)]
        # a part whose size cannot be read counts as the size set
        self.marks.append((self._now(), tuple(self.size if n is None else n for n in parts)))

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.compiled.append(self._compiles.moved())
        self.batches += 1
        step_done = self.batches % self.accumulate == 0
        if step_done and any(self.compiled[-self.accumulate :]) and self.extended < self.max_compile_steps:
            self.extended += 1  # a step that compiled is not timed: one more takes its place
            one_more_step(trainer)
        if self.batches == self.accumulate:  # the first optimizer step is done: its peak is known
            over = (
                trial_outcome(Evidence(self.probe.read(), self.capacity, self.headroom, shared_baseline=self.baseline))
                != OK
            )
            if trainer.strategy.reduce_boolean_decision(over, all=False):  # every rank ends the trial together
                self.cut = True
                trainer.should_stop = True

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.marks.append((self._now(), None))

    def steps(self) -> list[tuple[float, int, bool]]:
        """(seconds, samples, compiled) of each optimizer step as Lightning runs them (``accumulate`` batches, and
        what is left at an epoch's end: :func:`~lightning_memguard.core.throughput.group_steps`), each batch timed to
        the next mark; ``compiled``: torch.compile compiled during one of them."""
        epochs: list[list[tuple[float, int, bool]]] = [[]]
        batch = 0
        for (t, parts), (after, _) in zip(self.marks, self.marks[1:], strict=False):
            if parts is None:  # an epoch's end closes its last batch; the gap to the next epoch is not a batch
                epochs.append([])
                continue
            epochs[-1].append((after - t, sum(parts), batch < len(self.compiled) and self.compiled[batch]))
            batch += 1
        return group_steps(epochs, self.accumulate)

    def sizes_by_epoch(self) -> list[list[tuple[int, ...]]]:
        """Each epoch's batches, each as the samples of every loader's part."""
        epochs: list[list[tuple[int, ...]]] = [[]]
        for _, parts in self.marks:
            if parts is None:
                epochs.append([])
            else:
                epochs[-1].append(parts)
        return [e for e in epochs if e]


def require_batch_size_attribute(trainer: Trainer, batch_arg_name: str) -> None:
    """Fail early, as Lightning's tuner would, when no model, hparams or datamodule attribute holds the size."""
    if not lightning_hasattr(trainer.lightning_module, batch_arg_name):
        raise ValueError(
            f"no `{batch_arg_name}` attribute on the model, its hparams or the datamodule; the tuner sets the batch"
            " size there, as Lightning's BatchSizeFinder does (use `batch_arg_name` to name another attribute)"
        )
    for holder in (trainer.lightning_module, getattr(trainer, "datamodule", None)):  # where lightning_setattr sets it
        found = getattr(type(holder), batch_arg_name, None) if holder is not None else None
        if isinstance(found, property) and found.fset is None:
            raise ValueError(
                f"`{batch_arg_name}` on {type(holder).__name__} is a read-only property: the tuner sets the batch size"
                f" there, as Lightning's BatchSizeFinder does; give `{batch_arg_name}` a setter (or keep the size in a"
                " plain attribute the property reads), or name another attribute with `batch_arg_name`"
            )


def require_module_dataloaders(trainer: Trainer, tuner: str, batch_arg_name: str) -> None:
    """Refuse, as Lightning's BatchSizeFinder does, a train loader passed to ``fit``: its batch size is fixed."""
    if loader_passed_to_fit(trainer):
        raise ValueError(
            f"{tuner} cannot change the batch size of a DataLoader passed to `fit()` (it is fixed when the loader is"
            f" built); return the loader from the LightningModule's or LightningDataModule's `train_dataloader()`,"
            f" built with `self.{batch_arg_name}`"
        )


def set_batch_size(trainer: Trainer, batch_arg_name: str, size: int) -> None:
    lightning_setattr(trainer.lightning_module, batch_arg_name, size)


def get_batch_size(trainer: Trainer, batch_arg_name: str) -> int:
    return int(lightning_getattr(trainer.lightning_module, batch_arg_name))  # type: ignore[arg-type]


def optimizer_steps(trainer: Trainer) -> int | float:
    """The optimizer steps the run will take as it is set now (Lightning's ``estimated_stepping_batches``, which a
    ``configure_optimizers`` reads to size a schedule), its loader built without touching the RNGs."""
    with rng_kept():
        return trainer.estimated_stepping_batches


def loader_samples(loader: Any) -> int | None:
    """Samples one epoch of a train loader holds on this rank; None when it has no length."""
    for source in (getattr(loader, "sampler", None), getattr(loader, "dataset", None)):
        try:
            return len(source)  # type: ignore[arg-type]
        except TypeError:
            continue
    return None


def probe_and_capacity(trainer: Trainer, settings: TunerSettings) -> tuple[MemoryProbe, int]:
    """The memory reader the trials read (the settings' or the device's) and the capacity they are judged against."""
    probe = settings.probe if settings.probe is not None else probe_for(trainer.strategy.root_device)
    return probe, judged_capacity(settings.capacity, probe.capacity())  # type: ignore[arg-type]  # bytes by now


class TrialSession:
    """Inside ``with TrialSession(...) as trials:``, ``trials.run(size, accumulate)`` measures a few training steps.

    On entry the training state is copied into host memory, each rank its own: the model's weights and buffers, the
    optimizers, schedulers, precision plugin and datamodule states, the loops' progress, every RNG, the Trainer's
    limits, loggers and callbacks. Nothing is written to disk, so nothing outlives the process and nothing is read
    back from a file another user could have changed. On exit, whether the trials succeeded, hit OOM or were
    interrupted, all of it is put back bit for bit and the dataloaders are rebuilt; an interrupt (Ctrl+C) that
    arrives while this happens is held until it is done, then raised. The copy is dropped only after that.

    The LightningModule's and the callbacks' ``on_load_checkpoint`` hooks are not called: nothing was resumed. A
    checkpoint that Lightning loaded for ``fit(ckpt_path=...)`` but has not applied yet (optimizers, schedulers,
    loops are restored after ``on_fit_start``) is not touched, so the run resumes where it was saved. Callbacks
    with ``memguard_keep_in_trials = True`` (the spill emulator) stay active during trials and get their own state
    back afterwards; the others are switched off.

    Lightning steps none of the user's learning-rate schedulers in the trials (a schedule sized by the run's optimizer
    steps, such as ``OneCycleLR``, would run past its end); the optimizers train at the learning rate they start
    with. Under manual optimization the user's ``training_step`` steps them itself: it sees them
    (``self.lr_schedulers()``) in the trials as in the run, each trial starts from their state and the optimizers'
    learning rates as the run has them, and both are put back afterwards.

    Under DDP every rank learns of an out-of-memory error on any rank at the end of the same training step,
    backward or optimizer step, and every rank then counts the trial as out of memory.
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
        self.shared_baseline = 0  # what the driver counted in system RAM before the trials (Windows), set on entry
        self.compile_s = 0.0  # seconds of trial steps in which torch.compile compiled, over all trials
        self._saved: dict[str, Any] = {}
        self._dynamo = ExitStack()

    def __enter__(self) -> TrialSession:
        t = self.trainer
        self.shared_baseline = shared_baseline(self.probe.read())
        callbacks = list(t.callbacks)  # type: ignore[attr-defined]
        kept = [c for c in callbacks if getattr(c, "memguard_keep_in_trials", False)]
        self._saved = {
            "state": training_state(t),
            "kept": kept,
            "kept_states": [host_copy(c.state_dict()) for c in kept],
            "rng": rng_states(),
            "loggers": t.loggers,
            "callbacks": callbacks,
            "limits": loop_limits(t),
            "limit_train_batches": t.limit_train_batches,
            "limit_val_batches": t.limit_val_batches,
            "accumulate_grad_batches": t.accumulate_grad_batches,
            "loop_state": deepcopy(loop_state(t)),
            "batch_size": get_batch_size(t, self.batch_arg_name),
            "progress_bar": t.progress_bar_callback,
            "should_stop": t.should_stop,
            "lr_scheduler_configs": t.strategy.lr_scheduler_configs,
            "manual": not t.lightning_module.automatic_optimization,
            "learning_rates": [deepcopy([g["lr"] for g in o.param_groups]) for o in t.optimizers],
        }
        # a compiled model gets one static graph per size tried, as training at that size alone would; training
        # after the trials runs the chosen size's graph from Dynamo's cache
        self._dynamo.enter_context(_compiler.static_graph_per_size())
        t.logger = DummyLogger() if t.logger is not None else None
        # Lightning steps none of the user's schedulers in a trial: a schedule sized by steps (OneCycleLR) would run
        # past its end. Under manual optimization Lightning steps none anyway, and the user's training_step reads
        # them (self.lr_schedulers()): they stay, rewound for each trial (_rewind_schedules)
        if not self._saved["manual"]:
            t.strategy.lr_scheduler_configs = []
        t.limit_train_batches = 1.0
        t.limit_val_batches = 0
        # a trial on a small dataset goes on into the next epoch, and nothing keeps a trial cut short from stopping
        set_loop_limits(t, {"max_epochs": -1, "min_epochs": 0, "min_steps": None})
        if t.progress_bar_callback is not None:
            t.progress_bar_callback.disable()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            with interrupts_held():
                self._restore()
        finally:
            self._dynamo.close()
        self._saved = {}  # the copy goes only once everything is back

    def _restore(self) -> None:
        """Put back everything ``__enter__`` saved."""
        t, saved = self.trainer, self._saved
        t.loggers = saved["loggers"]
        t.callbacks = saved["callbacks"]  # type: ignore[attr-defined]
        set_loop_limits(t, saved["limits"])
        t.limit_train_batches = saved["limit_train_batches"]
        t.limit_val_batches = saved["limit_val_batches"]
        t.accumulate_grad_batches = saved["accumulate_grad_batches"]
        t.should_stop = saved["should_stop"]  # a trial cut short must not stop the real run
        t.strategy.lr_scheduler_configs = saved["lr_scheduler_configs"]
        set_batch_size(t, self.batch_arg_name, saved["batch_size"])
        load_training_state(t, saved["state"])
        for callback, state in zip(saved["kept"], saved["kept_states"], strict=True):
            callback.load_state_dict(deepcopy(state))
        load_loop_state(t, deepcopy(saved["loop_state"]))
        if saved["progress_bar"] is not None:
            saved["progress_bar"].enable()
        reload_train_dataloader(t)
        reset_fit_loop(t)
        garbage_collection_cuda()
        set_rng_states(saved["rng"])

    def _rewind_schedules(self) -> None:
        """The schedulers a trial can reach (manual optimization's), and the optimizers' learning rates, as the run
        has them: a trial steps a schedule at most its own steps, not the sum of every trial's."""
        t, saved = self.trainer, self._saved
        if not saved["manual"]:  # Lightning's loop steps them, and sees none in a trial
            return
        for config, state in zip(saved["lr_scheduler_configs"], saved["state"]["lr_schedulers"], strict=True):
            config.scheduler.load_state_dict(deepcopy(state))
        for optimizer, rates in zip(t.optimizers, saved["learning_rates"], strict=True):
            for group, rate in zip(optimizer.param_groups, rates, strict=False):  # a group added since keeps its own
                group["lr"] = deepcopy(rate)

    def run(self, size: int, accumulate: int = 1, steps: int | None = None) -> TrialResult:
        """Train ``warmup_steps + timed_steps`` optimizer steps (or ``steps``) at ``size`` x ``accumulate``.

        Raises:
            ValueError: the batches delivered do not hold ``size`` samples: the train loader ignores the attribute.
        """
        t = self.trainer
        cuda = t.strategy.root_device.type == "cuda"
        compiled = _compiler.is_compiled(t.lightning_module)
        clock = _StepClock(
            cuda, self.clock, self.probe, self.capacity, self.headroom, size, accumulate, self.shared_baseline
        )
        t.callbacks = [*self._saved["kept"], clock]  # type: ignore[attr-defined]
        t.should_stop = False
        t.accumulate_grad_batches = accumulate
        set_batch_size(t, self.batch_arg_name, size)
        warmup = self.warmup_steps if steps is None else 0
        steps = self.warmup_steps + self.timed_steps if steps is None else steps
        load_loop_state(t, deepcopy(self._saved["loop_state"]))
        set_loop_limits(t, {"max_steps": steps})
        reset_progress(t)
        self._rewind_schedules()
        reload_train_dataloader(t)
        if cuda:  # the last trial's cached blocks would count as this one's reserved peak
            torch.cuda.empty_cache()  # (a full garbage collection runs only after a failed trial and at the end)
        self.probe.reset_peak()
        out_of_memory = False
        try:
            with _ranks_agree_on_oom(t), about_the_run_only():
                run_fit_loop(t)
        except OutOfMemoryEndsRun as err:
            shape = f"{size} x {accumulate}" if accumulate > 1 else f"batch size {size}"
            raise RuntimeError(
                f"Out of memory in a trial at {shape} under {type(t.strategy).__name__} (rank {t.global_rank}): {err}."
                f" The run ends here instead of waiting: give the tuner a smaller upper bound than {size}, or search"
                " on one device and pass the choice to this run."
            ) from err.__cause__
        except (torch.OutOfMemoryError, RuntimeError) as err:
            if not (isinstance(err, torch.OutOfMemoryError) or is_oom_error(err)):
                raise
            del err
            garbage_collection_cuda()
            out_of_memory = True
        measured = clock.steps()
        compile_s = sum(s for s, _, c in measured if c)  # steps that compiled are compile time, not step time
        self.compile_s += compile_s
        compiled = compiled or compile_s > 0
        if out_of_memory:
            return TrialResult(size, None, None, None, OOM, accumulate, compiled, round(compile_s, 3))
        _check_delivered(clock.sizes_by_epoch(), clock.paths, size, self.batch_arg_name)
        reading = self.probe.read()
        peak = reading.used
        ran = [(s, n) for s, n, c in measured if not c]
        # whole optimizer steps after the warmup (a trial cut after its first step: that one)
        timing = time_trial(ran or [(s, n) for s, n, _ in measured], size * accumulate, warmup)
        rate = timing.samples_per_sec if timing is not None else 0.0
        evidence = Evidence(
            reading,
            self.capacity,
            self.headroom,
            self.best_rate,
            [rate],
            self.collapse,
            shared_baseline=self.shared_baseline,
        )
        outcome = trial_outcome(evidence)
        return TrialResult(
            size, timing.step_ms if timing is not None else None, peak, rate, outcome, accumulate, compiled,
            round(compile_s, 3), timing.spread if timing is not None else None,
        )  # fmt: skip


def _check_delivered(
    epochs: list[list[tuple[int, ...]]], paths: list[Path] | None, size: int, batch_arg_name: str
) -> None:
    """Every loader's batches hold ``size`` samples; one may hold fewer only where that loader's pass over its data
    ends: at the epoch's end, or where a shorter loader starts again (``max_size_cycle``) with a whole batch. A
    loader that has run out (``max_size``) holds none and is not judged. A trial in which no batch held ``size``
    samples measured a smaller size than it reports: an error, never a row."""
    for batches in epochs:
        for i in range(len(batches[0])):
            sizes = [parts[i] for parts in batches if parts[i]]
            ends = all(n == size or after == size for n, after in zip(sizes, sizes[1:], strict=False))
            if ends and all(n <= size for n in sizes):
                continue
            seen = sorted(set(sizes))
            loader = "the train loader" if paths is None else f"the train loader {loader_name(paths[i])}"
            built = "the DataLoader" if paths is None else "every train DataLoader"
            raise ValueError(
                f"{loader} delivered batches of {seen} samples while `{batch_arg_name}` was set to {size}: it does"
                f" not build its batches from `{batch_arg_name}`, so no size can be measured or set; build {built}"
                f" in `train_dataloader()` with `batch_size=self.{batch_arg_name}`"
            )
    loaders = max((len(parts) for batches in epochs for parts in batches), default=0)
    for i in range(loaders):
        most = max((parts[i] for batches in epochs for parts in batches if len(parts) > i), default=0)
        if 0 < most < size:
            loader = "the train loader" if paths is None else f"the train loader {loader_name(paths[i])}"
            raise ValueError(
                f"{loader} delivered at most {most} samples a batch while `{batch_arg_name}` was set to {size}: one"
                f" epoch of its data holds fewer than {size}, so {size} cannot be measured or set"
            )


@contextmanager
def _ranks_agree_on_oom(trainer: Trainer) -> Iterator[None]:
    """Under DDP, after every training step, backward and optimizer step all ranks learn whether any ran out of
    memory, so a rank that hit OOM never leaves the others waiting in the next collective; every rank raises.

    The forward runs under DDP's ``no_sync``, so backward sends nothing, and the gradients are averaged in one
    all-reduce after the ranks agree: the trial's step time includes that exchange, not overlapped with backward as
    in training. Under FSDP, whose collectives are the forward and backward themselves, the ranks also meet between
    them (:mod:`.sharded_agreement`); where no meeting point is left, the failing rank ends the run.
    """
    strategy = trainer.strategy
    if trainer.world_size <= 1:
        yield
        return
    names = ("training_step", "backward", "optimizer_step")
    # FSDP: collectives inside forward and backward; agreement points between them (_sharded_agreement)
    units = fsdp_units(strategy.model) if holds_shards(strategy) and strategy.model is not None else []
    points = UnitPoints(units, lambda failed: strategy.reduce_boolean_decision(failed, all=False)) if units else None
    originals = {name: getattr(strategy, name) for name in names}

    # torch's DistributedDataParallel; FSDP reduces its gradients' shards inside backward and is left as it is
    ddp = strategy.model if isinstance(strategy.model, DistributedDataParallel) else None
    pending = [False]  # the last local forward's gradients still have to be averaged

    def agreeing(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            failed = False
            local = name == "training_step" and ddp is not None and bool(ddp.require_backward_grad_sync)
            if points is not None and name == "training_step":
                points.new_step()
            try:
                if local:
                    # DDP all-reduces gradients from inside backward: a rank that fails halfway would leave the
                    # others waiting in those all-reduces. A forward under `no_sync` makes backward local; the
                    # gradients are averaged once every rank has finished it.
                    pending[0] = True
                    with ddp.no_sync():  # type: ignore[union-attr, operator]
                        out = fn(*args, **kwargs)
                else:
                    out = fn(*args, **kwargs)
            except AgreedOutOfMemory:
                raise  # every rank already knows
            except (torch.OutOfMemoryError, RuntimeError) as err:
                if not (isinstance(err, torch.OutOfMemoryError) or is_oom_error(err)):
                    raise
                if points is not None:  # said at the point the other ranks reach next, or nowhere
                    if not points.failed_here(err, in_backward=name == "backward"):
                        raise OutOfMemoryEndsRun(
                            "the other ranks may wait inside one of FSDP's collectives, where no agreement reaches"
                            " them from where this rank failed"
                        ) from err
                    raise AgreedOutOfMemory("out of memory on this rank inside a trial") from err
                failed, out = True, None
            if strategy.reduce_boolean_decision(failed, all=False):
                pending[0] = False
                raise AgreedOutOfMemory(f"out of memory on {'this' if failed else 'another'} rank inside a trial")
            if name == "backward" and pending[0]:
                pending[0] = False
                _average_gradients(ddp, trainer.world_size)  # type: ignore[arg-type]
            return out

        return call

    with ExitStack() as stack:
        if points is not None:
            stack.enter_context(points.installed())
        stack.enter_context(strategy_methods_replaced(strategy, {n: agreeing(fn, n) for n, fn in originals.items()}))
        yield


def _average_gradients(ddp: torch.nn.Module, world_size: int) -> None:
    """What DDP's backward would have done: every gradient averaged over the ranks, in one flat all-reduce."""
    grads = [p.grad for p in ddp.parameters() if p.requires_grad and p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    torch.distributed.all_reduce(flat)
    flat.div_(world_size)
    for grad, reduced in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        grad.copy_(reduced.view_as(grad))
