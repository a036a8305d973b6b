"""Cheap recomputation inside a block: its matrix products stay saved, the pointwise work between them is recomputed.

A block's forward under :func:`recompute_pointwise` runs in PyTorch's own selective activation checkpoint
(``torch.utils.checkpoint.checkpoint(..., use_reentrant=False, context_fn=...)`` with
``create_selective_checkpoint_contexts``) and :func:`pointwise_policy` says, op by op, what is kept: the outputs of
matrix products, convolutions and attention (:data:`SAVED_OPS`) and of collectives are saved; everything else (norms,
activations, SwiGLU's gate, residual adds, dropout, copies and casts) is recomputed from them in backward. No matrix
product runs twice, so backward pays a few pointwise kernels per block instead of a whole forward; what it frees is
what those kernels saved (a LayerNorm's output, GELU's input and output, the residual stream between attention and
MLP) less the matrix products' outputs that a plain step would not have kept.

Three things are kept exact, so the gradients are the plain block's, bit for bit:

- **BatchNorm's running statistics** are updated once: a recomputed BatchNorm (training mode) updates throw-away
  copies of them (:class:`~lightning_memguard.checkpointing.wrap.FrozenBatchNormStats`, as whole-block
  checkpointing does), and normalises with the batch's own statistics, so its output is the same.
- **Randomness** (dropout, stochastic depth) is replayed: the checkpoint restores the random number generators
  before recomputing, and every op that draws from them is recomputed, in order. An attention that draws from them
  itself (``dropout_p > 0``) is recomputed too, or the draws after it would shift: the one matrix product recomputed,
  and only while attention dropout is on.
- **Ops that would not run the same twice** (collectives) are saved.

Measured, per link, by :func:`measure_pointwise` (the bytes it frees, by the ledger of saved tensors; the
milliseconds its recomputation adds, by an injectable clock): what the levers' planner
(:func:`~.plan_levers.plan_levers`) weighs it by. What a block's selective checkpoint keeps for backward, no
saved-tensor hook sees: each block hands it to the ledger's counts open around it
(:func:`~lightning_memguard._ledger.kept_unseen`), so the planner's measurement, the memory report and the spill
emulator count it as they count the rest.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_memguard import _autograd, _compiler, _ledger
from lightning_memguard._ledger import Ledger
from lightning_memguard.checkpointing.measure import default_loss, example_arguments, tensors
from lightning_memguard.checkpointing.wrap import (
    FrozenBatchNormStats,
    Link,
    SwappedModule,
    is_checkpointed,
    preserved_state,
    recomputable,
    swap_chain,
    swap_in,
    swapped_class,
    tracked_batchnorms,
    weight_casts_uncached,
)

SAVED_OPS: tuple[str, ...] = (
    # matrix products
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "addbmm",
    "mv",
    "addmv",
    "dot",
    "vdot",
    "_addmm_activation",
    "_scaled_mm",
    "_int_mm",
    # convolutions
    "convolution",
    "_convolution",
    "convolution_overrideable",
    "cudnn_convolution",
    "cudnn_convolution_transpose",
    "mkldnn_convolution",
    "miopen_convolution",
    "miopen_depthwise_convolution",
    "_conv_depthwise2d",
    "conv_depthwise3d",
    "slow_conv2d_forward",
    "slow_conv3d_forward",
    "slow_conv_transpose2d",
    "slow_conv_transpose3d",
    "slow_conv_dilated2d",
    "slow_conv_dilated3d",
    # attention
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
    "_flash_attention_forward",
    "_efficient_attention_forward",
    # not pointwise, not cheap: transforms, sorts
    "_fft_r2c",
    "_fft_c2r",
    "_fft_c2c",
    "sort",
    "topk",
)
"""The ops (``torch.ops.aten``) whose outputs :func:`pointwise_policy` saves: the matrix products, convolutions and
attention of a block, and the few other ops that cost like them; every other op is recomputed. Names this torch
does not have are skipped."""

KEPT_CHANGED = "changes in place a product it keeps"
"""What :class:`PointwiseRecomputed` says, at the end of its forward, of a block that changed in place an output its
selective checkpoint keeps (which backward would refuse)."""

_KEPT_CHECKED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
"""The blocks whose kept products were found unchanged at the end of a training forward: checked again only while
measured, not on every step."""

_HOOKS_CHOICE: dict[str, Any] = (
    {"respect_saved_tensors_hooks": False}
    if "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters
    else {}
)
"""Where torch asks (2.14 and later), a saved-tensor hook around the block (``save_on_cpu``) does not see what the
selective checkpoint saves, as before torch asked; said explicitly, so torch does not warn at every call."""

_SAVED = frozenset(op for name in SAVED_OPS if (op := getattr(torch.ops.aten, name, None)) is not None)
_COLLECTIVES = ("_c10d_functional", "c10d", "c10d_functional", "_dtensor")


def _dropout_p(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
    """The ``dropout_p`` an attention op was called with (0 where it takes none)."""
    for i, argument in enumerate(func._schema.arguments):
        if argument.name == "dropout_p":
            value = args[i] if i < len(args) else kwargs.get("dropout_p", argument.default_value)
            return float(value or 0.0)
    return 0.0


def pointwise_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Which outputs a selective checkpoint keeps: matrix products, convolutions and attention (:data:`SAVED_OPS`)
    and collectives are saved (``MUST_SAVE``); every other op (norms, activations, gates, adds, dropout, views,
    copies, casts) is recomputed in backward (``PREFER_RECOMPUTE``). An attention op with ``dropout_p > 0`` is
    recomputed: it draws from the random number generator, which the checkpoint replays in order.

    For a checkpoint of your own (``use_reentrant=False``); in a block with BatchNorm in training mode, use
    :func:`recompute_pointwise`, which recomputes it on throw-away running statistics.

    Example:
        >>> import functools
        >>> from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts
        >>> mlp = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> contexts = functools.partial(create_selective_checkpoint_contexts, pointwise_policy)
        >>> checkpoint(mlp, x, use_reentrant=False, context_fn=contexts).sum().backward()
        >>> pointwise_policy(None, torch.ops.aten.addmm.default), pointwise_policy(None, torch.ops.aten.gelu.default)
        (<CheckpointPolicy.MUST_SAVE: 0>, <CheckpointPolicy.PREFER_RECOMPUTE: 3>)
    """
    packet = getattr(func, "overloadpacket", None)
    if packet in _SAVED:
        if _dropout_p(func, args, kwargs) > 0:
            return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE
    if getattr(func, "namespace", None) in _COLLECTIVES:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


@dataclass
class _Watch:
    """What a measurement reads from the blocks it watches: each recomputation's start and end (``clock``)."""

    clock: Callable[[], float]
    recompute_s: dict[str, float]


_watching: ContextVar[_Watch | None] = ContextVar("memguard_pointwise_watch", default=None)


class _Recompute:
    """The recomputation's context: the selective checkpoint's, BatchNorm's running statistics swapped for copies
    (where the block has tracked ones), and the time it took (where a measurement watches)."""

    def __init__(self, cached: Any, batchnorms: Sequence[nn.modules.batchnorm._BatchNorm], name: str) -> None:
        self._cached, self._frozen, self._name = cached, FrozenBatchNormStats(batchnorms), name
        self._watch = _watching.get()
        self._stack = contextlib.ExitStack()
        self._start = 0.0

    def __enter__(self) -> None:
        if self._watch is not None:
            self._start = self._watch.clock()
        self._stack.enter_context(self._frozen)
        self._stack.enter_context(self._cached)

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
        if self._watch is not None:
            spent = self._watch.clock() - self._start
            self._watch.recompute_s[self._name] = self._watch.recompute_s.get(self._name, 0.0) + spent


def _contexts(block: nn.Module, name: str, made: list[Any]) -> Callable[[], tuple[Any, Any]]:
    """The checkpoint's ``context_fn``: the selective checkpoint's pair, its recomputation in :class:`_Recompute`;
    each forward mode made is put in ``made`` (a measurement reads what it saved)."""

    def contexts() -> tuple[Any, Any]:
        caching, cached = create_selective_checkpoint_contexts(pointwise_policy)
        made.append(caching)
        return caching, _Recompute(cached, tracked_batchnorms([block]), name)

    return contexts


_CACHES = ("past_key_values", "past_key_value", "layer_past", "cache")
"""A Hugging Face layer's cache arguments: a recomputed layer would write its keys and values into them again."""


_POSITIONS: dict[type[nn.Module], tuple[int, ...]] = {}


def _cache_positions(cls: type[nn.Module]) -> tuple[int, ...]:
    """Where a block's own forward takes a cache argument by position (GPT-2's ``cache``, its second)."""
    if cls in _POSITIONS:
        return _POSITIONS[cls]
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    try:
        parameters = list(inspect.signature(cls.forward).parameters.values())[1:]  # without self
    except (TypeError, ValueError):  # pragma: no cover - a forward without a signature
        return ()
    positional = [p.name for p in parameters if p.kind in kinds]
    _POSITIONS[cls] = tuple(i for i, name in enumerate(positional) if name in _CACHES)
    return _POSITIONS[cls]


def _without_cache(
    cls: type[nn.Module], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A layer's arguments with no cache (``use_cache=False``, every cache argument None, by name or by position),
    as Hugging Face's own checkpointing of a layer calls it; what has none is given as it is."""
    positions = [i for i in _cache_positions(cls) if i < len(args) and args[i] is not None]
    if positions:
        args = tuple(None if i in positions else a for i, a in enumerate(args))
    if any(kwargs.get(name) is not None for name in _CACHES) or kwargs.get("use_cache"):
        kwargs = {name: None if name in _CACHES else value for name, value in kwargs.items()}
        if "use_cache" in kwargs:
            kwargs["use_cache"] = False
    return args, kwargs


class PointwiseRecomputed(SwappedModule):
    """Put in front of a block's class by :func:`recompute_pointwise`: its forward runs in a selective checkpoint
    that saves its matrix products and recomputes the rest (:func:`pointwise_policy`). Without gradients, it runs as
    its class does. With them, in eager mode, a Hugging Face layer is called without its cache (``use_cache=False``,
    its cache arguments None), as the family's own checkpointing calls it. The block keeps its attributes, parameters
    and ``state_dict`` keys; it pickles as its class with this mixin."""

    memguard_prefix = "PointwiseRecomputed"
    memguard_unit = False  # not one of checkpointing's units

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return super().forward(*args, **kwargs)
        if _compiler.compiling():
            # compiled, the policy marks the traced graph's nodes and the partitioner saves and recomputes as they
            # say; the compiled backward replays no Python (a cache is not written again) and does not apply
            # BatchNorm's buffer updates again (whole blocks: the same)
            contexts = functools.partial(create_selective_checkpoint_contexts, pointwise_policy)
            return checkpoint(super().forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)
        args, kwargs = _without_cache(swap_chain(type(self))[1], args, kwargs)
        name = self.__dict__.get("memguard_pointwise_name", "")
        # every tensor an argument of its own, so recomputation sees the inputs the forward saw (whole blocks: the same)
        function, leaves = recomputable(super().forward, args, kwargs)
        given = [(t, _autograd.version(t)) for t in leaves if isinstance(t, torch.Tensor) and not t.is_inference()]
        made: list[Any] = []
        with weight_casts_uncached():  # the casts are recomputed: the cache alone would keep them
            out = checkpoint(
                function, *leaves, use_reentrant=False, context_fn=_contexts(self, name, made), **_HOOKS_CHOICE
            )
        if _ledger.counting():  # what the selective checkpoint keeps, out of the saved-tensor hooks' sight
            for caching in made:
                _ledger.kept_unseen(_autograd.selectively_saved(caching))
        if _ledger.counting() or self not in _KEPT_CHECKED:
            self._refuse_kept_changed(made)
            _KEPT_CHECKED.add(self)
        if any(_autograd.version(t) != v for t, v in given):
            raise RuntimeError(
                f"{type(self).__name__} changes its input in place in its forward (nn.ReLU(inplace=True) first,"
                " `x += ...`): its recomputation in backward would start from the changed input. Make its first"
                " operation on its input out of place, or leave it out of recompute_pointwise's `units`"
            )
        return out

    def _refuse_kept_changed(self, made: list[Any]) -> None:
        """Said at the end of the forward, not by torch in backward: a backward raising there with saved-tensor hooks
        in force (a measurement's) leaves the step's graph alive, one step's activations lost per block tried. Asked
        while measured and at a block's first training forward (:data:`_KEPT_CHECKED`), not on every step."""
        if any(_autograd.selectively_saved_changed(caching) for caching in made):
            raise RuntimeError(
                f"{type(self).__name__} {KEPT_CHANGED} (an nn.ReLU(inplace=True) or `y *= ...` on a convolution's or"
                " matrix product's output, as timm's squeeze-excite does): the selective checkpoint would refuse it"
                " in backward. Leave the block out of recompute_pointwise's `units`, or make that operation out of"
                " place"
            )


def _blocks(model: nn.Module, units: Any) -> list[tuple[str, nn.Module]]:
    """The blocks ``units`` names in ``model``: None, the model itself; ``"auto"`` or a list of names, the links
    of its map (:mod:`~lightning_memguard.checkpointing.model_map`) that are one module each (a ResNet's stem, four
    modules, is left alone)."""
    if units is None:
        return [("", model)]
    from lightning_memguard.checkpointing.model_map import map_model

    return [link.modules[0] for link in map_model(model, units).links if len(link.modules) == 1 and not link.stem]


def recompute_pointwise(model: nn.Module, units: Any = None) -> nn.Module:
    """Recompute the pointwise work of blocks in backward and keep their matrix products saved.

    Each block's forward runs in a selective checkpoint (:func:`pointwise_policy`): it saves what matrix
    products, convolutions and attention return and recomputes norms, activations, gates and adds from them. The
    gradients are the plain model's, bit for bit (float32 and autocast); BatchNorm's running statistics are
    updated once; dropout draws the same masks. A step's backward can run once per forward (``retain_graph=True``
    is refused by torch's selective checkpoint).

    Args:
        model: a block (``units=None``) or a model; a ``torch.compile`` result is changed in the module it wraps
            (changed before its first call, or Dynamo compiles again).
        units: None: ``model`` itself is the block. ``"auto"``: the blocks of a model of a known family, as
            :func:`~lightning_memguard.checkpointing.checkpoint_blocks` finds them (every layer of a timm ViT, every
            ConvNeXt block, every ResNet bottleneck); a set of module classes, a list of module names or a predicate on
            ``(name, module)``, as there. A ResNet's stem (several modules) is left alone.

    Returns:
        ``model``, changed in place; :func:`remove_pointwise` undoes it.

    Raises:
        ValueError: a block already checkpointed whole (by ``checkpoint_blocks`` or ``ActivationCheckpointing``),
            or ``units`` finding no block (as ``checkpoint_blocks`` says it).

    Example:
        >>> block = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 32), torch.nn.GELU())
        >>> x = torch.randn(4, 8)
        >>> plain = torch.autograd.grad(block(x).sum(), list(block.parameters()))
        >>> recompute_pointwise(block)(x).sum().backward()
        >>> all(torch.equal(p.grad, g) for p, g in zip(block.parameters(), plain))
        True
        >>> remove_pointwise(block)
        1
    """
    blocks = _blocks(_compiler.unwrapped(model), units)  # a torch.compile result: the module it wraps
    if not blocks:
        raise ValueError(f"`units`={units!r} names no block of {type(model).__name__} to recompute pointwise")
    for name, block in blocks:
        if is_checkpointed(block):
            raise ValueError(
                f"block {name or type(block).__name__!r} is already checkpointed whole, which recomputes everything"
                " in it; remove that checkpoint first (remove_checkpointing) or leave this block out of `units`"
            )
    swap_in(
        [
            (block, PointwiseRecomputed, {"memguard_pointwise_name": name})
            for name, block in blocks
            if not isinstance(block, PointwiseRecomputed)
        ]
    )
    return model


def remove_pointwise(model: nn.Module) -> int:
    """Take :func:`recompute_pointwise`'s mixin off ``model`` and every module in it (and its one attribute,
    ``memguard_pointwise_name``); other mixins stay. Returns how many blocks it was taken off."""
    count = 0
    for module in model.modules():
        mixins, original = swap_chain(type(module))
        if not any(issubclass(m, PointwiseRecomputed) for m in mixins):
            continue
        cls = original
        for mixin in mixins:
            if not issubclass(mixin, PointwiseRecomputed):
                cls = swapped_class(cls, mixin)
        module.__class__ = cls
        module.__dict__.pop("memguard_pointwise_name", None)
        count += 1
    return count


@dataclass(frozen=True)
class PointwiseCost:
    """What :func:`recompute_pointwise` does to one link, measured on a real batch.

    Attributes:
        name: the link's name.
        freed_bytes: the bytes of saved tensors the step holds less with this link's pointwise work recomputed (the
            ledger's count of the whole step, before less after; negative where the matrix products' outputs it
            keeps outweigh what it frees). 0 for a link of several modules (a ResNet's stem), which it leaves alone.
        extra_ms: the milliseconds its recomputation adds to backward.
    """

    name: str
    freed_bytes: int
    extra_ms: float


def default_clock() -> float:
    """Seconds, after the GPU's queued work (``torch.cuda.synchronize`` where CUDA is there)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


@contextlib.contextmanager
def _watched(watch: _Watch) -> Iterator[None]:
    token = _watching.set(watch)
    try:
        yield
    finally:
        _watching.reset(token)


def measure_pointwise(
    model: nn.Module,
    example: Any,
    links: Sequence[Link | str] | None = None,
    loss_fn: Callable[[Any], torch.Tensor] = default_loss,
    clock: Callable[[], float] = default_clock,
) -> list[PointwiseCost]:
    """Per link, the bytes :func:`recompute_pointwise` frees and the milliseconds it adds: one plain step, then one
    step with each link's pointwise work recomputed (that link alone), each counted by the ledger of saved tensors
    (:class:`~lightning_memguard._ledger.Ledger`: a storage once, parameters, buffers and the batch never), the
    recomputation timed by ``clock``. The model comes back as it was: its classes, buffers, gradients and random
    number generators.

    Args:
        model: the model (or one block).
        example: its input, as Lightning's ``example_input_array`` is given (a tensor, a tuple, a dict).
        links: the links (:class:`~lightning_memguard.checkpointing.wrap.Link`, as the model's map has them) or
            module names; None: the model itself, one link named ``""``.
        loss_fn: the loss of the model's output.
        clock: seconds, read as a recomputation starts and ends (a test injects one).

    Example:
        >>> mlp = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
        >>> ticks = iter(range(100))
        >>> [cost] = measure_pointwise(mlp, torch.randn(4, 8), clock=lambda: float(next(ticks)))
        >>> cost.freed_bytes, cost.extra_ms  # GELU's output (4 x 32 floats) freed; fc2's output (4 x 8) kept
        (384, 1000.0)
    """
    modules = dict(model.named_modules())
    chosen: list[tuple[str, nn.Module | None]] = []
    for link in [""] if links is None else links:
        if isinstance(link, str):
            if link not in modules:
                raise ValueError(f"the model has no module named {link!r} to measure")
            chosen.append((link, modules[link]))
        else:
            chosen.append((link.name, link.modules[0][1] if len(link.modules) == 1 and not link.stem else None))
    args, kwargs = example_arguments(example)
    existing = [*model.parameters(), *model.buffers(), *tensors(example)]

    def step() -> tuple[int, dict[str, float]]:
        ledger: Ledger[str] = Ledger(existing)

        watch = _Watch(clock, {})

        def count(t: torch.Tensor) -> None:
            ledger.save(t, "")

        def pack(t: torch.Tensor) -> torch.Tensor:
            count(t)
            return _autograd.kept(t)

        with (
            preserved_state(model),
            _watched(watch),
            _ledger.counting_unseen(count),
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        ):
            loss_fn(model(*args, **kwargs)).backward()
        return ledger.on_device, watch.recompute_s

    # measured against the plain step: blocks already recomputing pointwise are plain for it, and again after
    already = [(m, m.__dict__.get("memguard_pointwise_name", "")) for m in model.modules()]
    already = [(m, name) for m, name in already if isinstance(m, PointwiseRecomputed)]
    for m, _ in already:
        remove_pointwise(m)
    try:
        before, _ = step()
        costs = []
        for name, block in chosen:
            if block is None:
                costs.append(PointwiseCost(name, 0, 0.0))
                continue
            recompute_pointwise(block)
            block.__dict__["memguard_pointwise_name"] = name
            try:
                after, spent = step()
            finally:
                remove_pointwise(block)
            costs.append(PointwiseCost(name, before - after, round(spent.get(name, 0.0) * 1e3, 6)))
    finally:
        for m, name in already:
            recompute_pointwise(m)
            m.__dict__["memguard_pointwise_name"] = name
    return costs
