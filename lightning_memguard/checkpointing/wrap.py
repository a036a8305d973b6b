"""Activation checkpointing of whole blocks and runs of blocks, with BatchNorm statistics updated once per step: the
mixins that do it and the swapped classes they make. Which modules are a model's blocks, :mod:`.families` says;
changing a model is :mod:`.surgery`'s alone."""

from __future__ import annotations

import contextlib
import inspect
import types
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_memguard import _autograd, _compiler

_STATS = ("running_mean", "running_var", "num_batches_tracked")


def tracked_batchnorms(units: Sequence[nn.Module]) -> list[nn.modules.batchnorm._BatchNorm]:
    """The BatchNorm layers in ``units`` that keep running statistics: what a recomputation must not update twice.

    Asked at every checkpointed forward, so it walks the modules' children directly (``nn.Module.modules()`` makes a
    name for every module, which a block with dozens of layers pays for on every step)."""
    found: list[nn.modules.batchnorm._BatchNorm] = []
    seen: set[int] = set()
    stack = list(reversed(units))
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.track_running_stats:
            found.append(module)
        stack.extend(reversed([m for m in module._modules.values() if m is not None]))
    return found


class FrozenBatchNormStats:
    """A context manager for a checkpoint's recomputation: inside it, BatchNorm updates throw-away copies of its
    running statistics, not the real ones, so a recomputed block moves them once per step, as the plain model does.
    It is the recomputation's context (the second of ``context_fn``'s pair) of whole blocks
    (:class:`CheckpointedUnit`) and of the pointwise lever (:func:`~lightning_memguard.levers.recompute_pointwise`).

    Training-mode BatchNorm normalises with the batch's own statistics, so the recomputed output is the same; the
    ops and saved tensors are the same too, which the non-reentrant checkpoint checks. The copies are put in and
    taken out of each layer's ``_buffers`` directly: the same as assigning the buffer (``nn.Module.__setattr__``
    would look for it among parameters and submodules first, a cost paid per layer per recomputed block).

    Args:
        batchnorms: the layers whose running statistics are kept (:func:`tracked_batchnorms` of the block).

    Example:
        >>> bn = torch.nn.BatchNorm1d(4)
        >>> with FrozenBatchNormStats([bn]):
        ...     _ = bn(torch.randn(8, 4))  # a recomputation
        >>> int(bn.num_batches_tracked), bool(bn.running_mean.eq(0).all())
        (0, True)
    """

    def __init__(self, batchnorms: Sequence[nn.modules.batchnorm._BatchNorm]) -> None:
        self._bns = batchnorms
        self._real: list[list[torch.Tensor | None]] = []

    def __enter__(self) -> None:
        self._real = []
        for bn in self._bns:
            buffers = bn._buffers
            real = [buffers.get(name) for name in _STATS]
            self._real.append(real)
            for name, buf in zip(_STATS, real, strict=True):
                if buf is not None:
                    buffers[name] = buf.clone()

    def __exit__(self, *exc: object) -> None:
        for bn, real in zip(self._bns, self._real, strict=True):
            buffers = bn._buffers
            for name, buf in zip(_STATS, real, strict=True):
                if buf is not None:
                    buffers[name] = buf
        self._real = []


class SwappedModule(nn.Module):
    """Base of every mixin that :func:`swapped_class` puts in front of a module's class.

    A swapped class is made at run time, so another process (``torch.load``, ``ddp_spawn``, Windows' spawn) cannot
    find it by name. A swapped module pickles as its mixins and its original class, both importable, and unpickling
    makes the same swapped class again.
    """

    def __reduce_ex__(self, protocol: Any) -> Any:
        reduced = super().__reduce_ex__(protocol)
        if not isinstance(reduced, tuple) or len(reduced) < 3:  # pragma: no cover - protocols 0 and 1
            return reduced
        mixins, original = swap_chain(type(self))
        return (_new_swapped, (mixins, original), *reduced[2:])

    memguard_unit = True
    """A module with this mixin counts as one changed unit (a checkpoint, a rebuilt block or stem)."""


def swap_chain(cls: type[nn.Module]) -> tuple[tuple[type[nn.Module], ...], type[nn.Module]]:
    """The mixins in front of ``cls``, innermost first, and the class they were put in front of."""
    mixins: list[type[nn.Module]] = []
    while "_memguard_mixin" in cls.__dict__:
        mixins.append(cls._memguard_mixin)  # type: ignore[attr-defined]
        cls = cls._memguard_original  # type: ignore[attr-defined]
    return tuple(reversed(mixins)), cls


def _new_swapped(mixins: tuple[type, ...], original: type) -> nn.Module:
    cls = original
    for mixin in mixins:
        cls = swapped_class(cls, mixin)
    return cls.__new__(cls)  # type: ignore[no-any-return, call-overload]


class RunOutput:
    """The last output of a checkpointed run's head (a weak reference), shared by the run's modules: a member called
    on it hands it on. Not state: copies and pickles start empty."""

    __slots__ = ("ref",)

    def __init__(self) -> None:
        self.ref: weakref.ref[torch.Tensor] | None = None

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return (RunOutput, ())

    def holds(self, x: Any) -> bool:
        return self.ref is not None and x is self.ref()


_PLAIN = (int, float, bool, str)


def recomputable(
    forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """What to hand ``torch.utils.checkpoint``: a function and its positional arguments, so that recomputation sees
    the inputs the forward saw. Used by every checkpoint this library makes of a block's forward: whole blocks'
    (:class:`CheckpointedUnit`) and the pointwise lever's (:func:`~lightning_memguard.levers.recompute_pointwise`).

    The checkpoint recomputes by calling the function again with the arguments it was given, and checks only the
    tensors among them that are arguments themselves (their version: an input changed in place since is an error).
    A tensor inside a list, tuple, dict, named tuple or ``OrderedDict`` (HRNet's branches, DenseNet's features, a
    Hugging Face layer's ``position_embeddings``), or passed by keyword, is neither checked nor safe: the block or
    the code after it may change the container (DenseNet appends to the list it passed; HRNet's stages replace its
    items) or the tensor, and the recomputation would run on other inputs: wrong gradients, with no error. So every
    tensor, wherever it sits in a container PyTorch's pytree knows (those, and any type registered with it, such as
    Hugging Face's ``ModelOutput``), is passed as an argument of its own; the first call runs on the caller's own
    containers (a block that changes them does so as it would without checkpointing), a recomputation on new
    containers built around the same tensors, as they were when the block first ran. Any other object is passed as
    it is. A block with tensor arguments only (most) passes as it is.

    Example:
        >>> x, y = torch.ones(2), torch.zeros(2)
        >>> function, leaves = recomputable(lambda pair, scale: pair[0] * scale + pair[1], ([x, y],), {"scale": 2.0})
        >>> len(leaves), function(*leaves).tolist()  # the two tensors, each an argument; the first call as given
        (2, [2.0, 2.0])
        >>> function(torch.full((2,), 3.0), y).tolist()  # a recomputation: new containers around the given tensors
        [6.0, 6.0]
    """
    if not kwargs and all(isinstance(a, torch.Tensor) or a is None or type(a) in _PLAIN for a in args):
        return forward, args
    leaves, spec = _autograd.flatten((args, kwargs))
    # a tensor given twice is handed over once, and given twice again: recomputation gets new tensor objects, and
    # a module may take another path where two arguments are one (``nn.MultiheadAttention(x, x, x)``)
    where: dict[int, int] = {}
    unique: list[torch.Tensor] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and id(leaf) not in where:
            where[id(leaf)] = len(unique)
            unique.append(leaf)
    slots = [where.get(id(leaf)) if isinstance(leaf, torch.Tensor) else None for leaf in leaves]
    first = [True]

    def function(*given: Any) -> Any:
        if first[0]:
            first[0] = False
            return forward(*args, **kwargs)
        again = [leaf if slot is None else given[slot] for leaf, slot in zip(leaves, slots, strict=True)]
        again_args, again_kwargs = _autograd.unflatten(again, spec)
        return forward(*again_args, **again_kwargs)

    return function, tuple(unique)


@contextlib.contextmanager
def weight_casts_uncached() -> Iterator[None]:
    """Autocast's cache of weight casts off while a checkpointed forward runs (``torch.set_autocast_cache_enabled``,
    as ``torch.autocast(cache_enabled=False)`` sets it; a region that enters autocast inside inherits it).

    Autocast keeps the low-precision copy of every weight it casts until the outermost autocast region ends: in a
    Lightning step, the whole forward. A plain block's backward keeps those copies anyway (its matrix products saved
    them); inside a checkpoint nothing else does, so the cache alone would hold every checkpointed block's weights in
    bf16 to the end of the forward, where a fused loss makes its gradients (BERT-base: 170 MB). Off, a block's copies
    go when its forward ends, and its recomputation casts them again, as it does anyway (the forward's cache is gone
    by then). The casts are the same: the gradients are unchanged, bit for bit."""
    cached = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(cached)


class CheckpointedUnit(SwappedModule):
    """Mixin placed in front of a block's own class: its forward runs under ``torch.utils.checkpoint``.

    The block keeps its attributes and parameter names, so ``state_dict`` keys do not change. At the head of a run
    it also runs the run's other modules (``memguard_run``), inside the same checkpoint, and records its output in
    the :class:`RunOutput` the run shares (``memguard_output``).
    """

    memguard_prefix = "Checkpointed"
    memguard_bn_correct: bool = True

    def _memguard_forward(self, *args: Any, **kwargs: Any) -> Any:
        out = super().forward(*args, **kwargs)
        for member in self.__dict__.get("memguard_run", ()):
            out = type(member)._memguard_original.forward(member, out)
        return out

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        run = self.__dict__.get("memguard_run", ())
        if not torch.is_grad_enabled():
            return self._finish(self._memguard_forward(*args, **kwargs), run)
        if _compiler.compiling():
            # compiled, the checkpoint is a graph the compiler traces and its backward replays (not this Python
            # code), without applying buffer updates again; it takes no context_fn. The gradient into the block is
            # one buffer, as in eager mode (gradient_realized)
            if args:
                args = (_compiler.gradient_realized(args[0]), *args[1:])
            return self._finish(checkpoint(self._memguard_forward, *args, use_reentrant=False, **kwargs), run)
        function, leaves = recomputable(self._memguard_forward, args, kwargs)
        given = [(t, _autograd.version(t)) for t in leaves if isinstance(t, torch.Tensor) and not t.is_inference()]
        # only where a BatchNorm keeps running statistics: a model without one (ConvNeXt, a transformer) is
        # checkpointed with the call its family's own switch makes, and pays nothing for BatchNorm-correctness
        with weight_casts_uncached():
            if bns := tracked_batchnorms([self, *run]) if self.memguard_bn_correct else []:
                frozen = lambda: (contextlib.nullcontext(), FrozenBatchNormStats(bns))  # noqa: E731
                out = checkpoint(function, *leaves, use_reentrant=False, context_fn=frozen)
            else:
                out = checkpoint(function, *leaves, use_reentrant=False)
        if any(_autograd.version(t) != v for t, v in given):
            raise RuntimeError(self._changes_its_input())
        return self._finish(out, run)

    def _changes_its_input(self) -> str:
        """Why a block that changed a tensor it was given, in place, cannot be checkpointed, and what to do."""
        name = self.__dict__.get("memguard_name", "")
        block = f"{name!r} ({swap_chain(type(self))[1].__name__})" if name else swap_chain(type(self))[1].__name__
        return (
            f"the checkpointed block {block} changes its input in place in its forward (an in-place operation on a"
            " tensor it is given: nn.ReLU(inplace=True) first, `x += ...`, `x.mul_(...)`). Its checkpoint recomputes"
            " the block in backward from that input, which it would find changed (autograd's 'modified by an"
            " inplace operation', or wrong gradients). Fix: make the block's first operation on its input out of"
            " place (nn.ReLU(), `x = x + ...`), or leave the block unchecked (`units` naming the other blocks)"
        )

    def _finish(self, out: Any, run: Sequence[nn.Module]) -> Any:
        if run:
            if not isinstance(out, torch.Tensor):
                raise TypeError(
                    f"a checkpointed run starting at {type(self).__name__} must pass one tensor from block to block,"
                    f" got {type(out).__name__}; checkpoint these blocks one by one"
                )
            self.__dict__["memguard_output"].ref = weakref.ref(out)
        return out


class CheckpointedMember(SwappedModule):
    """Mixin for a module inside a run. Called by its parent right after the run's head, on the head's output, it
    hands that output on: the head already did its work. Called on anything else (on its own, say), it runs as
    usual. Forward hooks on a run's inner modules see the run's output."""

    memguard_prefix = "RunMember"
    memguard_unit = False  # part of its head's checkpoint

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        output = self.__dict__.get("memguard_output")
        if output is not None and output.holds(x) and not args and not kwargs:
            return x
        return super().forward(x, *args, **kwargs)


class GraphSplit(SwappedModule):
    """Mixin for a container of checkpointed blocks (a ResNet stage): under ``torch.compile`` it is a compiled
    graph of its own (``memguard_split`` names it), so its blocks' backward runs apart from the rest of the model's.
    In one compiled backward of a whole ResNet, Inductor holds several blocks' buffers at once; ResNet50 with every
    block checkpointed, trained on the H200 with each block's input gradient realized: 4.78 GB as one graph, 4.08
    GB split by stage, at the same throughput (eager mode: 3.84 GB). In eager mode it changes nothing: the forward
    is the container's own, one call further down."""

    memguard_prefix = "GraphSplit"
    memguard_unit = False  # it checkpoints nothing itself

    @_compiler.not_traced  # a graph break where compiled code calls it; the function it calls compiles apart
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # one function per module, not per name: two models in one process (a teacher and a student) share names
        part = f"{self.__dict__['memguard_split']}_{id(self):x}"
        return _compiler.graph_apart(part)(super().forward, *args, **kwargs)


class TrainingKeywords(SwappedModule):
    """Mixin for a module whose forward must get some keyword arguments while it trains with blocks inside it
    checkpointed (a Hugging Face model: ``use_cache=False``, as its own switch sets it; its family's adapter says
    which, :meth:`.families.Family.while_checkpointed`). ``memguard_keywords`` holds ``(name, position, value)`` for
    each, ``position`` being the argument's index among the forward's positional parameters (None: keyword only), so
    an argument given by position is replaced there. In evaluation, or without gradients, calls are as given;
    nothing else (a configuration) is changed. The swapped class keeps its class's name (Hugging Face writes it into
    a saved configuration)."""

    memguard_prefix = ""
    memguard_unit = False  # it checkpoints nothing itself

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.training and torch.is_grad_enabled():
            for name, position, value in self.__dict__["memguard_keywords"]:
                if position is not None and position < len(args):
                    args = (*args[:position], value, *args[position + 1 :])
                else:
                    kwargs[name] = value
        return super().forward(*args, **kwargs)


def keyword_positions(module: nn.Module, keywords: dict[str, Any]) -> tuple[tuple[str, int | None, Any], ...]:
    """``keywords`` as :class:`TrainingKeywords` carries them: each name with its index among the positional
    parameters of ``module``'s own forward (None where it has none), and its value."""
    bound = types.MethodType(swap_chain(type(module))[1].forward, module)  # its own forward, without self
    parameters = inspect.signature(bound).parameters.values()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    positional = [p.name for p in parameters if p.kind in kinds]
    return tuple(
        (name, positional.index(name) if name in positional else None, value) for name, value in keywords.items()
    )


_SUBCLASSES: dict[tuple[type, type], type] = {}


def swapped_class(cls: type[nn.Module], mixin: type[nn.Module]) -> type:
    """``cls`` with ``mixin`` in front, made once and named ``<mixin.memguard_prefix><cls name>``; assigning it to a
    module's ``__class__`` (:mod:`.surgery`, :func:`swap_in`) changes its forward and keeps its attributes,
    parameters and ``state_dict`` keys."""
    sub = _SUBCLASSES.get((mixin, cls))
    if sub is None:
        name = f"{mixin.memguard_prefix}{cls.__name__}"  # type: ignore[attr-defined]
        sub = type(name, (mixin, cls), {"__module__": __name__, "__qualname__": name})
        sub._memguard_original = cls  # type: ignore[attr-defined]
        sub._memguard_mixin = mixin  # type: ignore[attr-defined]
        _SUBCLASSES[(mixin, cls)] = sub
    return sub


def swap_in(swaps: Sequence[tuple[nn.Module, type[nn.Module], dict[str, Any]]]) -> None:
    """Give each module its class with the mixin in front (:func:`swapped_class`) and the attributes given, in
    order; where one fails, every module changed so far gets its class back and loses those attributes, and the
    error is raised: all of them changed, or none."""
    changed: list[tuple[nn.Module, type, dict[str, Any]]] = []
    try:
        for module, mixin, attributes in swaps:
            changed.append((module, type(module), attributes))
            module.__class__ = swapped_class(type(module), mixin)
            module.__dict__.update(attributes)
    except BaseException:
        for module, cls, attributes in reversed(changed):
            module.__class__ = cls
            for name in attributes:
                module.__dict__.pop(name, None)
        raise


def plain_sequential(module: nn.Module) -> bool:
    """``module`` runs its children one after another: an ``nn.Sequential`` whose class (under any of this library's
    mixins, such as :class:`GraphSplit`) keeps ``nn.Sequential.forward``."""
    return isinstance(module, nn.Sequential) and swap_chain(type(module))[1].forward is nn.Sequential.forward


def is_checkpointed(module: nn.Module) -> bool:
    """Whether ``module`` runs under one of this library's checkpoints (a run's head or member)."""
    return isinstance(module, CheckpointedUnit | CheckpointedMember)


@dataclass(frozen=True, eq=False)
class Link:
    """One link of a model's forward chain: a block, or modules called one after another (a ResNet's stem); or a
    finer link, a part of a block (its attention, its MLP)."""

    name: str
    modules: tuple[tuple[str, nn.Module], ...]
    stem: bool = False  # a ResNet's conv1, bn1, relu and maxpool
    part: bool = False  # inside a block: its block is no container of blocks


class Swap(NamedTuple):
    """One change to make to a module: put ``mixin`` in front of its class and give it ``attributes`` (each declared
    in :data:`.surgery.ATTRIBUTES`). Described by :mod:`.rebuild`, made by :mod:`.surgery`."""

    module: nn.Module
    mixin: type[SwappedModule]
    attributes: dict[str, Any]


@contextlib.contextmanager
def preserved_state(model: nn.Module) -> Iterator[None]:
    """Restore buffers (BatchNorm statistics), gradients and the random number generators (of the CPU and of the
    model's CUDA devices: dropout, stochastic depth) after profiling runs, bit for bit."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    grads = {name: (p.grad.detach().clone() if p.grad is not None else None) for name, p in model.named_parameters()}
    cuda = sorted({t.device.index or 0 for t in [*model.parameters(), *model.buffers()] if t.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=cuda):
            yield
    finally:
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])
            for name, p in model.named_parameters():
                p.grad = grads.get(name)
