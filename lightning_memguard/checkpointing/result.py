"""What a plan checkpointed and why (:class:`CheckpointPlan`), and how a planner hands one over: a planner asks for
each change to the model it wants measured (:class:`Change`) and returns the plan (:data:`Planner`)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from lightning_memguard import _compiler
from lightning_memguard.checkpointing.budget import BlockProfile
from lightning_memguard.core.units import size_formatter

if TYPE_CHECKING:
    from lightning_memguard.checkpointing.surgery import Applied
    from lightning_memguard.checkpointing.wrap import Link


@dataclass
class CheckpointPlan:
    """What was checkpointed and why. Memory in bytes: the peak of one forward and backward pass on CUDA, the bytes
    of saved activations on the CPU.

    Attributes:
        blocks: the links checkpointed (block names, and ``"stem"`` or ``"<resnet>.stem"`` for a ResNet's stem).
        parts: the finer links checkpointed under a budget: modules inside blocks (a layer's attention or MLP), each
            in a block left unchecked, or inside its checkpointed block (nested: the block's recomputation holds
            less at once).
        runs: the same links grouped as checkpointed: each run is one checkpoint, recomputed as a whole (a part is
            a run of its own).
        candidates: how many links the model has.
        rebuilt: the links (blocks, a ResNet's stem) that rebuild their BatchNorm + ReLU outputs in backward
            (``rebuild_bn_relu=True``).
        graph_splits: the containers of checkpointed blocks (a ResNet's stages) that each begin a graph of their
            own under ``torch.compile`` (see :class:`~.wrap.GraphSplit`); re-apply with ``apply_plan(...,
            split_graphs=bool(plan.graph_splits))``.
        compiled: the budget was measured under ``torch.compile``; then ``activation_memory_budget`` is compile's
            own setting chosen with the blocks (None: compile's default; apply it with :meth:`compiling`), and
            ``compile_candidates`` the combinations measured (setting, blocks, graph splits, peak, step time).
        lower: where a budget was not met, what else would lower the peak below the floor reached (a smaller batch,
            the rebuild, compile's lower settings), as :meth:`summary` says it.
    """

    blocks: list[str]
    candidates: int
    runs: list[list[str]] = field(default_factory=list)
    rebuilt: list[str] = field(default_factory=list)
    parts: list[str] = field(default_factory=list)
    baseline_bytes: int | None = None
    budget_bytes: int | None = None
    predicted_bytes: int | None = None
    measured_bytes: int | None = None
    profiles: list[BlockProfile] = field(default_factory=list)
    graph_splits: list[str] = field(default_factory=list)
    compiled: bool = False
    activation_memory_budget: float | None = None
    compile_candidates: list[dict[str, Any]] = field(default_factory=list)
    lower: list[str] = field(default_factory=list)

    def compiling(self) -> contextlib.AbstractContextManager[None]:
        """Set compile's ``activation_memory_budget`` as this plan chose it (nothing if it kept compile's default):
        wrap the training, or at least its first step and any recompile, in ``with plan.compiling():``."""
        return _compiler.activation_memory_budget(self.activation_memory_budget)

    @property
    def held(self) -> bool | None:
        if self.budget_bytes is None or self.measured_bytes is None:
            return None
        return self.measured_bytes <= self.budget_bytes

    def summary(self) -> str:
        """One line: what was checkpointed and rebuilt, and with a budget its figures (in GB, MB, kB or bytes, by the
        baseline's size); a budget not met says so, with the floor reached and what would go lower.

        Example:
            >>> plan = CheckpointPlan(["a"], 2, [["a"]], baseline_bytes=12_000_000, budget_bytes=4_000_000,
            ...                       measured_bytes=6_500_000, lower=["a smaller batch"])
            >>> print(plan.summary())  # doctest: +NORMALIZE_WHITESPACE
            checkpointed 1 of 2 blocks in 1 run(s); budget 4.0 MB of baseline 12.0 MB, measured 6.5 MB; budget not
            met: the floor reached is 6.5 MB (54 % of baseline) with 1 of 2 blocks checkpointed; lower would take a
            smaller batch
        """
        text = f"checkpointed {len(self.blocks)} of {self.candidates} blocks"
        if self.parts:
            text += f" and {len(self.parts)} part(s) of blocks ({self.parts[0]}, ...)"
        text += f" in {len(self.runs)} run(s)"
        if self.rebuilt:
            text += f", BatchNorm + ReLU rebuilt in {len(self.rebuilt)}"
        if self.compiled:
            setting = self.activation_memory_budget
            text += f", under torch.compile with activation_memory_budget {'default' if setting is None else setting}"
            if self.graph_splits:
                text += f" and a graph per container ({', '.join(self.graph_splits)})"
        if self.budget_bytes is not None:
            size = size_formatter(self.baseline_bytes or self.budget_bytes)
            text += f"; budget {size(self.budget_bytes)} of baseline {size(self.baseline_bytes or 0)}"
            if self.predicted_bytes is not None:
                text += f", predicted {size(self.predicted_bytes)}"
            text += f", measured {size(self.measured_bytes or 0)}"
            if self.held is False:
                text += (
                    f"; budget not met: the floor reached is {size(self.measured_bytes or 0)}"
                    f" ({round(100 * (self.measured_bytes or 0) / max(self.baseline_bytes or 1, 1))} % of baseline)"
                    f" with {len(self.blocks)} of {self.candidates} blocks checkpointed"
                )
                if self.lower:
                    text += f"; lower would take {' or '.join(self.lower)}"
        if unchecked := [p.name for p in self.profiles if not p.recomputable]:
            text += (
                f"; left unchecked: {', '.join(unchecked)} (a checkpoint may not recompute them: each changes its"
                " input in place in its forward, or runs past the module hooks)"
            )
        return text


@dataclass(frozen=True)
class Change:
    """What a planner asks of :func:`.surgery.apply`, in place of the change it asked for before: checkpoint these
    runs of links, rebuild these links, with ``split_graphs`` a compiled graph per container of blocks."""

    runs: Sequence[Sequence[Link]] = ()
    rebuilt: Sequence[Link] = ()
    split_graphs: bool = False


T = TypeVar("T")
Steps = Generator[Change, "Applied", T]
"""A search as a step object in generator form: it yields each :class:`Change` it wants made, is sent what
:func:`.surgery.apply` really changed (and measures the model as it is then), and returns what it found."""
Planner = Steps[CheckpointPlan]
"""A plan's search, which returns the plan, the model left as its last change made it:
:func:`.entrances.checkpoint_blocks` makes every change it asks for, in one place."""


def finished(plan: CheckpointPlan) -> CheckpointPlan:
    if not plan.held:
        warnings.warn(f"memory budget not met; the plan: {plan.summary()}", UserWarning, stacklevel=4)
    return plan


@contextlib.contextmanager
def warnings_once() -> Iterator[None]:
    """Each application of a plan repeats the same warnings: pass each on once, after the block."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for category, message in dict.fromkeys((w.category, str(w.message)) for w in caught):
        warnings.warn(message, category, stacklevel=5)  # past this, contextlib and the planner: the caller's
