"""Where the ranks of a sharded run meet to agree on an out-of-memory error inside a tuner's trial.

FSDP gathers each unit's weights before the unit's forward (and, after resharding, again before its backward) and
reduces its gradients once its backward is done: collectives in the middle of every step. A rank that runs out of
memory between two of them leaves the others inside the next one, so agreeing after the step, as under DDP, would
wait forever. During the trials every FSDP unit gets agreement points between its collectives:

- before its forward gathers the weights (a forward pre-hook ahead of FSDP's own);
- under FSDP2's ``fully_shard``, as its output's gradient arrives, before its backward gathers the weights (a hook on
  the output, ahead of FSDP's own), and once its backward is done, before its gradients are reduced (an identity on
  its inputs, inside FSDP's own); and once the whole backward is done, before FSDP reduces the gradients of the
  units whose inputs need none, the root's (a callback at the end of backward, queued ahead of FSDP's own).

At each point every rank says whether it failed. A rank that fails between two points says so at the next point the
others reach, and every rank raises there, in the same step. What no point covers: a rank that runs out of memory in
FSDP's own buffers for a collective the others have already entered, and a backward under FSDP1, whose gradients are
reduced from inside backward without a hook to order against: there the run ends with an error that names the trial
(:class:`OutOfMemoryEndsRun`) instead of waiting. So does an agreed error under FSDP1 and before torch 2.14, which
have no public way to reset FSDP's half-done step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.utils.hooks import RemovableHandle

from lightning_memguard._autograd import at_backward_end, in_backward


class AgreedOutOfMemory(torch.OutOfMemoryError):
    """Raised on every rank, in the same step, once any rank ran out of memory inside a trial."""


class OutOfMemoryEndsRun(RuntimeError):
    """An out-of-memory error inside a trial that the search cannot go on from: where the other ranks cannot learn it
    (they wait in one of FSDP's collectives), or, before torch 2.14, once FSDP2's step state is left half done."""


def fsdp_units(module: nn.Module) -> list[nn.Module]:
    """The modules FSDP made units of their own (FSDP2's ``fully_shard``, FSDP1's wrappers), outermost first."""
    return [m for m in module.modules() if isinstance(m, FSDPModule | FullyShardedDataParallel)]


class _MeetInBackward(torch.autograd.Function):
    """The identity on a unit's inputs; its backward, run once the unit's own backward is done and before FSDP2
    reduces the unit's gradients, is an agreement point."""

    @staticmethod
    def forward(ctx: Any, points: UnitPoints, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.points = points
        return tuple(t.view_as(t) for t in inputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.points.meet(backward=True)
        return (None, *grads)


class UnitPoints:
    """The agreement points of one trial step; ``agree(failed)`` is True when any rank failed."""

    def __init__(self, units: list[nn.Module], agree: Callable[[bool], bool]) -> None:
        self.units, self.agree = units, agree
        self.backward_points = 0  # points still ahead in this step's backward, counted as its forward set them
        self._met_output: set[int] = set()

    def meet(self, backward: bool = False) -> None:
        if backward:
            self.backward_points -= 1
        if self.agree(False):
            raise AgreedOutOfMemory("out of memory on another rank inside a trial")

    def failed_here(self, in_backward: bool) -> bool:
        """This rank failed: whether the others will reach a point to learn it (True once said there), or the
        failure must end the run."""
        if in_backward and self.backward_points <= 0:
            return False
        self.agree(True)
        return True

    def new_step(self) -> None:
        self.backward_points = 0
        self._met_output.clear()

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        self.meet()

    def _around_backward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # a forward run again inside backward (a checkpoint around the unit recomputing) sets no points: backward
        # does not run through the recomputed graph
        if not torch.is_grad_enabled() or not isinstance(module, FSDPModule) or in_backward():
            return None
        positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
        if not positions:
            return None
        met = _MeetInBackward.apply(self, *(args[i] for i in positions))
        new_args = list(args)
        for i, tensor in zip(positions, met, strict=True):
            new_args[i] = tensor
        self.backward_points += 1
        return tuple(new_args), kwargs

    def _on_output(self, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled() or not isinstance(module, FSDPModule) or in_backward():
            return
        tensors = [t for t in _tensors(output) if t.requires_grad]
        if not tensors:
            return
        key, root = id(module), module is self.units[0]
        self._met_output.discard(key)
        self.backward_points += 2 if root else 1  # the root's: also the end of backward

        def on_gradient(grad: torch.Tensor) -> None:
            if key not in self._met_output:  # once per unit, whichever output's gradient comes first
                self._met_output.add(key)
                if root:  # queued before FSDP's root queues its own end of backward, in the hook after this one
                    at_backward_end(lambda: self.meet(backward=True))
                self.meet(backward=True)

        for tensor in tensors:
            tensor.register_hook(on_gradient)

    @contextmanager
    def installed(self) -> Iterator[UnitPoints]:
        handles: list[RemovableHandle] = []
        try:
            for unit in self.units:
                handles.append(unit.register_forward_pre_hook(self._before_forward, prepend=True))
                handles.append(unit.register_forward_pre_hook(self._around_backward, with_kwargs=True))
                handles.append(unit.register_forward_hook(self._on_output, prepend=True))
            yield self
        except AgreedOutOfMemory as err:
            if not self._recover():
                raise OutOfMemoryEndsRun(
                    "every rank learnt it, but this torch cannot put FSDP2's per-step state back after a step that"
                    " failed halfway (`FSDPModule.reset_iter_state`, torch 2.14 and later)"
                ) from err
            raise
        finally:
            for handle in handles:
                handle.remove()

    def _recover(self) -> bool:
        """The step ended between FSDP2's gathers and reshards: every unit back to its own shard and FSDP's
        per-step state cleared, as the trials' restore and the next step expect, through the call torch 2.14 has
        for it (``reset_iter_state`` on the root unit). Before it nothing public does (a root left gathered, stream
        waits skipped, a gradient reduction never queued): False, and the search cannot go on. FSDP1's units
        (``FSDPStrategy``) are left as they are."""
        sharded = [unit for unit in self.units if isinstance(unit, FSDPModule)]
        if not sharded:
            return False  # FSDP1 has no public reset either: the run ends
        root = sharded[0]  # the outermost unit, which FSDP2 requires
        if hasattr(root, "reset_iter_state"):
            root.reset_iter_state()
            return True
        # every unit back to its shard all the same, so that the trials' restore puts the run back before it ends
        root.set_reshard_after_forward(True, recurse=False)  # the root keeps its weights gathered otherwise
        for unit in sharded:
            unit.reshard()
        return False


def _tensors(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, list | tuple):
        return [t for item in output for t in _tensors(item)]
    if isinstance(output, dict):
        return [t for item in output.values() for t in _tensors(item)]
    return []
