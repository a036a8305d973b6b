"""MemGuard's ``on_spill="adapt"``: the run goes on in a configuration that fits instead of stopping.

The lever that keeps training the same is splitting each loaded batch into micro-batches inside its training step:
the batch is the one the loader delivered (the data order is unchanged; its per-sample tensors and lists are cut,
:func:`take_samples`), each micro-batch's loss is weighted by its share of what the loss averages over (found before
the first split, :meth:`MicroBatches.judge_loss`, or declared) and by Lightning's accumulation, their gradients add up
before the one optimizer step (the batch's gradient), the optimizer, schedulers and counters step as they did, and
the micro-batches' outputs are joined into the batch's for the hooks (:func:`join_outputs`). A loss that couples
the samples of a batch is never split. A model whose BatchNorm layers train would see statistics
per micro-batch instead: there the lever is activation checkpointing (BatchNorm-exact), unless the user allows the
split.

While the adapter is installed it runs each training step's forward and backward itself (so that an out-of-memory
error anywhere in them can be recovered from): Lightning's ``zero_grad`` and ``backward`` for that step then do
nothing, the gradients having been zeroed before the step's first forward and filled by its backward passes.
"""

from __future__ import annotations

import copy
import gc
import math
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities.memory import is_oom_error
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn

from lightning_memguard._compiler import is_compiled
from lightning_memguard._lightning.batches import (
    inputs_from_batch,
    is_namedtuple,
    per_sample_sequence,
    samples_in,
    split_batch,
    take_samples,
    tensors_in,
)
from lightning_memguard._lightning.privates import (
    logged_as_batch,
    rng_states,
    set_rng_states,
    strategy_methods_replaced,
)
from lightning_memguard.checkpointing import CheckpointPlan, apply_plan, checkpoint_blocks
from lightning_memguard.checkpointing.policy import planned_on_rank_zero
from lightning_memguard.core.advice import FitAdvice
from lightning_memguard.core.units import size_formatter
from lightning_memguard.levers.plan_levers import (
    applied_levers,
    apply_record,
    find_loss_target,
    plan_levers,
    remove_levers,
)
from lightning_memguard.tuning.adapt import (
    WEIGHTINGS,
    Adaptation,
    GrowBack,
    chunks_to_fit,
    chunks_to_grow,
    chunks_with_savers,
    judge_weighting,
    loss_coefficients,
    micro_batch,
)

# A callback with this method is told when a micro-batch's backward is done (the spill emulator: a micro-batch's
# saved activations are freed there, as on a card)
MICRO_BATCH_END = "memguard_micro_batch_end"


class OutputsNotJoined(ValueError):
    """The outputs of a batch's micro-batches cannot be joined into the whole batch's (the message says where)."""


def _known(kind: type, saved: dict[str, Any]) -> dict[str, Any]:
    """The entries of a saved row that the dataclass ``kind`` has: a checkpoint written by a later version may hold
    more (a missing one takes its default)."""
    names = {f.name for f in fields(kind)}
    return {key: value for key, value in saved.items() if key in names}


class SaversNotPlanned(RuntimeError):
    """Raised on the other ranks where rank zero's planning of the savers failed with an error other than finding no
    blocks (rank zero raises its own error): the message names that error's type and says what it said."""


def join_outputs(outputs: list[Any], counts: list[int], where: str = "output") -> Any:
    """The outputs a step returned for each micro-batch (``counts``: their samples) joined into what the whole batch
    would have returned: tensors and lists of one entry per sample concatenated (tensors detached); a number (a
    float, or a tensor of one floating value) the mean of the micro-batches' values weighted by their samples, as
    Lightning's epoch averages weigh a logged value; dicts, lists and tuples joined entry by entry; anything else
    (strings, flags) where every micro-batch returned the same.

    Raises:
        OutputsNotJoined: where a value differs between micro-batches and is none of these (a count, a tensor of
            another length), naming where it sits in the output.

    Example:
        >>> joined = join_outputs([{"preds": torch.zeros(2), "acc": 1.0}, {"preds": torch.ones(2), "acc": 0.5}], [2, 2])
        >>> joined["preds"].tolist(), joined["acc"]
        ([0.0, 0.0, 1.0, 1.0], 0.75)
    """
    first = outputs[0]
    if all(o is None for o in outputs):
        return None
    if isinstance(first, torch.Tensor) and all(isinstance(o, torch.Tensor) for o in outputs):
        if first.dim() > 0 and all(o.dim() > 0 and o.shape[0] == n for o, n in zip(outputs, counts, strict=True)):
            return torch.cat([o.detach() for o in outputs])
        if first.dim() == 0 and first.is_floating_point():
            shares = loss_coefficients("samples", counts)
            return sum(
                (o.detach() * c for o, c in zip(outputs[1:], shares[1:], strict=True)), first.detach() * shares[0]
            )
        if all(o.shape == first.shape and torch.equal(o, first) for o in outputs):
            return first.detach()
    elif isinstance(first, float) and all(isinstance(o, float) for o in outputs):
        shares = loss_coefficients("samples", counts)
        return sum(o * c for o, c in zip(outputs, shares, strict=True))
    elif isinstance(first, Mapping) and all(isinstance(o, Mapping) and o.keys() == first.keys() for o in outputs):
        joined = copy.copy(first)
        for key in first:
            joined[key] = join_outputs([o[key] for o in outputs], counts, f"{where}[{key!r}]")  # type: ignore[index]
        return joined
    elif isinstance(first, list | tuple) and all(type(o) is type(first) for o in outputs):
        if all(per_sample_sequence(o, n) for o, n in zip(outputs, counts, strict=True)):
            return type(first)(item for o in outputs for item in o)
        if all(len(o) == len(first) for o in outputs):
            rows = enumerate(zip(*outputs, strict=True))
            items = [join_outputs(list(row), counts, f"{where}[{i}]") for i, row in rows]
            return type(first)(*items) if is_namedtuple(first) else type(first)(items)
    elif all(type(o) is type(first) and o == first for o in outputs):  # a string, a flag, the same number
        return first
    raise OutputsNotJoined(
        f"{where} differs between micro-batches ({type(first).__name__}) and is neither one entry per sample nor a"
        " number to average"
    )


def unjoinable(output: Any, samples: int, where: str = "output") -> str | None:
    """Where in a whole batch's step ``output`` (of ``samples``) is a value whose micro-batches' values could not be
    joined back into it (see :func:`join_outputs`): a count (an integer), a tensor neither of one entry per sample
    nor of one floating value. None: every value can be joined."""
    if isinstance(output, torch.Tensor):
        per_sample = output.dim() > 0 and output.shape[0] == samples
        return None if per_sample or (output.dim() == 0 and output.is_floating_point()) else where
    if isinstance(output, Mapping):
        found = (unjoinable(value, samples, f"{where}[{key!r}]") for key, value in output.items())
        return next((w for w in found if w is not None), None)
    if isinstance(output, list | tuple):
        if per_sample_sequence(output, samples):
            return None
        found = (unjoinable(value, samples, f"{where}[{i}]") for i, value in enumerate(output))
        return next((w for w in found if w is not None), None)
    return where if isinstance(output, int) and not isinstance(output, bool) else None


def _loss_of(output: Any) -> torch.Tensor | None:
    """The loss of a training step's output, as Lightning's automatic optimization reads it."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict):
        return output.get("loss")
    return None


def _extras(output: Any) -> Any:
    """A training step's output but its loss, detached: what reaches ``on_train_batch_end`` beside the loss."""
    if not isinstance(output, Mapping):
        return None
    return apply_to_collection({k: v for k, v in output.items() if k != "loss"}, torch.Tensor, torch.Tensor.detach)


def _joined(outputs: list[Any], counts: list[int], step: str) -> Any:
    try:
        return join_outputs(outputs, counts)
    except OutputsNotJoined as err:
        raise RuntimeError(
            f"MemGuard(on_spill='adapt') split this batch into {len(outputs)} micro-batches and cannot join what"
            f" `{step}` returned for them into the whole batch's: {err}. Return per-sample tensors or lists, or"
            " numbers that are means over samples, or use on_spill='stop'"
        ) from None


def _labels(batch: Any) -> torch.Tensor | None:
    """A batch's labels, where a token mean would count them: a dict batch's ``"labels"`` (Hugging Face's), else
    its last integer tensor (an ``(inputs, targets)`` batch's targets)."""
    if isinstance(batch, Mapping):
        labels = batch.get("labels")
        return labels if isinstance(labels, torch.Tensor) and not labels.is_floating_point() else None
    found = [t for t in tensors_in(batch) if t.dim() > 0 and not t.is_floating_point() and t.dtype != torch.bool]
    return found[-1] if found else None


def token_count(batch: Any, shifted: bool) -> torch.Tensor | None:
    """The labelled tokens of a batch, those a token mean with ``ignore_index=-100`` averages over: every label
    but -100, or (``shifted``: a causal language model's loss, which predicts each token from those before it) every
    label after each row's first. None: the batch has no labels."""
    labels = _labels(batch)
    if labels is None:
        return None
    if shifted:
        labels = labels[..., 1:]
    return (labels != -100).sum()


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


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
        self.validation_chunks = 1  # micro-batches per validation batch (no backward: their outputs joined)
        self.validation_samples = 0  # of the last validation batch
        self.weighting = "samples"  # how each micro-batch's loss is weighted (a key of adapt.WEIGHTINGS)
        self.count: Callable[[Any], Any] | None = None  # weighting "declared": what a part's loss averages over
        self.unjoinable: str | None = None  # where the last whole step's output could not be joined if split
        self.validation_unjoinable: str | None = None  # the same for the last whole validation step
        self._training_step: Callable[..., Any] | None = None  # the strategy's own
        self._owned = False  # this step's zero_grad and backward were done here
        self._stack = ExitStack()

    # ------------------------------------------------------------------ installing

    def install(self, pl_module: LightningModule) -> None:
        strategy = self.trainer.strategy
        step, backward = strategy.training_step, strategy.backward
        zero_grad = pl_module.optimizer_zero_grad
        self._training_step = step

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
                output = validation_step(*args, **kwargs)
                self.validation_unjoinable = unjoinable(output, samples)
                return output
            outputs, counts = [], []
            for part, n in split_batch(batch, samples, self.validation_chunks):
                with logged_as_batch(self.trainer, part, n):  # logged figures weighted by the micro-batch's samples
                    outputs.append(validation_step(part, *args[1:], **kwargs))
                counts.append(n)
            return _joined(outputs, counts, "validation_step")  # what the hooks get: the whole batch's outputs

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
                if why_not is None:  # what the failed step held is let go of before the next lever is planned
                    traceback.clear_frames(err.__traceback__)
                    free_memory()
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
            self.unjoinable = unjoinable(_extras(whole), samples)
            return whole
        parts = split_batch(batch, samples, self.chunks)
        coefficients = self.coefficients(parts)
        total: torch.Tensor | None = None
        outputs: list[Any] = []
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
                logged_as_batch(trainer, part, n),
            ):
                output = step(part, *args[1:], **kwargs)
                loss = _loss_of(output)
                outputs.append(_extras(output))  # detached: no micro-batch's graph outlives its backward
                if loss is None:
                    skipped += 1
                    continue
                if coefficients[i]:
                    weighted = loss * coefficients[i] / accumulate
                    backward(weighted, optimizer)
                else:  # nothing its loss counts (its labels all ignored: the loss is 0 / 0): it adds nothing
                    weighted = torch.zeros_like(loss)
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
        # the value Lightning logs and divides by its accumulation: the batch's loss, as one step would give it; the
        # other outputs joined into the whole batch's
        loss = total * accumulate
        if isinstance(output, torch.Tensor):
            return loss
        return {**_joined(outputs, [n for _, n in parts], "training_step"), "loss": loss}

    def coefficients(self, parts: list[tuple[Any, int]]) -> list[float]:
        """What each micro-batch's loss is multiplied by so that their gradients add up to the whole batch's, by
        :attr:`weighting`."""
        if self.weighting in ("tokens", "next_tokens"):
            counted = [token_count(part, self.weighting == "next_tokens") for part, _ in parts]
            found = [c for c in counted if c is not None]
            counts = torch.stack(found).tolist() if len(found) == len(parts) else None  # one sync for all
        elif self.weighting == "declared" and self.count is not None:
            counts = [float(self.count(part)) for part, _ in parts]
        else:
            counts = [n for _, n in parts]
        return loss_coefficients(self.weighting, counts if counts is not None else [n for _, n in parts])

    def judge_loss(self, batch: Any) -> str | None:
        """How the loss weighs a batch's parts, found on its first (up to) four samples before any split: their loss
        whole, and the losses of their first sample and of the rest, each of the step run without gradients, with
        the model in eval mode (no dropout, BatchNorm's running statistics), ``self.log`` off and the random number
        generators put back. The weighting whose counts join the parts' losses into the whole's (see
        :func:`~lightning_memguard.tuning.adapt.judge_weighting`); None where none does: the loss couples the
        samples of a batch. Where it cannot be checked (one sample, an out-of-memory error, a step that returns no
        loss or a loss that is not finite), the weighting the batch shows: its labelled tokens if it holds labels
        that a sample mean would not weigh alike, else its samples."""
        samples = samples_in(batch) or 1
        size = min(samples, 4)
        counts: dict[str, list[float]] = {"samples": [1, size - 1], "sum": [1, size - 1]}
        sub = take_samples(batch, samples, 0, size)
        halves = [take_samples(sub, size, 0, 1), take_samples(sub, size, 1, size)]
        labels = _labels(sub)
        fallback = "samples"
        if labels is not None:
            for weighting, shifted in (("tokens", False), ("next_tokens", True)):
                if shifted and labels.dim() < 2:
                    continue
                each = [token_count(h, shifted) for h in halves]
                counts[weighting] = [float(c) for c in each]  # type: ignore[arg-type]
            if counts["tokens"] != counts["samples"]:
                fallback = "tokens"
        if size < 2 or self._training_step is None:
            return fallback
        try:
            losses = self._losses([sub, *halves])
        except (torch.OutOfMemoryError, RuntimeError) as err:
            if not (isinstance(err, torch.OutOfMemoryError) or is_oom_error(err)):
                raise
            del err
            free_memory()
            return fallback
        if losses is None or not all(math.isfinite(v) for v in losses):
            return fallback
        return judge_weighting(losses[0], losses[1:], counts)

    def _losses(self, batches: list[Any]) -> list[float] | None:
        """The training step's loss for each batch, without gradients, in eval mode, logging off, nothing kept."""
        module = self.trainer.lightning_module
        modes = [(m, m.training) for m in module.modules()]
        states = rng_states()
        step = self._training_step
        assert step is not None
        try:
            module.eval()
            with torch.no_grad(), _hook_replaced(module, "log", _nothing), _hook_replaced(module, "log_dict", _nothing):
                losses = [_loss_of(step(b, 0)) for b in batches]
            return None if any(v is None for v in losses) else [float(v) for v in losses]  # type: ignore[arg-type]
        finally:
            for m, training in modes:
                m.training = training
            set_rng_states(states)

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


def free_memory() -> None:
    """Let go of what a failed step held: Python's cycles collected, the CUDA allocator's cache emptied."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def not_yet_held(model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> int:
    """Bytes a step will add beside its activations that are not held yet (before the first optimizer step): the
    gradients of trainable weights that hold none, and the optimizer state of weights that have none, two tensors
    of a weight's size for an optimizer with ``betas`` (Adam's kin), one with a ``momentum``, none for plain SGD."""
    added = 0
    states = {}
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            kept = 2 if "betas" in group else int(bool(group.get("momentum")))
            for p in group["params"]:
                if not optimizer.state.get(p):
                    states[id(p)] = kept
    for p in model.parameters():
        if p.requires_grad:
            size = p.numel() * p.element_size()
            added += (size if p.grad is None else 0) + size * states.get(id(p), 0)
    return added


ADAPT_NO_FUSED_LOSS = (
    "not taken by on_spill='adapt' (its gradients equal the plain loss's within floating-point tolerance only, and"
    " the model's output would hold no logits for the training step to read)"
)
"""Why ``on_spill="adapt"`` leaves the fused loss out of its savers, as a plan's summary says it."""


@dataclass(frozen=True)
class Savers:
    """The savers that keep the batch whole, as planned (by rank zero) and applied on every rank.

    Attributes:
        record: what was applied: a levers' plan's record (:meth:`~lightning_memguard.levers.LeverPlan.record`,
            applied again by :func:`~lightning_memguard.levers.plan_levers.apply_record`), or the checkpointing
            planner's runs (``{"runs": ..., "split_graphs": ...}``: a compiled model, or every block), applied again
            by :func:`apply_savers`.
        said: the plan's summary.
        held: the plan's measured peak met the room (None: not planned, every block checkpointed).
        peak: the step's activations without them, measured on ``samples`` samples (bytes; None: not measured).
        floor: the step's activations with them, measured on ``samples`` samples (bytes; None: not measured).
        samples: the samples the plan was measured on.
        switch_s: wall seconds the switch took (planning and applying), by the adapter's clock.
    """

    record: dict[str, Any] = field(default_factory=dict)
    said: str = ""
    held: bool | None = None
    peak: int | None = None
    samples: int = 0
    switch_s: float | None = None
    floor: int | None = None

    @property
    def taken(self) -> bool:
        """Anything applied (a plan whose budget the model met as it was takes nothing)."""
        record = self.record
        return any(record.get(key) for key in ("fused_loss", "runs", "checkpointed", "pointwise"))

    def to_dict(self) -> dict[str, Any]:
        return {"record": self.record, "said": self.said, "held": self.held, "peak": self.peak,
                "samples": self.samples, "floor": self.floor}  # fmt: skip


def _budgeted_checkpoints(pl_module: LightningModule, example: Any, room: int) -> CheckpointPlan:
    """The checkpointing planner for ``room`` bytes of activations, compile's ``activation_memory_budget`` left at its
    default: the adapter holds no compile setting for the rest of a run, so a plan that needed one would not be what
    runs (nor what a resumed run applies again from the record)."""
    return checkpoint_blocks(pl_module, memory_budget=int(room), example_input=example, compile_settings=())


_SAVERS_MARK = "memguard_adapt_savers"
"""Set in a LightningModule's ``__dict__`` while the levers it carries are the adapter's savers (not in its
``state_dict``): what tells them from the user's own levers, which the adapter never plans over or removes."""


def _took_savers(pl_module: nn.Module) -> bool:
    return bool(pl_module.__dict__.get(_SAVERS_MARK))


def _mark_savers(pl_module: nn.Module, taken: bool) -> None:
    if taken:
        pl_module.__dict__[_SAVERS_MARK] = True
    else:
        pl_module.__dict__.pop(_SAVERS_MARK, None)


def apply_savers(model: nn.Module, record: dict[str, Any]) -> None:
    """Apply the savers' record again, nothing measured: a levers' plan's (it has a ``"version"``) by
    :func:`~lightning_memguard.levers.plan_levers.apply_record`, else the checkpointing planner's runs."""
    if "version" in record:
        apply_record(model, record)
    else:
        apply_plan(model, [list(run) for run in record.get("runs", [])], split_graphs=bool(record.get("split_graphs")))


class RunAdapter:
    """What ``MemGuard(on_spill="adapt")`` does instead of stopping: the levers, in order, each only where it keeps the
    training the same, the record of every change, and growing back when memory frees.

    Levers, in order (one process, or DDP):

    1. The savers that keep the batch whole: the levers' planner
       (:func:`~lightning_memguard.levers.plan_levers.plan_levers`) on the LightningModule for the room free for the
       step's activations, measured on the batch in hand: whole blocks or their parts checkpointed, pointwise chains
       recomputed; BatchNorm-exact, the gradients those of the plain step bit for bit. Not the fused loss: its
       gradients equal the plain loss's within floating-point tolerance only, and a Hugging Face model's output would
       then hold no logits (:data:`ADAPT_NO_FUSED_LOSS`). Not offload: it needs a context around every step, which
       the adapter does not hold. Where the plan holds, the batch is not split. Rank zero plans, every rank applies
       its record. A model compiled with ``torch.compile`` is planned by the checkpointing planner, which measures
       it compiled.
    2. Where the plan does not hold (the floor reached) or could not be planned (no batch or room known, planning
       raised: every block checkpointed instead; after an out-of-memory error, split only once the step redone with
       them runs out of memory too), the savers stay on and each batch is split into more micro-batches
       (not for a model whose BatchNorm layers train, unless ``allow_batchnorm``; not below one sample, nor where one
       sample does not fit). A model without blocks is split at once.

    Under a sharded strategy (FSDP, ModelParallelStrategy) a measurement on one rank would leave the others waiting
    in the shards' gathers: there the order is as before the levers' planner, the split first, then activation
    checkpointing. When no lever is left, or at once where the run's readings say no micro-batch can fit beside
    what is held (what a step starts from, other processes' memory), :meth:`after_spill` says why and the caller
    stops the run as ``"stop"`` does.

    Growing back goes the same way backwards (:meth:`maybe_grow`): fewer micro-batches while split; once whole, the
    savers removed where the readings say the step's activations without them (the plan's measured baseline) fit.

    Args:
        allow_batchnorm: split batches of a model whose BatchNorm layers train (their statistics then come from each
            micro-batch: not the same training).
        grow_every: optimizer steps between attempts to use fewer micro-batches again (doubling after one that
            spilled again).
        headroom: the fraction of capacity a configuration must leave free to be grown into.
        loss: how the training loss weighs a batch's samples (``MemGuard(adapt_loss=...)``): ``"auto"`` (found out
            before the first split, :meth:`MicroBatches.judge_loss`), ``"mean"``, ``"sum"``, ``"coupled"`` (never
            split), or a function of a micro-batch giving the count its loss averages over.
        clock: seconds as a float, read as a switch of the savers starts and ends (``MemGuard(clock=...)``).
    """

    def __init__(
        self,
        allow_batchnorm: bool,
        grow_every: int,
        headroom: float,
        loss: str | Callable[[Any], Any] = "auto",
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.clock = clock
        self.savers: Savers | None = None  # the savers on (None: none, or a checkpoint from before they were kept)
        self.room: int | None = None  # bytes free for a step's activations, by the latest reading (an OOM's room)
        self.capacity: int | None = None  # what MemGuard judges against (a declared capacity below the card's)
        self.read_memory: Callable[[], Any] | None = None  # MemGuard's probe, read at an out-of-memory error
        self.allow_batchnorm = allow_batchnorm
        self.loss = loss
        self.weighting: str | None = None  # how a micro-batch's loss is weighted, once known ("coupled": not split)
        self.headroom = headroom
        self.grow = GrowBack(grow_every)
        self.adaptations: list[Adaptation] = []
        self.chunks = 1  # micro-batches per loaded batch
        self.validation_chunks = 1  # micro-batches per validation batch (restored from a checkpoint)
        self.checkpointing = False  # turned on by an adaptation
        self._micro: MicroBatches | None = None
        self._trainer: Trainer | None = None
        self._grew_at: int | None = None  # the step of the last growth, while it may still be undone
        self._validation_refused = False  # said once: validation's outputs could not be joined if split
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
        carried = applied_levers(pl_module)
        if carried and _took_savers(pl_module) and not self.checkpointing:  # an earlier fit's, this one knows none
            remove_levers(pl_module)  # the fit starts from the model as it was built
            _mark_savers(pl_module, False)
            carried = []
        if self.checkpointing and carried and not _took_savers(pl_module):  # the checkpoint's, beside the user's own
            rank_zero_warn(
                f"MemGuard: the checkpoint's savers are not applied: the model carries levers of its own"
                f" ({'; '.join(carried)}), which are kept; a spill splits the batch instead",
                category=RuntimeWarning,
            )
            self.checkpointing, self.savers = False, None
        elif self.checkpointing and not carried:
            # a resumed run: the savers it took, again, nothing measured (every block: a checkpoint without the plan)
            if self.savers is not None:
                apply_savers(pl_module, self.savers.record)
            else:
                checkpoint_blocks(pl_module)
            _mark_savers(pl_module, True)
        if not pl_module.automatic_optimization:
            return  # a spill then stops the run, saying why (see `_cannot_split`)
        self._micro = MicroBatches(trainer, self._after_oom, recover=trainer.world_size == 1)
        self._micro.chunks = self.chunks
        self._micro.validation_chunks = self.validation_chunks
        self._micro.weighting = self.weighting if self.weighting not in (None, "coupled") else "samples"
        self._micro.count = self.loss if callable(self.loss) else None
        self._micro.install(pl_module)

    def stop(self) -> None:
        if self._micro is not None:
            self.validation_chunks = self._micro.validation_chunks
            self._micro.uninstall()
            self._micro = None
        self._trainer = None  # the finished fit's Trainer (and its model) is not kept

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
        room = None
        if spill is not None and allocated_now is not None:
            room = self._room(spill.capacity, spill.other_bytes, allocated_now)
        room = _agreed_room(trainer, room)  # the least any rank has: one plan for every rank
        return self._lever(trainer, pl_module, samples, wanted, why, batch, room, no_split)

    def read(self, reading: Any) -> None:
        """Memory was read between steps: the room a step's activations have now, against the memory MemGuard
        judges (:attr:`capacity`), kept for an out-of-memory error's savers (planned without a spill's figures)."""
        if reading.allocated_now is not None:
            capacity = reading.capacity if self.capacity is None else min(self.capacity, reading.capacity)
            self.room = self._room(capacity, reading.other_processes, reading.allocated_now)

    def _room(self, capacity: int, others: int | None, allocated_now: int) -> int:
        """Bytes a step's activations may use: the capacity less its headroom, other processes' memory and what a
        step starts from (weights, gradients, optimizer state)."""
        return int(capacity * (1 - self.headroom)) - (others or 0) - allocated_now

    def _after_oom(self, chunks: int, samples: int, error: BaseException) -> int | None:
        """An out-of-memory error inside a training step: the split to redo it with, or None (raised)."""
        trainer = self._trainer
        assert trainer is not None
        why = f"{self._shape(samples)} ran out of memory"
        if self.read_memory is not None:  # the failed step's tensors are let go of: what the step starts from, now
            self.read(self.read_memory())
            if self.room is not None:  # a first step: its gradients and optimizer state are not held yet
                self.room -= not_yet_held(trainer.lightning_module, trainer.optimizers)
        why_not = self._lever(
            trainer, trainer.lightning_module, samples, min(chunks * 2, samples), why, room=self.room, redo=True
        )
        if why_not is not None:
            if self._micro is not None:
                self._micro.why_not = why_not
            return None
        return self.chunks

    def _checkpoint(self, pl_module: LightningModule, batch: Any, samples: int, room: int | None) -> str:
        """Activation checkpointing that fits what is free now (under a sharded strategy, where the split comes
        first): the library's planner with a budget of ``room`` bytes for the step's activations, measured on a
        micro-batch of this batch (its inputs found as a budget without ``example_input_array`` finds them); every
        block where that cannot be planned (no batch or room known, inputs ``forward`` does not take or fails on, the
        measurement itself out of memory). Returns the plan's summary.

        Raises:
            ValueError: the model has no blocks to checkpoint.
        """
        if batch is not None and room is not None and room > 0:
            part = split_batch(batch, samples, self.chunks)[0][0] if self.chunks > 1 else batch
            try:
                example, _ = inputs_from_batch(part, pl_module.forward)
                return _budgeted_checkpoints(pl_module, example, room).summary()
            except (ValueError, TypeError, RuntimeError):  # RuntimeError: out of memory too
                free_memory()  # planned on nothing usable (say a batch of indices the model maps): every block
        return checkpoint_blocks(pl_module).summary()

    def _plan_savers(self, pl_module: LightningModule, batch: Any, samples: int, room: int | None) -> Savers:
        """The savers that keep the batch whole, planned and applied on this process: the levers' planner for
        ``room`` bytes of activations on the batch in hand (a micro-batch of it where split; a compiled model: the
        checkpointing planner, which measures it compiled), else (no batch or room, inputs ``forward`` does not take
        or fails on, the measurement itself out of memory) every block checkpointed.

        Raises:
            ValueError: the model has no blocks.
        """
        part = batch
        if batch is not None and self.chunks > 1:
            part = split_batch(batch, samples, self.chunks)[0][0]
        size = micro_batch(samples, self.chunks)
        why = "; not planned: " + (
            "no batch in hand" if part is None
            else "the room for activations is not known" if room is None
            else f"no room left for activations ({room / 1e6:.1f} MB)"
        )  # fmt: skip
        if part is not None and room is not None and room > 0:
            try:
                example, _ = inputs_from_batch(part, pl_module.forward)
                if is_compiled(pl_module):
                    checkpoints = _budgeted_checkpoints(pl_module, example, room)
                    record = {"runs": checkpoints.runs, "split_graphs": bool(checkpoints.graph_splits)}
                    said, held = checkpoints.summary(), checkpoints.held
                    floor = checkpoints.measured_bytes
                    return Savers(record, said, held, checkpoints.baseline_bytes, size, floor=floor)
                plan = plan_levers(pl_module, example, int(room), fused_loss=False, offload=False)
                # said where the planner would have offered it: the model, or the Hugging Face model it holds
                plan.loss_refused = ADAPT_NO_FUSED_LOSS if find_loss_target(pl_module)[2] is None else None
                floor = plan.measured_bytes
                return Savers(plan.record(), plan.summary(), plan.held, plan.baseline_bytes, size, floor=floor)
            except (ValueError, TypeError, RuntimeError) as err:  # RuntimeError: out of memory too
                free_memory()  # planned on nothing usable (say a batch of indices the model maps): every block
                why = f"; not planned: measuring the batch raised {type(err).__name__}: {str(err)[:160]}"
        every = checkpoint_blocks(pl_module)
        said = every.summary() + why
        return Savers({"runs": every.runs, "split_graphs": bool(every.graph_splits)}, said, None, None, size)

    def _take_savers(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, samples: int, room: int | None
    ) -> Savers | None:
        """The savers that keep the batch whole, on every rank alike: rank zero plans and applies them
        (:meth:`_plan_savers`), the others apply its record. Timed by :attr:`clock`. None: the plan took nothing
        (the model left as it was).

        Raises:
            ValueError: the model has no blocks (on rank zero: every rank raises).
            SaversNotPlanned: on the other ranks, where rank zero's planning raised anything else (rank zero raises
                that error itself): no rank is left waiting for a plan that never comes.
        """
        start = self.clock()

        def plan() -> Savers | str:
            try:
                with trainer.precision_plugin.train_step_context():  # measured as the step runs (autocast)
                    return self._plan_savers(pl_module, batch, samples, room)
            except ValueError as err:  # no blocks: every rank raises it
                return str(err)

        def broadcast(obj: Any) -> Any:
            return trainer.strategy.broadcast(obj, src=0) if trainer.world_size > 1 else obj

        planned: Savers | str = planned_on_rank_zero(
            plan,
            trainer.is_global_zero,
            broadcast,
            lambda said: SaversNotPlanned(f"rank zero failed planning the savers: {said}"),
        )
        if isinstance(planned, Savers) and planned.taken and not trainer.is_global_zero:
            apply_savers(pl_module, planned.record)
        if isinstance(planned, str):
            raise ValueError(planned)
        if not planned.taken:
            return None
        self.checkpointing = True
        _mark_savers(pl_module, True)
        self.savers = replace(planned, switch_s=self.clock() - start)
        return self.savers

    def _savers_first(self, trainer: Trainer) -> bool:
        """Whether the savers that keep the batch whole come before a split: on one device and under DDP, where the
        model is whole on every rank (not under a sharded strategy)."""
        return isinstance(trainer.strategy, SingleDeviceStrategy | DDPStrategy)

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
        redo: bool = False,
    ) -> str | None:
        """The next lever, said and recorded (None), or why none is left. ``no_split``: why the run's readings say
        no split fits (then the savers are the only lever). ``redo``: the step is redone at once (an out-of-memory
        error): savers taken without a plan (every block) are tried on the whole batch first, a split only where that
        runs out of memory too."""
        before = self.chunks
        self.grow.restart(trainer.global_step)  # the next try with fewer micro-batches comes an interval later
        if batch is None and self._micro is not None:
            batch = self._micro.batch
        kept = [] if self.checkpointing else applied_levers(pl_module)  # the user's own: never planned over
        if kept:
            why = f"{why}; the model's own levers are kept ({'; '.join(kept)})"
        plannable = not self.checkpointing and not kept and self._savers_first(trainer)
        savers, no_blocks = self._try_savers(trainer, pl_module, batch, samples, room) if plannable else (None, None)
        if savers is not None and savers.held:  # the batch stays whole
            self._said_savers(trainer, samples, before, why, savers)
            return None
        if savers is not None and savers.floor is not None and room is not None:  # the split beside the savers
            wanted = chunks_with_savers(samples, self.chunks, savers.floor, savers.samples, room)
        elif savers is not None and redo:  # every block, unplanned: the redone step says whether the batch fits whole
            wanted = self.chunks
        cannot = self._cannot_split(pl_module, samples, batch) or no_split
        if cannot is None and wanted > self.chunks:
            self._split(trainer, samples, before, wanted, why, savers)
            return None
        if savers is None and plannable and no_blocks is None:
            # the plan took nothing (the model's peak met the room as measured) and no split is left: every block
            savers, no_blocks = self._try_savers(trainer, pl_module, None, samples, None)
        if savers is not None:  # the savers alone, the batch not split (it cannot be, or no further)
            self._said_savers(trainer, samples, before, why, savers)
            return None
        split = cannot or "the batch cannot be split further"
        if no_blocks is not None:
            return f"{split}, and activation checkpointing found {no_blocks}"
        if kept:
            return f"{split}, and the model's own levers are kept ({'; '.join(kept)})"
        if self.checkpointing:
            return f"{cannot or 'each micro-batch holds one sample'}, and activation checkpointing is on already"
        return self._checkpoint_last(trainer, pl_module, samples, before, why, batch, room, split)

    def _try_savers(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, samples: int, room: int | None
    ) -> tuple[Savers | None, str | None]:
        """The savers taken (:meth:`_take_savers`), or why the model has no blocks for them."""
        try:
            return self._take_savers(trainer, pl_module, batch, samples, room), None
        except ValueError as err:  # no blocks: split as before
            return None, str(err)

    def _split(self, trainer: Trainer, samples: int, before: int, wanted: int, why: str, savers: Savers | None) -> None:
        """The batch split into ``wanted`` micro-batches (beside ``savers``, where taken), said and recorded."""
        self._set_chunks(wanted)
        self._said(
            Adaptation(
                trainer.global_step,
                samples,
                before,
                wanted,
                savers is not None,
                why,
                trainer.accumulate_grad_batches,
                weighting=self.weighting or "",
                savers=savers.said if savers is not None else "",
                switch_s=savers.switch_s if savers is not None else None,
            )  # fmt: skip
        )

    def _checkpoint_last(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        samples: int,
        before: int,
        why: str,
        batch: Any,
        room: int | None,
        split: str,
    ) -> str | None:
        """Checkpointing, the last lever, where no savers were taken (a sharded strategy, or a plan that took nothing
        twice), measured as the step runs: said and recorded (None), or why the model has no blocks for it."""
        try:
            with trainer.precision_plugin.train_step_context():  # measured as the step runs
                plan = self._checkpoint(pl_module, batch, samples, room)
        except ValueError as err:  # no blocks found
            return f"{split}, and activation checkpointing found {err}"
        self.checkpointing = True
        _mark_savers(pl_module, True)
        why = f"{why}; activation checkpointing: {plan}"
        self._said(Adaptation(trainer.global_step, samples, before, before, True, why, trainer.accumulate_grad_batches))
        return None

    def _said_savers(self, trainer: Trainer, samples: int, before: int, why: str, savers: Savers) -> None:
        self._said(
            Adaptation(
                trainer.global_step,
                samples,
                before,
                self.chunks,
                True,
                why,
                trainer.accumulate_grad_batches,
                weighting=(self.weighting or "") if self.chunks > 1 else "",
                savers=savers.said,
                switch_s=savers.switch_s,
            )  # fmt: skip
        )

    def _cannot_split(self, pl_module: LightningModule, samples: int, batch: Any = None) -> str | None:
        if self._micro is None:
            return "the model optimizes manually (`automatic_optimization=False`): its steps cannot be split"
        if samples < 2 or self.chunks >= samples:
            return "each micro-batch holds one sample"
        rows = sorted({t.shape[0] for t in tensors_in(batch) if t.dim() > 0})
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
        if self._micro.unjoinable is not None:
            return (
                f"`training_step` returns {self._micro.unjoinable}, a value that is neither one entry per sample nor"
                " a number to average, so the outputs of micro-batches could not be joined into the batch's"
            )
        return self._loss_couples(batch)

    def _loss_couples(self, batch: Any) -> str | None:
        """Why the loss cannot be split (it couples the samples of a batch), or None, once the weighting is known:
        declared, or found on the batch in hand (every rank the same: the one of a coupled loss, if any has it)."""
        assert self._micro is not None
        if self.weighting is None:
            if callable(self.loss):
                weighting: str | None = "declared"
            elif self.loss == "auto":
                weighting = self._micro.judge_loss(batch) if batch is not None else "samples"
            else:
                weighting = {"mean": "samples", "sum": "sum", "coupled": None}[self.loss]
            order = [*WEIGHTINGS, "coupled"]
            trainer = self._trainer
            assert trainer is not None
            self.weighting = order[_agreed_max(trainer, order.index(weighting or "coupled"))]
            if self.weighting != "coupled":
                self._micro.weighting = self.weighting
        if self.weighting != "coupled":
            return None
        if self.loss == "coupled":
            return "the loss couples the samples of a batch (`MemGuard(adapt_loss='coupled')`): it cannot be split"
        return (
            "the loss couples the samples of a batch: on its first samples, the loss of each part joined by samples,"
            " by labelled tokens or as a sum is not the loss of them together (an in-batch contrastive loss has fewer"
            " negatives in a micro-batch), so no split keeps its gradients (`MemGuard(adapt_loss=...)` declares"
            " how the loss weighs its samples where this is wrong)"
        )

    def after_validation_spill(self, trainer: Trainer, reading: Any, capacity: int) -> None:
        """Validation spilled (every rank agreed, at its end): its batches run in twice as many micro-batches from
        the next validation on. Validation trains nothing, so splitting it changes no weight: a model's logged
        figures, averaged over samples, are the same, and what ``validation_step`` returns is joined into the whole
        batch's for the hooks. Where it returns what could not be joined (a count), validation is not split, and
        that is said once."""
        micro = self._micro
        if micro is None:
            return
        samples = max(micro.validation_samples, 1)
        before = micro.validation_chunks
        size = size_formatter(capacity, 2)
        why = f"validation spilled ({size(reading.used)} on a {size(capacity)} card)"
        if _agreed_max(trainer, int(micro.validation_unjoinable is not None)):
            if before == 1 and not self._validation_refused:
                self._validation_refused = True
                rank_zero_warn(
                    f"MemGuard did not adapt: {why}, and `validation_step` returns"
                    f" {micro.validation_unjoinable or 'on another rank a value'} that is neither one entry per sample"
                    " nor a number to average: the outputs of micro-batches could not be joined into the batch's, so"
                    " validation batches are not split",
                    category=RuntimeWarning,
                )
            return
        micro.validation_chunks = _agreed_max(trainer, min(before * 2, samples))
        self._said(
            Adaptation(trainer.global_step, samples, before, micro.validation_chunks, False, why, validation=True)
        )

    @property
    def installed(self) -> bool:
        return self._micro is not None

    # ------------------------------------------------------------------ growing back

    @property
    def can_grow(self) -> bool:
        """Whether there is a way back: fewer micro-batches, or (whole again) savers whose absence can be judged
        (their plan measured the step without them)."""
        return self.chunks > 1 or (self.checkpointing and self.savers is not None and self.savers.peak is not None)

    def maybe_grow(self, trainer: Trainer, reading: Any, capacity: int, samples: int) -> bool:
        """Every few hundred steps while adapted: whether fewer micro-batches fit what is free now, from this run's
        readings (what a step starts from, and what each sample adds on top); every rank takes the largest split any
        needs. Once whole again, whether the step fits without the savers (:meth:`_maybe_remove_savers`). True: grown
        (said and recorded)."""
        if self.chunks <= 1:
            return self._maybe_remove_savers(trainer, reading, capacity, samples)
        if self._micro is None or not self.grow.due(trainer.global_step):
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
        self._said(
            Adaptation(
                step,
                samples,
                before,
                agreed,
                False,
                freed,
                trainer.accumulate_grad_batches,
                weighting=self.weighting or "",
            )  # fmt: skip
        )
        return True

    def _maybe_remove_savers(self, trainer: Trainer, reading: Any, capacity: int, samples: int) -> bool:
        """Whole batches with the savers on: whether the step's activations without them (the plan's measured
        baseline, scaled to this batch's samples) fit what is free now beside what a step starts from, with the same
        headroom as fewer micro-batches; every rank keeps them where any says they do not fit. Without that figure
        (every block checkpointed unplanned, a checkpoint from before it was kept) they stay. True: removed (said,
        recorded, timed)."""
        savers = self.savers
        if not self.checkpointing or savers is None or savers.peak is None or not self.grow.due(trainer.global_step):
            return False
        step = trainer.global_step
        peak = savers.peak * samples / max(savers.samples, 1)
        fits = False
        if reading.allocated_now is not None:
            fits = peak <= self._room(min(capacity, reading.capacity), reading.other_processes, reading.allocated_now)
        stays = _agreed_max(trainer, int(not fits))
        self.grow.tried(step, undone=False)
        if stays:
            return False
        start = self.clock()
        remove_levers(trainer.lightning_module)
        _mark_savers(trainer.lightning_module, False)
        seconds = self.clock() - start
        self.checkpointing, self.savers = False, None
        self._grew_at = step
        size = size_formatter(capacity, 2)
        free = min(capacity, reading.capacity) - (reading.allocated_now or 0) - (reading.other_processes or 0)
        freed = f"memory freed ({size(free)} free; the step's activations without the savers: {size(int(peak))})"
        self._said(
            Adaptation(
                step,
                samples,
                1,
                1,
                False,
                freed,
                trainer.accumulate_grad_batches,
                savers=savers.said.split(";")[0],  # what was taken; its figures were said when it was
                savers_off=True,
                switch_s=seconds,
            )  # fmt: skip
        )
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
            "savers": self.savers.to_dict() if self.savers is not None else None,  # re-applied, nothing measured
            "weighting": self.weighting,
            "grow_interval": self.grow.interval,  # doubled by growths that spilled again: the card stayed full
            "grow_every": self.grow.every,  # the setting it was doubled from
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.adaptations = [Adaptation(**_known(Adaptation, row)) for row in state.get("adaptations", [])]
        self._set_chunks(int(state.get("chunks", 1)))
        self.validation_chunks = int(state.get("validation_chunks", 1))
        self.checkpointing = bool(state.get("checkpointing", False))
        # a checkpoint from before the savers were kept, checkpointing on, had every block checkpointed
        saved = state.get("savers")
        self.savers = Savers(**_known(Savers, saved)) if self.checkpointing and saved else None
        # a checkpoint from before the weighting was kept, split already, weighted its micro-batches by samples
        self.weighting = state.get("weighting", "samples" if self.chunks > 1 else None)
        if self._micro is not None and self.weighting not in (None, "coupled"):
            self._micro.weighting = self.weighting
        # the interval doubled by growths undone, where the run keeps the setting it was doubled from; a `grow_every`
        # given anew is the user's (a checkpoint from before the setting was kept: its interval kept)
        if int(state.get("grow_every", self.grow.every)) == self.grow.every:
            self.grow.interval = int(state.get("grow_interval", self.grow.every))
        self._resumed = self.chunks > 1


def _agreed_max(trainer: Trainer, value: int) -> int:
    """The largest of every rank's ``value`` (its own in one process)."""
    if trainer.world_size <= 1:
        return value
    tensor = torch.tensor(float(value), device=trainer.strategy.root_device)
    return int(trainer.strategy.reduce(tensor, reduce_op="max").item())


def _agreed_room(trainer: Trainer, room: int | None) -> int | None:
    """The least ``room`` of the ranks that know one (None where none does; its own in one process)."""
    if trainer.world_size <= 1:
        return room
    unknown = -(2.0**60)
    value = -float(room) if room is not None else unknown
    tensor = torch.tensor(value, dtype=torch.float64, device=trainer.strategy.root_device)
    most = float(trainer.strategy.reduce(tensor, reduce_op="max").item())
    return None if most <= unknown else int(-most)


def refuse_to_adapt(trainer: Trainer) -> None:
    """``on_spill="adapt"`` where the strategy keeps the training step to itself: refused in ``setup``."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    strategy = trainer.strategy
    if isinstance(strategy, DeepSpeedStrategy):
        raise ValueError(
            "MemGuard(on_spill='adapt') does not support DeepSpeedStrategy: DeepSpeed's engine runs the backward and"
            " the accumulation itself, so a step cannot be split or redone; use on_spill='stop' (or 'raise')"
        )
