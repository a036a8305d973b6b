"""Measuring a model's links on a real batch and checkpointing the ones that buy the most memory per millisecond.

This module measures and decides (with :class:`~lightning_memguard.core.checkpoint_plan.BudgetSearch`, and under
compile :class:`~lightning_memguard.core.checkpoint_plan.CompileBudgetSearch`); every change
to the model is made by :func:`.surgery.apply`."""

from __future__ import annotations

import contextlib
import statistics
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lightning_memguard import _compiler
from lightning_memguard.checkpointing import families, surgery
from lightning_memguard.checkpointing.rebuild import (
    DEFAULT_CONFIG,
    RebuildConfig,
    check_config,
    rebuildable,
    stem_rebuildable,
)
from lightning_memguard.checkpointing.wrap import (
    Link,
    Units,
    find_units,
    is_checkpointed,
    plain_sequential,
    preserved_state,
)
from lightning_memguard.core.checkpoint_plan import (
    BlockProfile,
    BudgetSearch,
    CompileBudgetSearch,
    best_runs,
    choose_blocks,
    predict_peak,
    value,
)
from lightning_memguard.core.checks import (
    check_bool,
    check_callable,
    check_fractions,
    check_instance,
    check_memory_budget,
)
from lightning_memguard.core.units import size_formatter


@dataclass
class CheckpointPlan:
    """What was checkpointed and why. Memory in bytes: the peak of one forward and backward pass on CUDA, the bytes
    of saved activations on the CPU.

    Attributes:
        blocks: the links checkpointed (block names, and ``"stem"`` or ``"<resnet>.stem"`` for a ResNet's stem).
        runs: the same links grouped as checkpointed: each run is one checkpoint, recomputed as a whole.
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
        text = f"checkpointed {len(self.blocks)} of {self.candidates} blocks in {len(self.runs)} run(s)"
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
        return text


def _default_loss(output: Any) -> torch.Tensor:
    if torch.is_tensor(output):
        return output.float().sum()
    if isinstance(output, dict):
        output = list(output.values())
    return sum(_default_loss(o) for o in output if torch.is_tensor(o) or isinstance(o, list | tuple | dict))  # type: ignore[return-value]


def _tensors(args: Any) -> list[torch.Tensor]:
    if torch.is_tensor(args):
        return [args]
    if isinstance(args, list | tuple):
        return [t for a in args for t in _tensors(a)]
    if isinstance(args, dict):
        return [t for a in args.values() for t in _tensors(a)]
    return []


def example_arguments(example: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The positional and keyword arguments a model takes an example input as, the way Lightning's model summary
    calls ``forward`` on ``example_input_array``: a tuple or list is positional (``forward(*example)``), a dict
    keywords (``forward(**example)``), anything else (a tensor) the one argument (``forward(example)``).

    Example:
        >>> example_arguments({"input_ids": 1, "attention_mask": 0}), example_arguments((1, 2)), example_arguments(3)
        (((), {'input_ids': 1, 'attention_mask': 0}), ((1, 2), {}), ((3,), {}))
    """
    if isinstance(example, list | tuple):
        return tuple(example), {}
    if isinstance(example, Mapping):
        return (), dict(example)
    return (example,), {}


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    if isinstance(t, DTensor):  # a sharded parameter (FSDP2): this rank's shard is what it holds
        t = t.to_local()
    s = t.untyped_storage()
    return (s.data_ptr(), s.nbytes())


_agreed: ContextVar[Callable[[Any], Any]] = ContextVar("memguard_agreed", default=lambda figures: figures)


@contextmanager
def measured_alike(broadcast: Callable[[Any], Any]) -> Iterator[None]:
    """Inside, every figure a measurement takes is ``broadcast``'s (rank zero's), on every rank that measures: each
    takes the same path through the search, and so runs the same forwards and backwards. A sharded model's forward
    holds collectives, so every rank must measure, and none may run a pass another skips."""
    token = _agreed.set(broadcast)
    try:
        yield
    finally:
        _agreed.reset(token)


class _StepMeter:
    """Runs forward and backward once and measures memory (and, optionally, each block)."""

    def __init__(
        self,
        model: nn.Module,
        example: Any,
        loss_fn: Callable[[Any], torch.Tensor],
        runner: Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], Any] | None = None,
    ) -> None:
        self.model, self.example, self.loss_fn = model, example, loss_fn
        self.args, self.kwargs = example_arguments(example)  # a tensor, a tuple (positional) or a dict (keywords)
        self.runner = runner  # a compiled step (model, args, kwargs) -> output; None: the model as it is called
        self.cuda = any(t.is_cuda for t in _tensors(example))
        # held whether or not anything is saved: parameters, buffers and the batch itself; everything else a
        # forward saves counts, also tensors that need no gradient (max-pooling indices, dropout masks)
        held = [*model.parameters(), *model.buffers(), *_tensors(example)]
        self.held = {_storage_key(t) for t in held}
        self.agree = _agreed.get()  # every rank's figures, where every rank measures (:func:`measured_alike`)

    def _run(self) -> None:
        if self.runner is not None:
            out = self.runner(self.model, self.args, self.kwargs)
        else:
            out = self.model(*self.args, **self.kwargs)
        self.loss_fn(out).backward()

    def seconds(self, steps: int = 3) -> float:
        """Median seconds of one forward and backward, after one untimed pass (a compile, where one is due)."""
        return self.agree(self._seconds(steps))

    def peak(self) -> int:
        """CUDA: the step's peak above what was allocated before. CPU: bytes of saved activations and kept inputs."""
        return self.agree(self._peak())

    def profile(self, links: list[Link]) -> list[BlockProfile]:
        """Each link's saved activations (split into input, output and the rest) and forward time, in one pass."""
        return self.agree(self._profile(links))

    def _seconds(self, steps: int) -> float:
        with preserved_state(self.model):
            self._run()
            times = []
            for _ in range(steps):
                if self.cuda:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                self._run()
                if self.cuda:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
        return statistics.median(times)

    def _peak(self) -> int:
        with preserved_state(self.model):
            if self.cuda:
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                self._run()
                torch.cuda.synchronize()
                return int(torch.cuda.max_memory_allocated() - before)
            seen: set[tuple[int, int]] = set()
            total = 0

            def count(t: torch.Tensor) -> None:
                nonlocal total
                key = _storage_key(t)
                if key not in self.held and key not in seen:
                    seen.add(key)
                    total += key[1]

            def pack(t: torch.Tensor) -> torch.Tensor:
                count(t)
                return t

            def kept_inputs(module: nn.Module, args: Any) -> None:
                if torch.is_grad_enabled():
                    for t in _tensors(args):
                        count(t)

            # a checkpoint's inputs stay alive; a compiled step saves them as its own saved tensors, counted above
            checkpoints = [m for m in self.model.modules() if is_checkpointed(m)] if self.runner is None else []
            handles = [m.register_forward_pre_hook(kept_inputs) for m in checkpoints]
            try:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    self._run()
            finally:
                for h in handles:
                    h.remove()
            return total

    def _profile(self, links: list[Link]) -> list[BlockProfile]:
        saved: dict[str, dict[tuple[int, int], int]] = {link.name: {} for link in links}
        inputs: dict[str, set[tuple[int, int]]] = {link.name: set() for link in links}
        outputs: dict[str, set[tuple[int, int]]] = {link.name: set() for link in links}
        starts: dict[str, Any] = {}
        seen: set[tuple[int, int]] = set()
        current: list[str] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            key = _storage_key(t)
            if current and key not in self.held and key not in seen:
                seen.add(key)
                saved[current[-1]][key] = key[1]
            return t

        def clock() -> Any:
            if self.cuda:
                event = torch.cuda.Event(enable_timing=True)
                event.record()
                return event
            return time.perf_counter()

        def pre(name: str) -> Callable[..., None]:
            def hook(module: nn.Module, args: Any) -> None:
                current.append(name)
                inputs[name] = {_storage_key(t) for t in _tensors(args)}
                starts[name] = clock()

            return hook

        def post(name: str) -> Callable[..., None]:
            def hook(module: nn.Module, args: Any, output: Any) -> None:
                starts[name] = (starts[name], clock())
                outputs[name] = {_storage_key(t) for t in _tensors(output)}
                current.pop()

            return hook

        handles = []
        for link in links:
            handles.append(link.modules[0][1].register_forward_pre_hook(pre(link.name)))
            handles.append(link.modules[-1][1].register_forward_hook(post(link.name)))
        try:
            with preserved_state(self.model), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                self._run()
        finally:
            for h in handles:
                h.remove()
        if self.cuda:
            torch.cuda.synchronize()
        profiles = []
        for link in links:
            start, end = starts[link.name]
            ms = start.elapsed_time(end) if self.cuda else (end - start) * 1e3
            own = saved[link.name]
            profiles.append(
                BlockProfile(
                    link.name,
                    saved_bytes=sum(own.values()),
                    input_bytes=sum(own.get(k, 0) for k in inputs[link.name]),
                    output_bytes=sum(own.get(k, 0) for k in outputs[link.name]),
                    forward_ms=ms,
                )
            )
        return profiles


def _can_rebuild(link: Link) -> bool:
    if link.stem:
        return len(link.modules) == 4 and stem_rebuildable(*(m for _, m in link.modules[1:]))
    return any(rebuildable(m) for _, m in link.modules)


def _rebuilt_profiles(rebuilt: list[BlockProfile], plain: list[BlockProfile]) -> list[BlockProfile]:
    """The links as the planner sees them with the rebuild: what each keeps unchecked (``rebuilt``), what it brings
    back when recomputed (``plain``), and what checkpointing it makes real again: its output (the end of a run
    keeps it) and its input where the link before rebuilt it (the start of a run keeps it)."""
    out = []
    for i, (p, q) in enumerate(zip(rebuilt, plain, strict=True)):
        before = (rebuilt[i - 1].output_bytes, plain[i - 1].output_bytes) if i else (0, 0)
        out.append(
            replace(
                p,
                recomputed_bytes=q.saved_bytes,
                input_bytes=q.input_bytes + before[1] - before[0],
                output_bytes=q.output_bytes,
            )
        )
    return out


def model_chain(model: nn.Module, found: list[tuple[str, nn.Module]]) -> tuple[list[Link], list[bool]]:
    """The links to plan over and which neighbours may share a run.

    Blocks that are consecutive children of one ``nn.Sequential`` (with ``nn.Sequential``'s own forward) may share
    a run, so a stage's output (what feature extractors read) is always its own. In a model whose adapter names a
    stem (torchvision's and timm's ResNets with their own forward: conv1, bn1, relu / act1, maxpool) the stem is a
    link too, on its own, before the block it runs before. A block sharded by FSDP2 (``fully_shard``) is a run of its
    own.
    """
    names = {name for name, _ in found}
    stems = {
        stem.before: Link(name, stem.modules, stem=True) for name, stem in families.stems(model) if stem.before in names
    }  # first block's name -> the stem link before it
    links: list[Link] = []
    joinable: list[bool] = []
    modules = dict(model.named_modules())
    for name, module in found:
        if name in stems:
            if links:
                joinable.append(False)
            links.append(stems[name])
            joinable.append(False)
        elif links:
            joinable.append(_consecutive_in_sequential(modules, links[-1].name, name))
        links.append(Link(name, ((name, module),)))
    return links, joinable


def _consecutive_in_sequential(modules: dict[str, nn.Module], a: str, b: str) -> bool:
    parent_a, _, index_a = a.rpartition(".")
    parent_b, _, index_b = b.rpartition(".")
    parent = modules.get(parent_a)
    # a Sequential subclass with a forward of its own may not call its children one after another
    if parent_a != parent_b or parent is None or not plain_sequential(parent):
        return False
    # a block sharded by FSDP2 gathers its weights in hooks around its own call; a run calls its members' forward
    if isinstance(modules[a], FSDPModule) or isinstance(modules[b], FSDPModule):
        return False
    order = list(modules[parent_a]._modules)
    return order.index(index_b) == order.index(index_a) + 1


def _runs_named(links: list[Link], joinable: list[bool], runs: list[list[str]]) -> list[list[Link]]:
    """The model's links for each run of names (to re-apply a plan on a fresh copy of the model).

    Raises:
        ValueError: a name the model does not have, or a run whose links may not share one checkpoint.
    """
    index = {link.name: i for i, link in enumerate(links)}
    for run in runs:
        missing = [n for n in run if n not in index]
        if missing:
            raise ValueError(f"the model has no block named {missing[0]!r} to checkpoint")
        for a, b in zip(run, run[1:], strict=False):
            if index[b] != index[a] + 1 or not joinable[index[a]]:
                raise ValueError(
                    f"{a!r} and {b!r} cannot share a run: a run is made of consecutive blocks of one nn.Sequential,"
                    " none of them sharded by FSDP2's fully_shard"
                )
    return [[links[index[n]] for n in run] for run in runs]


def checkpoint_blocks(
    model: nn.Module,
    units: Units = "auto",
    memory_budget: float | int | str | None = None,
    example_input: Any = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    bn_correct: bool = True,
    rebuild_bn_relu: bool = False,
    rebuild_config: RebuildConfig | None = None,
    compile: bool | Mapping[str, Any] | None = None,
    compile_settings: Sequence[float] = (0.8, 0.5),
) -> CheckpointPlan:
    """Checkpoint a block-structured model in place (``use_reentrant=False``); ``state_dict`` keys do not change.

    The model is seen as a chain of links: its blocks, and in a torchvision or timm ResNet also its stem (conv1, bn1,
    relu, maxpool). Blocks are found (``units="auto"``) by the model's family where :mod:`.families` knows it (timm,
    Hugging Face transformers, torchvision's ResNets), else by structure. A Hugging Face model is called with
    ``use_cache=False`` while it trains with blocks checkpointed, as its own switch does. Without a budget, every
    link is checkpointed on its own.
    With ``memory_budget`` (a fraction in (0, 1] of the un-checkpointed peak, or bytes such as ``"6GB"``), each
    link's saved activations and forward time are measured on ``example_input``; the links that free the most
    memory per millisecond of recomputation are chosen until the predicted peak fits, and chosen neighbours of one
    ``nn.Sequential`` (a ResNet stage) are joined into runs, one checkpoint each, where that lowers the peak (a run
    also frees the tensors between its blocks, but brings all of its activations back at once when it is
    recomputed). The peak is then measured: links are added if it does not fit, and given back, least valuable
    first, while it still fits.

    With ``rebuild_bn_relu=True``, BasicBlocks, Bottlenecks and ResNet stems (torchvision's and timm's) that are not
    checkpointed keep their convolution outputs and rebuild the ReLU outputs after bn1 (and bn2), and their own
    outputs where the next block is rebuilt too, in backward, one element-wise pass each, instead of keeping them;
    in blocks that are not checkpointed, torchvision Conv2dNormActivation units (MobileNet, EfficientNet, RegNet)
    keep their convolution outputs and rebuild their BatchNorm and activation outputs (see
    :mod:`lightning_memguard.checkpointing.rebuild`): less memory for far less recomputation than a whole block.
    Units outside the blocks (a stem, a head) are left as they are here; ``rebuild_bn_relu(model)`` reaches them.
    Without a budget, that is all that happens (no block is checkpointed); with one, the rebuild comes first and
    whole blocks are checkpointed only for what it leaves over the budget.

    Under ``torch.compile`` the compiler decides what to keep for backward, so a plan measured in eager mode does
    not hold there. With a budget and a model that is compiled (``torch.compile(model)``, or a LightningModule that
    ``fit`` unwrapped) or will be (``compile=True``, or ``compile={...}``: ``torch.compile``'s keyword arguments),
    the peaks are measured compiled (each measurement compiles anew), and the budget is a fraction of the compiled
    model's own peak. Compile's ``activation_memory_budget`` is one more lever: compile's default and each of
    ``compile_settings`` is measured alone, then each that does not fit, fastest alone first, gets blocks added, most
    valuable first, as many as the gap needs, until it does, while it may still be the fastest (a heuristic:
    checkpointing more, or a lower setting, is taken not to make a step faster, so a setting no faster than a fit
    found is left, and so are a fit's blocks under a lower setting; see
    :class:`~lightning_memguard.core.checkpoint_plan.CompileBudgetSearch`). The
    fastest combination that fits is applied, and ``plan.activation_memory_budget`` must then be set while the
    model compiles (``with plan.compiling():``; the callback does it for the fit). The rebuild stands aside under
    compile, so ``rebuild_bn_relu`` is not planned on there.

    Under compile (the model compiled, or ``compile=`` given, with or without a budget) each container of
    checkpointed blocks (a ResNet's stages) is a compiled graph of its own (``plan.graph_splits``,
    :class:`~.wrap.GraphSplit`): one compiled backward of the whole model keeps several blocks' recomputation alive
    at once. A budget's search measures with the split, then its pick once more as one graph, kept instead where it
    fits and is faster. The split is a graph break, so ``fullgraph=True`` and ``torch.export`` do not take it.

    Args:
        model: the model, changed in place.
        units: ``"auto"`` (found by structure, see :func:`~.wrap.find_units`), module classes, or a predicate
            ``(name, module) -> bool``.
        memory_budget: see above; needs ``example_input``.
        example_input: a real batch of model inputs, as Lightning's ``example_input_array``: a tensor
            (``model(x)``), a tuple or list of positional arguments (``model(*x)``) or a dict of keyword arguments
            (``model(**x)``, a Hugging Face-style ``forward(input_ids, attention_mask)``).
        loss_fn: turns the model's output into a scalar for the profiling backward; default: the sum.
        bn_correct: BatchNorm running statistics are updated only by the first forward, not by recomputation.
        rebuild_bn_relu: see above.
        rebuild_config: how the rebuild makes its tensors (:class:`~.rebuild.RebuildConfig`); default: the one-pass
            kernel where it runs, two of a stage's earlier outputs kept.
        compile: None: measure the model as it runs (compiled if it is); True or ``torch.compile`` keyword
            arguments: it will be compiled so, measure it that way.
        compile_settings: the values of compile's ``activation_memory_budget`` tried beside its default: a
            sequence (or an array) of numbers in (0, 1].

    Raises:
        ValueError: no blocks found, a budget without an example input, a budget out of range, ``compile_settings``
            outside (0, 1], ``rebuild_bn_relu`` on a model with no BasicBlock, Bottleneck or ResNet stem (torchvision's
            or timm's) or Conv2dNormActivation unit (with ``nn.BatchNorm2d``) among its blocks, or a Hugging Face
            model that declares ``supports_gradient_checkpointing = False`` with ``units="auto"``.
        TypeError: ``model`` not an ``nn.Module``, ``units`` of the wrong kind, ``loss_fn`` not callable,
            ``bn_correct`` or ``rebuild_bn_relu`` not a bool, ``rebuild_config`` not a ``RebuildConfig``.

    Example:
        >>> import torchvision
        >>> model = torchvision.models.resnet18(num_classes=10)
        >>> plan = checkpoint_blocks(model)
        >>> plan.blocks[:3], plan.candidates
        (['stem', 'layer1.0', 'layer1.1'], 9)
    """
    _check_model(model)
    memory_budget = check_memory_budget(memory_budget)  # the callback's rule: a float is a fraction, else bytes
    check_callable("loss_fn", loss_fn, "a callable (output) -> scalar loss", optional=True)
    check_bool("bn_correct", bn_correct)  # not None (falsy: BatchNorm statistics updated twice per step)
    check_bool("rebuild_bn_relu", rebuild_bn_relu)  # not "False" (truthy: the rebuild applied)
    config = check_config(rebuild_config)
    options = _check_compile(compile)
    compile_settings = check_fractions("compile_settings", compile_settings)  # any sequence or array; 1 is 1.0
    measured, model = model, _compiler.unwrapped(model)  # the modules of a torch.compile result are its original's
    if compile is None:
        compile = _compiler.is_compiled(measured)
    links, joinable = model_chain(model, find_units(model, units))
    if rebuild_bn_relu and not any(_can_rebuild(link) for link in links):
        raise ValueError(
            f"`rebuild_bn_relu` needs {families.rebuild_description()} (with nn.BatchNorm2d)"
            f" among its blocks, and {type(model).__name__} has none"
        )
    if memory_budget is None and rebuild_bn_relu:
        applied = surgery.apply(model, rebuilt=links, config=config)
        return CheckpointPlan(blocks=[], candidates=len(links), rebuilt=applied.rebuilt)
    if memory_budget is None:  # under compile, a graph per container of blocks
        applied = surgery.apply(model, [[link] for link in links], bn_correct=bn_correct, split_graphs=bool(compile))
        return CheckpointPlan(
            blocks=applied.checkpointed, candidates=len(links), runs=applied.runs, graph_splits=applied.splits
        )
    if example_input is None:
        raise ValueError("`memory_budget` needs `example_input`, a real batch to measure the blocks on")
    if any(is_checkpointed(m) for link in links for _, m in link.modules):
        warnings.warn("the model is already checkpointed; applying twice changes nothing", UserWarning, stacklevel=2)
        return CheckpointPlan(blocks=[], candidates=len(links))
    with surgery.restored_on_failure(model):  # a planning pass that fails leaves the model as it was
        if compile:
            if rebuild_bn_relu:
                warnings.warn("the rebuild stands aside under torch.compile: planning without it", UserWarning, 2)
            return _plan_compiled(
                measured, model, links, joinable, memory_budget, example_input, loss_fn, bn_correct, options,
                tuple(compile_settings),
            )  # fmt: skip
        return _plan(model, links, joinable, memory_budget, example_input, loss_fn, bn_correct, rebuild_bn_relu, config)


def _check_model(model: Any) -> None:
    """``model`` must be a module (or a ``torch.compile`` of one), not its name."""
    check_instance("model", model, nn.Module, "be a torch.nn.Module (the model itself, built)")


def _check_compile(compile: Any) -> dict[str, Any] | None:
    if compile is not None and not isinstance(compile, bool | Mapping):
        raise TypeError(f"`compile` must be None, a bool or torch.compile's keyword arguments, got {compile!r}")
    return dict(compile) if isinstance(compile, Mapping) else None


def _budget_bytes(baseline: int, memory_budget: float | int) -> int:
    """A fraction of the baseline peak, or bytes as they are."""
    return int(baseline * memory_budget) if isinstance(memory_budget, float) else memory_budget


@contextlib.contextmanager
def _warnings_once() -> Iterator[None]:
    """Each application of a plan repeats the same warnings: pass each on once, after the block."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for category, message in dict.fromkeys((w.category, str(w.message)) for w in caught):
        warnings.warn(message, category, stacklevel=5)  # past this, contextlib and the planner: the caller's


def _search(
    search: BudgetSearch,
    measure: Callable[[], int],
    model: nn.Module,
    links: list[Link],
    joinable: list[bool],
    profiles: list[BlockProfile],
    start: int,
    applied: surgery.Applied,
    cuda: bool,
    *,
    rebuilt: Sequence[Link] = (),
    bn_correct: bool,
    config: RebuildConfig = DEFAULT_CONFIG,
) -> tuple[set[int], int, surgery.Applied]:
    """Hand each of ``search``'s proposals, cut into runs, to surgery and tell the search the peak ``measure`` reads;
    return its result and what is applied (the last proposal, the result's own set)."""
    while (indices := search.propose()) is not None:
        runs = [[links[i] for i in run] for run in best_runs(indices, profiles, start, joinable, cuda)]
        applied = surgery.apply(model, runs, rebuilt, bn_correct=bn_correct, config=config, replacing=applied)
        search.observe(measure())
    chosen, peak = search.result  # type: ignore[misc]
    return chosen, peak, applied


def _finished(plan: CheckpointPlan) -> CheckpointPlan:
    if not plan.held:
        warnings.warn(f"memory budget not met; the plan: {plan.summary()}", UserWarning, stacklevel=4)
    return plan


def _in_model_order(names: Sequence[str], links: list[Link]) -> list[str]:
    order = {link.name: i for i, link in enumerate(links)}
    return sorted(names, key=order.__getitem__)


ONE_GRAPH_MARGIN = 0.02
"""How much faster (a fraction of the step time) the compiled plan's pick must be as one graph than with a graph per
container to be kept so: one measurement's timing differs by about that much from the next."""


def _candidate(setting: float | None, applied: surgery.Applied, peak: int, seconds: float) -> dict[str, Any]:
    return {
        "activation_memory_budget": setting,
        "runs": applied.runs,
        "graph_splits": applied.splits,
        "peak_bytes": peak,
        "step_ms": round(seconds * 1e3, 3),
    }


def _plan_compiled(
    measured: nn.Module,
    model: nn.Module,
    links: list[Link],
    joinable: list[bool],
    memory_budget: float | int,
    example_input: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None,
    bn_correct: bool,
    options: dict[str, Any] | None,
    settings: tuple[float, ...],
) -> CheckpointPlan:
    """The budget under compile: each of compile's settings alone, then with the fewest most valuable blocks that
    fit where it may still be the fastest (:class:`~lightning_memguard.core.checkpoint_plan.CompileBudgetSearch`),
    measured compiled, the blocks' containers each a graph of its own; the fastest that fits is applied, in one
    graph where that fits and is faster (see :func:`checkpoint_blocks`)."""
    loss_fn = loss_fn or _default_loss
    with _compiler.eager():  # each link's own bytes and time, to rank them: in eager mode, hooks and all
        profiles = _StepMeter(model, example_input, loss_fn).profile(links)
    gradients = any(t.is_cuda for t in _tensors(example_input))
    now = _compiler.activation_memory_budget_now()
    levels = (None, *(s for s in dict.fromkeys(settings) if s != now))  # the default in force is measured once
    search = CompileBudgetSearch(
        [now if s is None else s for s in levels],
        lambda peak, budget: choose_blocks(profiles, peak, budget, joinable, gradients)[0],
        [value(p) for p in profiles],
        [p.saving for p in profiles],
        lambda baseline: _budget_bytes(baseline, memory_budget),  # of compile's default peak alone
    )
    candidates: list[dict[str, Any]] = []
    applied = surgery.Applied()

    def measure(setting: float | None, runs: list[list[Link]], split_graphs: bool) -> dict[str, Any]:
        nonlocal applied
        with _compiler.activation_memory_budget(setting):  # each measurement compiles anew, under its setting
            meter = _StepMeter(measured, example_input, loss_fn, _compiler.fresh_compiled(measured, options))
            applied = surgery.apply(model, runs, bn_correct=bn_correct, replacing=applied, split_graphs=split_graphs)
            candidate = _candidate(setting, applied, meter.peak(), meter.seconds())
        candidates.append(candidate)
        return candidate

    with _warnings_once():
        while (step := search.propose()) is not None:
            index, chosen = step
            start = search.alone(index)  # the peak the links are cut into runs against (None: measuring it now)
            cut = best_runs(chosen, profiles, start.peak if start else 0, joinable, gradients)
            runs = [[links[i] for i in run] for run in cut]
            tried = measure(levels[index], runs, split_graphs=True)
            search.observe(tried["peak_bytes"], tried["step_ms"] / 1e3)
        budget = search.budget
        assert budget is not None and search.result is not None
        pick = candidates[search.result]
        runs = _runs_named(links, joinable, pick["runs"])  # the twin below has the same runs
        if pick["graph_splits"]:  # the same blocks in one graph: chosen instead where it fits and is faster
            twin = measure(pick["activation_memory_budget"], runs, split_graphs=False)
            # one graph peaks higher at about the same speed (ResNet50: 0.3 %): it must be faster beyond the noise
            if twin["peak_bytes"] <= budget and twin["step_ms"] < pick["step_ms"] * (1 - ONE_GRAPH_MARGIN):
                pick = twin
    applied = surgery.apply(
        model, runs, bn_correct=bn_correct, replacing=applied, split_graphs=bool(pick["graph_splits"])
    )
    _compiler.forget_graphs_apart()  # training compiles its graphs apart anew, under its own settings
    return _finished(
        CheckpointPlan(
            blocks=_in_model_order(applied.checkpointed, links),
            candidates=len(links),
            runs=applied.runs,
            baseline_bytes=search.tried[0].peak,
            budget_bytes=budget,
            measured_bytes=pick["peak_bytes"],
            profiles=profiles,
            graph_splits=applied.splits,
            compiled=True,
            activation_memory_budget=pick["activation_memory_budget"],
            compile_candidates=candidates,
            lower=_lower_compiled(settings),
        )
    )


def _lower_compiled(settings: tuple[float, ...]) -> list[str]:
    """What would lower a compiled plan's floor: a smaller batch, compile's lower settings."""
    lowest = min(settings, default=None)
    below = f"below {lowest}" if lowest is not None else "such as 0.5"
    return ["a smaller batch", f"compile's activation_memory_budget {below} (`compile_settings`)"]


def _plan(
    model: nn.Module,
    links: list[Link],
    joinable: list[bool],
    memory_budget: float | int,
    example_input: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None,
    bn_correct: bool,
    rebuild_bn_relu: bool,
    config: RebuildConfig,
) -> CheckpointPlan:
    """Measure, choose links under the budget, and leave the model as the plan says (see :func:`checkpoint_blocks`)."""
    meter = _StepMeter(model, example_input, loss_fn or _default_loss)
    baseline = meter.peak()
    budget = _budget_bytes(baseline, memory_budget)
    profiles = meter.profile(links)
    start = baseline  # the peak the blocks are chosen against: after the rebuild, where there is one
    rebuilt = links if rebuild_bn_relu else []  # the rebuild goes wherever a link is left unchecked
    applied = surgery.Applied()
    if rebuild_bn_relu:
        plain = profiles  # what a checkpointed block brings back when it is recomputed: the rebuild stands aside
        applied = surgery.apply(model, rebuilt=rebuilt, config=config)
        profiles = _rebuilt_profiles(meter.profile(links), plain)
        start -= sum(q.saved_bytes for q in plain) - sum(p.saved_bytes for p in profiles)  # what the rebuild frees
    chosen, _, _ = choose_blocks(profiles, start, budget, joinable, meter.cuda)
    search = BudgetSearch(chosen, [value(p) for p in profiles], budget)  # the pure core decides, this measures
    with _warnings_once():
        chosen, measured, applied = _search(
            search, meter.peak, model, links, joinable, profiles, start, applied, meter.cuda,
            rebuilt=rebuilt, bn_correct=bn_correct, config=config,
        )  # fmt: skip
    final_runs = best_runs(chosen, profiles, start, joinable, meter.cuda)
    lower = ["a smaller batch"]
    if not rebuild_bn_relu and any(_can_rebuild(link) for link in links):
        lower.append("rebuild_bn_relu=True (the rebuild, in the links left unchecked)")
    return _finished(
        CheckpointPlan(
            blocks=_in_model_order(applied.checkpointed, links),  # what was really changed, in model order
            candidates=len(links),
            runs=applied.runs,
            rebuilt=applied.rebuilt,
            baseline_bytes=baseline,
            budget_bytes=budget,
            predicted_bytes=predict_peak(start, profiles, final_runs, meter.cuda),
            measured_bytes=measured,
            profiles=profiles,
            lower=lower,
        )
    )


def apply_plan(
    model: nn.Module,
    runs: list[list[str]],
    units: Units = "auto",
    bn_correct: bool = True,
    rebuild_bn_relu: bool = False,
    rebuild_config: RebuildConfig | None = None,
    split_graphs: bool = False,
) -> list[str]:
    """Checkpoint the runs of a plan made before (``CheckpointPlan.runs``) on a fresh copy of its model, and with
    ``rebuild_bn_relu`` rebuild BatchNorm + ReLU outputs in the blocks left unchecked (made as ``rebuild_config``
    says); with ``split_graphs`` (the plan has ``graph_splits``) the blocks' containers each begin a compiled graph of
    their own; return the links checkpointed.

    Raises:
        ValueError: a block the model does not have, or a run of blocks that may not share one checkpoint.
        TypeError: ``model`` not an ``nn.Module``, a flag not a bool, ``rebuild_config`` not a ``RebuildConfig``.
    """
    _check_model(model)
    check_bool("bn_correct", bn_correct)
    check_bool("rebuild_bn_relu", rebuild_bn_relu)
    check_bool("split_graphs", split_graphs)
    config = check_config(rebuild_config)
    links, joinable = model_chain(model, find_units(model, units))
    named = _runs_named(links, joinable, runs)
    rebuilt = links if rebuild_bn_relu else ()
    applied = surgery.apply(model, named, rebuilt, bn_correct=bn_correct, config=config, split_graphs=split_graphs)
    return applied.checkpointed


def checkpoint_resnet(
    model: nn.Module,
    memory_budget: float | int | str | None = None,
    example_input: Any = None,
    bn_correct: bool = True,
    rebuild_bn_relu: bool = False,
    rebuild_config: RebuildConfig | None = None,
    compile: bool | Mapping[str, Any] | None = None,
    compile_settings: Sequence[float] = (0.8, 0.5),
) -> CheckpointPlan:
    """Checkpoint a torchvision ResNet (resnet18..152, ResNeXt, Wide ResNet) in place: its stem and blocks.

    See :func:`checkpoint_blocks` for the budget, the runs, the BatchNorm handling, the cheaper
    ``rebuild_bn_relu=True`` (which with a budget usually buys the same memory for less throughput) and a budget
    under ``torch.compile`` (``model`` compiled, or ``compile=``).

    Raises:
        TypeError: if ``model`` is not a torchvision ResNet (or ``torch.compile`` of one); other arguments as for
            :func:`checkpoint_blocks`.

    Example:
        >>> import torchvision
        >>> plan = checkpoint_resnet(torchvision.models.resnet50(num_classes=10))
        >>> len(plan.blocks), plan.blocks[0]
        (17, 'stem')
    """
    import torchvision

    _check_model(model)
    if not isinstance(_compiler.unwrapped(model), torchvision.models.ResNet):
        raise TypeError(
            f"`model`: checkpoint_resnet needs a torchvision ResNet, got {type(model).__name__}; use"
            " checkpoint_blocks(model, units=...) for other block-structured models"
        )
    from torchvision.models.resnet import BasicBlock, Bottleneck

    return checkpoint_blocks(
        model,
        units={BasicBlock, Bottleneck},
        memory_budget=memory_budget,
        example_input=example_input,
        bn_correct=bn_correct,
        rebuild_bn_relu=rebuild_bn_relu,
        rebuild_config=rebuild_config,
        compile=compile,
        compile_settings=compile_settings,
    )
