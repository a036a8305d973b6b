"""Applying the checkpointing settings to a model once, and what was chosen: what the callback and the strategies
share."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import warnings
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn

from lightning_memguard import _compiler
from lightning_memguard.checkpointing.measure import example_arguments, measured_alike
from lightning_memguard.checkpointing.plan import apply_plan, checkpoint_blocks
from lightning_memguard.checkpointing.result import CheckpointPlan
from lightning_memguard.checkpointing.settings import CheckpointingSettings


class CheckpointingPolicy:
    """Applies :class:`~.settings.CheckpointingSettings` to a model once, and keeps what was chosen.

    :meth:`apply` changes a model once: without a budget every block (and a ResNet's stem) is checkpointed, the
    same on every process; with one, rank zero measures on a real batch and every rank applies rank zero's runs
    (``broadcast``), so all ranks train the same model. :attr:`runs` is what was chosen: a resumed run hands it back
    and nothing is measured again.

    The settings are read as ``policy.settings.memory_budget`` (``strategy.checkpointing.settings.memory_budget``);
    the old attributes ``policy.units``, ``memory_budget``, ``bn_correct``, ``rebuild_bn_relu`` and
    ``rebuild_config`` still read them, and setting one replaces the settings (checked again), each with a
    ``DeprecationWarning``: they go in the next release.

    Args:
        settings: what to checkpoint and how (checked where they are made); None: the defaults.

    Example:
        >>> import torchvision
        >>> policy = CheckpointingPolicy()
        >>> policy.apply(torchvision.models.resnet18())
        >>> policy.runs[:2]
        [['stem'], ['layer1.0']]
    """

    # the settings where they were before CheckpointingSettings held them: read and set through it, with a warning
    units = property(lambda self: self._moved("units"), lambda self, v: self._moved("units", v))
    memory_budget = property(lambda self: self._moved("memory_budget"), lambda self, v: self._moved("memory_budget", v))
    bn_correct = property(lambda self: self._moved("bn_correct"), lambda self, v: self._moved("bn_correct", v))
    rebuild_bn_relu = property(
        lambda self: self._moved("rebuild_bn_relu"), lambda self, v: self._moved("rebuild_bn_relu", v)
    )
    rebuild_config = property(
        lambda self: self._moved("rebuild_config"), lambda self, v: self._moved("rebuild_config", v)
    )

    def __init__(self, settings: CheckpointingSettings | None = None) -> None:
        self.settings = settings if settings is not None else CheckpointingSettings()
        self.plan: CheckpointPlan | None = None  # this process's plan, where it made one
        self.runs: list[list[str]] | None = None  # the chosen runs of blocks: learned state
        # under torch.compile, compile's activation_memory_budget chosen with the runs (None: compile's default)
        self.compile_setting: float | None = None
        # whether the runs' containers each begin a compiled graph of their own (CheckpointPlan.graph_splits)
        self.split_graphs = False
        self._compiling = ExitStack()  # the setting, held for a fit (hold_compile_setting)

    def _moved(self, name: str, *value: Any) -> Any:
        """The setting ``name`` read (or, given a value, set) at its old place, with a ``DeprecationWarning``."""
        warnings.warn(
            f"`checkpointing.{name}` moved to `checkpointing.settings.{name}` (a CheckpointingSettings); the old"
            " attribute goes in the next release",
            DeprecationWarning,
            stacklevel=3,
        )
        if value:
            self.settings = dataclasses.replace(self.settings, **{name: value[0]})  # checked again
            return None
        return getattr(self.settings, name)

    def apply(
        self,
        model: nn.Module,
        example_input: Any = None,
        *,
        is_rank_zero: bool = True,
        broadcast: Callable[[Any], Any] = lambda obj: obj,
        measuring: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
        every_rank_measures: bool = False,
    ) -> None:
        """Checkpoint ``model`` in place: re-apply :attr:`runs` if known, else plan (rank zero) and agree.

        A compiled ``model`` (``fit(torch.compile(module))``) with a budget is measured compiled, and
        :attr:`compile_setting` is compile's ``activation_memory_budget`` chosen with the runs: the caller holds it
        for the training (:meth:`hold_compile_setting`).

        Args:
            model: the module to change.
            example_input: a real batch on the model's device, for a budget.
            is_rank_zero: whether this process plans for all.
            broadcast: hands rank zero's object to every rank (``strategy.broadcast``).
            measuring: the context to measure in (the Trainer's precision).
            every_rank_measures: every rank runs the measurement, as a sharded model's forward and backward hold
                collectives that need every rank; each takes rank zero's figures, so all reach rank zero's plan.
        """
        if self.runs is not None:
            self._apply_runs(model, self.runs, self.split_graphs)
            return
        settings = self.settings
        if settings.memory_budget is None:  # the same on every rank: nothing to agree on
            self.plan = checkpoint_blocks(
                model,
                settings.units,
                bn_correct=settings.bn_correct,
                rebuild_bn_relu=settings.rebuild_bn_relu,
                rebuild_config=settings.rebuild_config,
            )
            self.runs, self.split_graphs = self.plan.runs, bool(self.plan.graph_splits)
            return
        if example_input is None:
            raise ValueError(
                "a `memory_budget` is measured on a real batch: give the module an `example_input_array`, or a train"
                " loader whose first batch holds the model's inputs"
            )
        runs, setting, split = None, None, False
        measures = is_rank_zero or every_rank_measures
        if measures:
            # a sharded forward holds collectives: every rank measures, each taking rank zero's figures, so all run
            # the same passes and reach rank zero's plan
            agreed = measured_alike(broadcast) if every_rank_measures else contextlib.nullcontext()
            with measuring(), agreed:
                self.plan = checkpoint_blocks(
                    model,
                    settings.units,
                    settings.memory_budget,
                    example_input=example_input,
                    bn_correct=settings.bn_correct,
                    rebuild_bn_relu=settings.rebuild_bn_relu,
                    rebuild_config=settings.rebuild_config,
                )
            runs = self.plan.runs
            setting = self.plan.activation_memory_budget
            split = bool(self.plan.graph_splits)
        runs, setting, split = broadcast((runs, setting, split))  # rank zero's, on every rank
        if not measures:  # only a rank that measured has applied the plan
            self._apply_runs(model, runs, split)
        self.runs, self.compile_setting, self.split_graphs = runs, setting, split

    def _apply_runs(self, model: nn.Module, runs: list[list[str]], split_graphs: bool) -> None:
        s = self.settings
        apply_plan(model, runs, s.units, s.bn_correct, s.rebuild_bn_relu, s.rebuild_config, split_graphs)

    def hold_compile_setting(self) -> None:
        """Set compile's ``activation_memory_budget`` to :attr:`compile_setting` (nothing if None) until
        :meth:`release_compile_setting`: for the fit, while the model compiles (its first steps, recompiles)."""
        self._compiling.close()
        self._compiling.enter_context(_compiler.activation_memory_budget(self.compile_setting))

    def release_compile_setting(self) -> None:
        self._compiling.close()

    def summary(self) -> str:
        if self.plan is not None:
            return self.plan.summary()
        links = sum(len(run) for run in self.runs or [])
        return f"{links} blocks or parts of blocks in {len(self.runs or [])} runs (rank zero's plan)"


def inputs_from_batch(batch: Any, forward: Callable[..., Any]) -> tuple[Any, str]:
    """The model's inputs in a training batch, where a budget has no ``example_input_array`` to measure on, and
    what they are (for the line that says so). Nothing says in general which part of a batch the model takes; the
    rule, for the batches Lightning's users write:

    - a tensor is the input: ``forward(batch)``;
    - a tuple or list ``(x, y, ...)``: its first element ``x``, read as an ``example_input_array`` is (a tensor:
      ``forward(x)``; a tuple or list: ``forward(*x)``; a dict: as below);
    - a dict: the entries ``forward`` names as parameters, as keywords (a Hugging Face batch's ``input_ids`` and
      ``attention_mask``, without its ``labels`` where ``forward`` takes none); every entry where it takes
      ``**kwargs``.

    The inputs must bind to ``forward``'s signature (every parameter without a default given).

    Raises:
        ValueError: a batch of another kind (a custom object), an empty one, a dict none of whose keys ``forward``
            takes, or inputs that do not bind; the message says which.

    Example:
        >>> def forward(input_ids, attention_mask=None):
        ...     pass
        >>> batch = {"input_ids": torch.zeros(8, 16), "labels": torch.zeros(8)}
        >>> inputs, what = inputs_from_batch(batch, forward)
        >>> sorted(inputs), what
        (['input_ids'], "entries 'input_ids' (keywords of forward)")
        >>> inputs_from_batch((torch.zeros(8, 3), torch.zeros(8)), forward)[1]
        'first element (a tensor of shape [8, 3])'
    """
    inputs: Any
    if torch.is_tensor(batch):
        inputs, what = batch, f"tensor of shape {list(batch.shape)}"
    elif isinstance(batch, Mapping):
        inputs = _taken_by(forward, batch)
        what = f"entries {', '.join(repr(k) for k in inputs)} (keywords of forward)"
    elif isinstance(batch, list | tuple) and batch:
        inputs = batch[0]
        if torch.is_tensor(inputs):
            what = f"first element (a tensor of shape {list(inputs.shape)})"
        elif isinstance(inputs, Mapping):
            inputs = _taken_by(forward, inputs)
            what = f"first element's entries {', '.join(repr(k) for k in inputs)} (keywords of forward)"
        elif isinstance(inputs, list | tuple):
            what = f"first element ({len(inputs)} positional arguments of forward)"
        else:
            raise ValueError(f"its first element is a {type(inputs).__name__}, not a tensor, a tuple or a dict")
    else:
        raise ValueError(f"it is {'an empty' if isinstance(batch, list | tuple) else 'a'} {type(batch).__name__}")
    args, kwargs = example_arguments(inputs)
    try:
        inspect.signature(forward).bind(*args, **kwargs)
    except TypeError as err:
        raise ValueError(f"forward does not take its {what}: {err}") from None
    except ValueError:  # no signature to read (a builtin): the measurement tells
        pass
    return inputs, what


def _taken_by(forward: Callable[..., Any], batch: Mapping[Any, Any]) -> dict[str, Any]:
    """The entries of ``batch`` that ``forward`` takes as keywords (every one where it takes ``**kwargs``)."""
    try:
        parameters = inspect.signature(forward).parameters
    except ValueError:
        parameters = {}  # type: ignore[assignment]
    keywords = {inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        taken = {str(k): v for k, v in batch.items()}
    else:
        taken = {k: v for k, v in batch.items() if k in parameters and parameters[k].kind in keywords}
    if not taken:
        raise ValueError(f"forward takes none of its keys {sorted(map(str, batch))}")
    return taken
