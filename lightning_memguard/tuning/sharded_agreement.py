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
others reach, and every rank raises there, in the same step; under FSDP2 a backward always has one ahead, the end of
backward. What no point covers: an out-of-memory error inside FSDP's own code (the buffer of a gather or a reduction
the other ranks may already have entered), and a backward under FSDP1, whose gradients are reduced from inside
backward without a hook to order against: there the failing rank ends the run with an error that names the trial
(:class:`OutOfMemoryEndsRun`) instead of waiting. An agreed error ends the run too under FSDP1 and before torch 2.14,
which have no public way to reset FSDP's half-done step. Collectives of the user's own inside the step (a
``sync_dist`` log, an all-gather, tensor parallelism's) have no points around them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
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
        ctx.points.meet()
        return (None, *grads)


_FSDP_OWN_CODE = ("/torch/distributed/fsdp/_fully_shard/", "/torch/distributed/fsdp/_runtime_utils.py",
                  "/torch/distributed/fsdp/_flat_param.py", "/torch/distributed/distributed_c10d.py")  # fmt: skip


def raised_inside_fsdp(err: BaseException) -> bool:
    """Whether ``err`` came from FSDP's own code (gathering, resharding, reducing) or a collective: the other ranks
    may already be inside that collective, where no agreement point reaches them."""
    tb = err.__traceback__
    while tb is not None:
        if any(part in tb.tb_frame.f_code.co_filename.replace("\\", "/") for part in _FSDP_OWN_CODE):
            return True
        tb = tb.tb_next
    return False


class UnitPoints:
    """The agreement points of one trial step; ``agree(failed)`` is True when any rank failed."""

    def __init__(self, units: list[nn.Module], agree: Callable[[bool], bool]) -> None:
        self.units, self.agree = units, agree
        self.fsdp1 = any(not isinstance(unit, FSDPModule) for unit in units)
        self._end_queued = False

    def meet(self) -> None:
        if self.agree(False):
            raise AgreedOutOfMemory("out of memory on another rank inside a trial")

    def failed_here(self, err: BaseException, in_backward: bool) -> bool:
        """This rank failed with ``err``: True once said at the point the other ranks reach next; False where they
        cannot learn it (inside FSDP's own code or a collective; a backward under FSDP1, which reduces gradients
        from inside backward), and the failure must end the run. In a backward under FSDP2 a point always lies
        ahead: the end of backward, queued ahead of FSDP's own reduction there."""
        if raised_inside_fsdp(err) or (in_backward and self.fsdp1):
            return False
        self.agree(True)
        return True

    def new_step(self) -> None:
        self._end_queued = False

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        self.meet()

    def _around_backward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # a forward run again inside backward (a checkpoint around the unit recomputing) sets no points: backward
        # does not run through the recomputed graph
        if not torch.is_grad_enabled() or not isinstance(module, FSDPModule) or in_backward():
            return None
        found = _needing_grad((args, kwargs))
        if not found:
            return None
        met = iter(_MeetInBackward.apply(self, *found))
        return _needing_grad((args, kwargs), lambda tensor: next(met))

    def _on_output(self, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled() or not isinstance(module, FSDPModule) or in_backward():
            return
        tensors = _needing_grad(output)
        met = [False]  # once per call, whichever output's gradient comes first

        def on_gradient(grad: torch.Tensor) -> None:
            if met[0]:
                return
            met[0] = True
            if not self._end_queued:  # the first unit's hook of this backward, ahead of FSDP's own, which queues
                self._end_queued = True  # its end of backward in the hook after this one
                at_backward_end(self.meet)
            self.meet()

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
                    "every rank learnt it, but nothing public puts FSDP's per-step state back after a step that"
                    " failed halfway here (`FSDPModule.reset_iter_state`: FSDP2, torch 2.14 and later)"
                ) from err
            raise
        finally:
            for handle in handles:
                handle.remove()

    def _recover(self) -> bool:
        """The step ended between FSDP2's gathers and reshards: every unit back to its own shard and FSDP's
        per-step state cleared, as the trials' restore and the next step expect, through the call torch 2.14 has
        for it (``reset_iter_state``, on every root unit: one without a sharded unit around it). Before it nothing
        public does (stream waits skipped, a gradient reduction never queued): the units are resharded for the
        restore, and False: the search cannot go on. Nor can it under FSDP1 (``FSDPStrategy``), which has no
        public reset at all."""
        if self.fsdp1:
            return False
        inner = {id(m) for unit in self.units for m in unit.modules() if m is not unit}
        roots = [unit for unit in self.units if id(unit) not in inner]
        if all(hasattr(root, "reset_iter_state") for root in roots):
            for root in roots:
                root.reset_iter_state()  # type: ignore[operator]
            return True
        # every unit back to its shard all the same, so that the trials' restore puts the run back before it ends
        for root in roots:
            root.set_reshard_after_forward(True, recurse=False)  # type: ignore[operator]  # a root stays gathered
        for unit in self.units:
            unit.reshard()  # type: ignore[operator]
        return False


def _needing_grad(tree: Any, change: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Any:
    """The tensors of ``tree`` (a module's arguments or output: tuples, lists, dicts, dataclasses) that require a
    gradient, in a fixed order; with ``change``, ``tree`` with ``change`` applied to each of them instead."""
    found: list[torch.Tensor] = []

    def visit(tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.requires_grad:
            return tensor
        found.append(tensor)
        return change(tensor) if change is not None else tensor

    changed = apply_to_collection(tree, torch.Tensor, visit)
    return changed if change is not None else found
