"""MemGuard's ``on_spill="adapt"``: the run goes on in a configuration that fits instead of stopping.

The lever that keeps training the same is splitting each loaded batch into micro-batches inside its training step:
the batch is the one the loader delivered (the data order is unchanged), each micro-batch's loss is weighted by its
share of the batch and by Lightning's accumulation, their gradients add up before the one optimizer step, and the
optimizer, schedulers and counters step as they did. For a loss that averages over its samples (the one Lightning's
own accumulation assumes) the gradient is the batch's. A model whose BatchNorm layers train would see statistics
per micro-batch instead: there the lever is activation checkpointing (BatchNorm-exact), unless the user allows the
split.

While the adapter is installed it runs each training step's forward and backward itself (so that an out-of-memory
error anywhere in them can be recovered from): Lightning's ``zero_grad`` and ``backward`` for that step then do
nothing, the gradients having been zeroed before the step's first forward and filled by its backward passes.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.memory import is_oom_error
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection

from lightning_memguard.callbacks._batches import samples_in
from lightning_memguard.callbacks._private import logged_as_batch, strategy_methods_replaced
from lightning_memguard.checkpointing import checkpoint_blocks, is_checkpointed
from lightning_memguard.checkpointing.policy import inputs_from_batch
from lightning_memguard.core.advice import FitAdvice
from lightning_memguard.core.units import size_formatter
from lightning_memguard.tuning.adapt import Adaptation, GrowBack, chunks_to_fit, chunks_to_grow, micro_batch

# A callback with this method is told when a micro-batch's backward is done (the spill emulator: a micro-batch's
# saved activations are freed there, as on a card)
MICRO_BATCH_END = "memguard_micro_batch_end"


def split_batch(batch: Any, samples: int, chunks: int) -> list[tuple[Any, int]]:
    """``batch`` cut into ``chunks`` near-equal micro-batches along the first dimension of every tensor that holds
    ``samples`` rows (others, and non-tensors, go to every micro-batch as they are), each with its samples.

    Example:
        >>> x, y = torch.arange(10).reshape(5, 2), torch.arange(5)
        >>> [(tuple(part[0].shape), n) for part, n in split_batch((x, y), 5, 2)]
        [((2, 2), 2), ((3, 2), 3)]
    """
    chunks = min(chunks, samples)
    bounds = [round(i * samples / chunks) for i in range(chunks + 1)]

    def part(i: int) -> Any:
        def cut(t: torch.Tensor) -> torch.Tensor:
            return t[bounds[i] : bounds[i + 1]] if t.dim() > 0 and t.shape[0] == samples else t

        return apply_to_collection(batch, torch.Tensor, cut)

    return [(part(i), bounds[i + 1] - bounds[i]) for i in range(chunks)]


def _loss_of(output: Any) -> torch.Tensor | None:
    """The loss of a training step's output, as Lightning's automatic optimization reads it."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict):
        return output.get("loss")
    return None


def _with_loss(output: Any, loss: torch.Tensor) -> Any:
    return loss if isinstance(output, torch.Tensor) else {**output, "loss": loss}


class MicroBatches:
    """Owns the training step of a run while installed: splits each batch into :attr:`chunks` micro-batches and
    runs their forward and backward passes; on an out-of-memory error inside them, asks ``on_oom(chunks, samples,
    error)`` for a finer split (None: none; the error is raised) and redoes the step from zeroed gradients.

    Args:
        trainer: the Trainer (automatic optimization, one optimizer).
        on_oom: the split to redo a failed step with, or None.
        recover: whether an out-of-memory error may be recovered from here (one process: under DDP a rank that
            failed halfway would leave the others waiting in a gradient all-reduce).
    """

    def __init__(
        self,
        trainer: Trainer,
        on_oom: Callable[[int, int, BaseException], int | None],
        recover: bool,
    ) -> None:
        self.trainer = trainer
        self.on_oom = on_oom
        self.recover = recover
        self.chunks = 1
        self.why_not: str | None = None  # why the last out-of-memory error could not be adapted to (from on_oom)
        self.batch: Any = None  # the training step's batch, while it runs
        self.validation_chunks = 1  # micro-batches per validation batch (no backward: outputs of the last kept)
        self.validation_samples = 0  # of the last validation batch
        self._owned = False  # this step's zero_grad and backward were done here
        self._stack = ExitStack()

    # ------------------------------------------------------------------ installing

    def install(self, pl_module: LightningModule) -> None:
        strategy = self.trainer.strategy
        step, backward = strategy.training_step, strategy.backward
        zero_grad = pl_module.optimizer_zero_grad

        def training_step(*args: Any, **kwargs: Any) -> Any:
            return self._step(step, backward, zero_grad, *args, **kwargs)

        def owned_backward(*args: Any, **kwargs: Any) -> Any:
            if self._owned:
                return None  # done, micro-batch by micro-batch, inside the training step
            return backward(*args, **kwargs)

        def owned_zero_grad(*args: Any, **kwargs: Any) -> Any:
            if self._owned:
                return None  # done before the step's first forward
            return zero_grad(*args, **kwargs)

        validation_step = strategy.validation_step

        def split_validation_step(*args: Any, **kwargs: Any) -> Any:
            batch = args[0]
            samples = self.validation_samples = samples_in(batch) or 1
            if self.validation_chunks <= 1:
                return validation_step(*args, **kwargs)
            output = None
            for part, _ in split_batch(batch, samples, self.validation_chunks):
                with logged_as_batch(self.trainer, part):  # logged figures weighted by the micro-batch's samples
                    output = validation_step(part, *args[1:], **kwargs)
            return output

        replaced = {
            "training_step": training_step,
            "backward": owned_backward,
            "validation_step": split_validation_step,
        }
        self._stack.enter_context(strategy_methods_replaced(strategy, replaced))
        self._stack.enter_context(_hook_replaced(pl_module, "optimizer_zero_grad", owned_zero_grad))

    def uninstall(self) -> None:
        self._stack.close()

    # ------------------------------------------------------------------ one step

    def _step(
        self,
        step: Callable[..., Any],
        backward: Callable[..., Any],
        zero_grad: Callable[..., Any],
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        trainer = self.trainer
        batch, batch_idx = args[0], args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        self._owned = False
        accumulate = trainer.accumulate_grad_batches
        first = batch_idx % accumulate == 0  # Lightning zeroes the gradients at this batch
        optimizer = trainer.optimizers[0]
        samples = samples_in(batch) or 1
        self.batch = batch  # the batch in hand, for what decides whether it can be split
        while True:
            if first:
                zero_grad(trainer.current_epoch, batch_idx, optimizer)
            try:
                output = self._forward_backward(step, backward, optimizer, batch, samples, accumulate, args, kwargs)
                self._owned = True
                return output
            except (torch.OutOfMemoryError, RuntimeError) as err:
                if not (isinstance(err, torch.OutOfMemoryError) or is_oom_error(err)):
                    raise
                why_not = self._why_not_redone(first, accumulate)
                finer = self.on_oom(self.chunks, samples, err) if why_not is None else None
                if finer is None:
                    _explain(err, why_not or self.why_not or "no lever is left")
                    raise
                del err
                free_memory()
                self.chunks = finer  # the step is redone from zeroed gradients, in `finer` micro-batches

    def _why_not_redone(self, first: bool, accumulate: int) -> str | None:
        if not self.recover:
            return (
                "under several processes a rank that fails inside its backward would leave the others waiting in the"
                " gradient all-reduce, so a step is redone on one device only"
            )
        if not first:
            return (
                "this batch is not the first of its accumulation (accumulate_grad_batches="
                f"{self.trainer.accumulate_grad_batches}): the gradients of the batches before it cannot be told from"
                " its own, so its step cannot be redone"
            )
        return None

    def _forward_backward(
        self,
        step: Callable[..., Any],
        backward: Callable[..., Any],
        optimizer: Any,
        batch: Any,
        samples: int,
        accumulate: int,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        trainer = self.trainer
        if self.chunks <= 1:
            whole = step(*args, **kwargs)
            whole_loss = _loss_of(whole)
            if whole_loss is not None:
                backward(whole_loss / accumulate, optimizer)
            return whole
        parts = split_batch(batch, samples, self.chunks)
        total: torch.Tensor | None = None
        output: Any = None
        skipped = 0
        for i, (part, n) in enumerate(parts):
            last = i == len(parts) - 1
            # DDP all-reduces the gradients once, in the last micro-batch's backward; each micro-batch's logged
            # figures are weighted by its own samples, so an epoch's average is the whole batch's
            with (
                (
                    nullcontext()
                    if last or not isinstance(trainer.strategy, DDPStrategy)
                    else trainer.strategy.block_backward_sync()
                ),
                logged_as_batch(trainer, part),
            ):
                output = step(part, *args[1:], **kwargs)
                loss = _loss_of(output)
                if loss is None:
                    skipped += 1
                    continue
                weighted = loss * (n / samples) / accumulate
                backward(weighted, optimizer)
            total = weighted.detach() if total is None else total + weighted.detach()
            if not last:
                self._micro_batch_end()
        if total is None:
            return None  # every micro-batch skipped: the step is skipped, as the whole batch's would be
        if skipped:
            raise RuntimeError(
                f"MemGuard(on_spill='adapt') split this batch into {len(parts)} micro-batches and `training_step`"
                f" returned None for {skipped} of them (skipping them) but not for the others: the whole batch's step"
                " would have skipped all or none, so the training would change. Decide the skip from something every"
                " micro-batch shares, or use on_spill='stop'"
            )
        # the value Lightning logs and divides by its accumulation: the batch's loss, as one step would give it
        return _with_loss(output, total * accumulate)

    def _micro_batch_end(self) -> None:
        for callback in self.trainer.callbacks:  # type: ignore[attr-defined]
            hook = getattr(callback, MICRO_BATCH_END, None)
            if hook is not None:
                hook(self.trainer)


@contextmanager
def _hook_replaced(module: LightningModule, name: str, fn: Callable[..., Any]) -> Iterator[None]:
    """A LightningModule hook replaced on the instance (Lightning looks hooks up on it), put back on exit."""
    own = module.__dict__.get(name)
    setattr(module, name, fn)
    try:
        yield
    finally:
        if own is None:
            delattr(module, name)
        else:
            setattr(module, name, own)


def _explain(error: BaseException, why_not: str) -> None:
    """Add to an out-of-memory error that adapting could not recover from why (as the allocator cap explains)."""
    if error.args and isinstance(error.args[0], str):
        error.args = (
            f"{error.args[0]}\n\nMemGuard(on_spill='adapt') could not adapt to it: {why_not}.",
            *error.args[1:],
        )


def _tensors(batch: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    apply_to_collection(batch, torch.Tensor, found.append)
    return found


def free_memory() -> None:
    """Let go of what a failed step held: Python's cycles collected, the CUDA allocator's cache emptied."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class RunAdapter:
    """What ``MemGuard(on_spill="adapt")`` does instead of stopping: the levers, in order, each only where it keeps the
    training the same, the record of every change, and growing back when memory frees.

    Levers: split each batch into more micro-batches (not for a model whose BatchNorm layers train, unless
    ``allow_batchnorm``; not below one sample, nor where one sample does not fit); then activation checkpointing
    (BatchNorm-exact). When neither is left, or at once where the run's readings say no micro-batch can fit beside
    what is held (what a step starts from, other processes' memory), :meth:`after_spill` says why and the caller
    stops the run as ``"stop"`` does.

    Args:
        allow_batchnorm: split batches of a model whose BatchNorm layers train (their statistics then come from each
            micro-batch: not the same training).
        grow_every: optimizer steps between attempts to use fewer micro-batches again (doubling after one that
            spilled again).
        headroom: the fraction of capacity a configuration must leave free to be grown into.
    """

    def __init__(self, allow_batchnorm: bool, grow_every: int, headroom: float) -> None:
        self.allow_batchnorm = allow_batchnorm
        self.headroom = headroom
        self.grow = GrowBack(grow_every)
        self.adaptations: list[Adaptation] = []
        self.chunks = 1  # micro-batches per loaded batch
        self.validation_chunks = 1  # micro-batches per validation batch (restored from a checkpoint)
        self.checkpointing = False  # turned on by an adaptation
        self._micro: MicroBatches | None = None
        self._trainer: Trainer | None = None
        self._grew_at: int | None = None  # the step of the last growth, while it may still be undone
        self._resumed = False  # split by a checkpoint: fewer micro-batches are tried after the first step

    # ------------------------------------------------------------------ fit

    def start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Install on the training step (a resumed run continues in its adapted configuration)."""
        self._trainer = trainer
        if self._resumed:  # memory may have freed while the run was away: tried after its first step
            self.grow.resumed(trainer.global_step)
            self._resumed = False
        else:
            self.grow.restart(trainer.global_step)
        if self.checkpointing and not any(is_checkpointed(m) for m in pl_module.modules()):
            checkpoint_blocks(pl_module)
        if not pl_module.automatic_optimization:
            return  # a spill then stops the run, saying why (see `_cannot_split`)
        self._micro = MicroBatches(trainer, self._after_oom, recover=trainer.world_size == 1)
        self._micro.chunks = self.chunks
        self._micro.validation_chunks = self.validation_chunks
        self._micro.install(pl_module)

    def stop(self) -> None:
        if self._micro is not None:
            self.validation_chunks = self._micro.validation_chunks
            self._micro.uninstall()
            self._micro = None

    # ------------------------------------------------------------------ adapting

    def after_spill(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        spill: Any,
        samples: int,
        allocated_now: int | None,
        batch: Any = None,
    ) -> str | None:
        """Every rank agreed on a spill at this batch's start: adapt from this batch on (the spilling steps trained
        correctly, only slowly: they are kept). None: adapted; else why adapting is not possible: at once where the
        run's readings say no micro-batch fits beside what is held (what a step starts from, other processes'
        memory), since no split or checkpointing can help there and each further try is one more spilled step."""
        advice = None
        if spill is not None and allocated_now is not None:
            micro = micro_batch(samples, self.chunks)
            advice = FitAdvice.from_run(
                spill.used_bytes, allocated_now, spill.other_bytes or 0, spill.capacity, self.headroom, micro
            )
        holder = advice.holder() if advice is not None else None
        if _agreed_max(trainer, int(holder is not None)):  # every rank stops with the one where nothing fits
            return holder or "on another rank no micro-batch fits beside what a step starts from and others hold"
        no_split = None  # not even one sample's activations fit the room left: checkpointing may, a split cannot
        if advice is not None and advice.largest_batch < 1:
            left, adds = max((advice.usable or 0) - advice.resting - advice.others, 0), advice.per_sample
            no_split = (
                f"not even one sample fits ({size_formatter(left, 2)(left)} is left beside what a step starts from"
                f" and other processes' memory, and each sample adds {size_formatter(adds, 2)(adds)})"
            )
        wanted = chunks_to_fit(samples, self.chunks, advice)
        wanted = _agreed_max(trainer, wanted)
        if self._grew_at is not None:  # the last growth spilled again: wait twice as long before the next
            self.grow.tried(self._grew_at, undone=True)
            self._grew_at = None
        if spill is not None:
            size = size_formatter(spill.capacity, 2)
            pace = ""
            if spill.current_rate and spill.reference_rate:  # what the spill cost, as the step ran
                pace = f", {spill.current_rate:.0f} samples/s against {spill.reference_rate:.0f} before"
            why = f"{self._shape(samples)} spilled ({size(spill.used_bytes)} on a {size(spill.capacity)} card{pace})"
        else:
            why = f"{self._shape(samples)} spilled on another rank"
        room = None  # what a checkpointing plan's activations may use: the card less its headroom, others' memory and
        if spill is not None and allocated_now is not None:  # what a step starts from (weights, gradients, optimizer)
            room = int(spill.capacity * (1 - self.headroom)) - (spill.other_bytes or 0) - allocated_now
        return self._lever(trainer, pl_module, samples, wanted, why, batch, room, no_split)

    def _after_oom(self, chunks: int, samples: int, error: BaseException) -> int | None:
        """An out-of-memory error inside a training step: the split to redo it with, or None (raised)."""
        trainer = self._trainer
        assert trainer is not None
        why = f"{self._shape(samples)} ran out of memory"
        why_not = self._lever(trainer, trainer.lightning_module, samples, min(chunks * 2, samples), why)
        if why_not is not None:
            if self._micro is not None:
                self._micro.why_not = why_not
            return None
        return self.chunks

    def _checkpoint(self, pl_module: LightningModule, batch: Any, samples: int, room: int | None) -> str:
        """Activation checkpointing that fits what is free now: the library's planner with a budget of ``room``
        bytes for the step's activations, measured on a micro-batch of this batch (its inputs found as a budget
        without ``example_input_array`` finds them); every block where that cannot be planned (no batch or room
        known, inputs ``forward`` does not take or fails on, the measurement itself out of memory). Returns the
        plan's summary.

        Raises:
            ValueError: the model has no blocks to checkpoint.
        """
        if batch is not None and room is not None and room > 0:
            part = split_batch(batch, samples, self.chunks)[0][0] if self.chunks > 1 else batch
            try:
                example, _ = inputs_from_batch(part, pl_module.forward)
                return checkpoint_blocks(pl_module, memory_budget=int(room), example_input=example).summary()
            except (ValueError, TypeError, RuntimeError):  # RuntimeError: out of memory too
                free_memory()  # planned on nothing usable (say a batch of indices the model maps): every block
        return checkpoint_blocks(pl_module).summary()

    def _lever(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        samples: int,
        wanted: int,
        why: str,
        batch: Any = None,
        room: int | None = None,
        no_split: str | None = None,
    ) -> str | None:
        """The next lever, said and recorded (None), or why none is left. ``no_split``: why the run's readings say
        no split fits (then checkpointing is the only lever)."""
        before = self.chunks
        self.grow.restart(trainer.global_step)  # the next try with fewer micro-batches comes an interval later
        if batch is None and self._micro is not None:
            batch = self._micro.batch
        cannot = self._cannot_split(pl_module, samples, batch) or no_split
        if cannot is None and wanted > self.chunks:
            self._set_chunks(wanted)
            self._said(
                Adaptation(trainer.global_step, samples, before, wanted, False, why, trainer.accumulate_grad_batches)
            )
            return None
        if not self.checkpointing:
            try:
                plan = self._checkpoint(pl_module, batch, samples, room)
            except ValueError as err:  # no blocks found
                return f"{cannot or 'the batch cannot be split further'}, and activation checkpointing found {err}"
            self.checkpointing = True
            why = f"{why}; activation checkpointing: {plan}"
            self._said(
                Adaptation(trainer.global_step, samples, before, before, True, why, trainer.accumulate_grad_batches)
            )
            return None
        return f"{cannot or 'each micro-batch holds one sample'}, and activation checkpointing is on already"

    def _cannot_split(self, pl_module: LightningModule, samples: int, batch: Any = None) -> str | None:
        if self._micro is None:
            return "the model optimizes manually (`automatic_optimization=False`): its steps cannot be split"
        if samples < 2 or self.chunks >= samples:
            return "each micro-batch holds one sample"
        rows = sorted({t.shape[0] for t in _tensors(batch) if t.dim() > 0})
        if len(rows) > 1:
            return (
                f"the batch's tensors do not agree on its samples (first dimensions {rows}: a time-first sequence, a"
                " tensor shared by all samples): which dimension to split is not known"
            )
        if not self.allow_batchnorm and any(
            isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training for m in pl_module.modules()
        ):
            return (
                "the model's BatchNorm layers would take their statistics from each micro-batch, not the batch"
                " (`MemGuard(adapt_batchnorm=True)` allows it)"
            )
        return None

    def after_validation_spill(self, trainer: Trainer, reading: Any, capacity: int) -> None:
        """Validation spilled (every rank agreed, at its end): its batches run in twice as many micro-batches from
        the next validation on. Validation trains nothing, so splitting it changes no weight: a model's logged
        figures, averaged over samples, are the same."""
        micro = self._micro
        if micro is None:
            return
        samples = max(micro.validation_samples, 1)
        before = micro.validation_chunks
        micro.validation_chunks = _agreed_max(trainer, min(before * 2, samples))
        size = size_formatter(capacity, 2)
        why = f"validation spilled ({size(reading.used)} on a {size(capacity)} card)"
        self._said(
            Adaptation(trainer.global_step, samples, before, micro.validation_chunks, False, why, validation=True)
        )

    @property
    def installed(self) -> bool:
        return self._micro is not None

    # ------------------------------------------------------------------ growing back

    def maybe_grow(self, trainer: Trainer, reading: Any, capacity: int, samples: int) -> bool:
        """Every few hundred steps while split: whether fewer micro-batches fit what is free now, from this run's
        readings (what a step starts from, and what each sample adds on top); every rank takes the largest split any
        needs. True: grown (said and recorded)."""
        if self.chunks <= 1 or self._micro is None or not self.grow.due(trainer.global_step):
            return False
        step = trainer.global_step
        fewer = None
        if reading.allocated_now is not None and reading.peak_allocated > reading.allocated_now:
            base = reading.allocated_now + (reading.other_processes or 0)
            per_sample = (reading.peak_allocated - reading.allocated_now) / micro_batch(samples, self.chunks)
            room = min(capacity, reading.capacity) * (1 - self.headroom)
            fewer = chunks_to_grow(samples, self.chunks, lambda size: base + per_sample * size <= room)
        agreed = _agreed_max(trainer, self.chunks if fewer is None else fewer)
        self.grow.tried(step, undone=False)
        if agreed >= self.chunks:
            return False
        before = self.chunks
        size = size_formatter(capacity, 2)
        free = min(capacity, reading.capacity) - (reading.allocated_now or 0) - (reading.other_processes or 0)
        self._set_chunks(agreed)
        self._grew_at = step
        freed = f"memory freed ({size(free)} free)"
        self._said(Adaptation(step, samples, before, agreed, False, freed, trainer.accumulate_grad_batches))
        return True

    # ------------------------------------------------------------------ record

    def _set_chunks(self, chunks: int) -> None:
        self.chunks = chunks
        if self._micro is not None:
            self._micro.chunks = chunks

    def _shape(self, samples: int) -> str:
        return f"{micro_batch(samples, self.chunks)} x {self.chunks}"

    def _said(self, adaptation: Adaptation) -> None:
        self.adaptations.append(adaptation)
        trainer = self._trainer
        rank_zero_warn(f"MemGuard adapted: {adaptation.line()}", category=RuntimeWarning)
        if trainer is not None:
            for logger in trainer.loggers:
                logger.log_metrics(
                    {
                        "memguard/micro_batches": float(adaptation.after),
                        "memguard/checkpointing": float(self.checkpointing),
                    },
                    step=trainer.global_step,
                )

    def state_dict(self) -> dict[str, Any]:
        return {
            "adaptations": [a.to_dict() for a in self.adaptations],
            "chunks": self.chunks,
            "validation_chunks": self._micro.validation_chunks if self._micro is not None else self.validation_chunks,
            "checkpointing": self.checkpointing,
            "grow_interval": self.grow.interval,  # doubled by growths that spilled again: the card stayed full
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.adaptations = [Adaptation(**row) for row in state.get("adaptations", [])]
        self._set_chunks(int(state.get("chunks", 1)))
        self.validation_chunks = int(state.get("validation_chunks", 1))
        self.checkpointing = bool(state.get("checkpointing", False))
        self.grow.interval = int(state.get("grow_interval", self.grow.every))
        self._resumed = self.chunks > 1


def _agreed_max(trainer: Trainer, value: int) -> int:
    """The largest of every rank's ``value`` (its own in one process)."""
    if trainer.world_size <= 1:
        return value
    tensor = torch.tensor(float(value), device=trainer.strategy.root_device)
    return int(trainer.strategy.reduce(tensor, reduce_op="max").item())


def refuse_to_adapt(trainer: Trainer) -> None:
    """``on_spill="adapt"`` where the strategy keeps the training step to itself: refused in ``setup``."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    strategy = trainer.strategy
    if isinstance(strategy, DeepSpeedStrategy):
        raise ValueError(
            "MemGuard(on_spill='adapt') does not support DeepSpeedStrategy: DeepSpeed's engine runs the backward and"
            " the accumulation itself, so a step cannot be split or redone; use on_spill='stop' (or 'raise')"
        )
