"""A model as a chain of links, and measuring it on a real batch.

:func:`model_chain` sees the model as the planner does: its blocks in order (and a ResNet's stem before its first
block), with which neighbours may share a run. :class:`StepMeter` runs one forward and backward and reads its peak,
its time, and each link's saved activations and forward time (:class:`~.budget.BlockProfile`). Nothing here changes
the model: :mod:`.surgery` does, as :mod:`.plan_eager` and :mod:`.plan_compiled` decide."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_memguard import _autograd
from lightning_memguard._ledger import Key, Ledger, storage_key
from lightning_memguard.checkpointing.budget import BlockProfile
from lightning_memguard.checkpointing.families import Layout
from lightning_memguard.checkpointing.rebuild import rebuildable, stem_rebuildable
from lightning_memguard.checkpointing.wrap import Link, is_checkpointed, plain_sequential, preserved_state


def model_chain(
    model: nn.Module, found: list[tuple[str, nn.Module]], layout: Layout | None = None, with_stems: bool = True
) -> tuple[list[Link], list[bool]]:
    """The links to plan over and which neighbours may share a run.

    Blocks that are consecutive children of one ``nn.Sequential`` (with ``nn.Sequential``'s own forward) may share
    a run, so a stage's output (what feature extractors read) is always its own. In a model whose adapter names a
    stem (torchvision's and timm's ResNets with their own forward: conv1, bn1, relu / act1, maxpool) the stem is a
    link too, on its own, before the block it runs before (unless ``with_stems`` is False: blocks chosen by name). A
    block sharded by FSDP2 (``fully_shard``) is a run of its own.
    """
    names = {name for name, _ in found} if with_stems else set()
    stems = {
        stem.before: Link(name, stem.modules, stem=True)
        for name, stem in (layout or Layout(model)).stems
        if stem.before in names
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


def link_parts(links: list[Link]) -> list[tuple[int, Link]]:
    """Finer links: in each block, the modules it calls that are made of modules and hold parameters (a
    transformer layer's attention and MLP, a ConvNeXt block's MLP, T5's sub-layers inside its ``layer`` list, the
    blocks of a plain ``nn.Sequential`` of them where a block is a whole stage), each with the index of its block.
    A part is checkpointed on its own (the rest of its block kept as it is), or inside its checkpointed block, where
    its recomputation then holds less at once. A ResNet's stem has none.

    Example:
        >>> layer = nn.Sequential(nn.LayerNorm(4), nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4)))
        >>> model = nn.Sequential(layer)
        >>> [(i, part.name) for i, part in link_parts([Link("0", (("0", layer),))])]
        [(0, '0.1')]
    """
    blocks = {id(module) for link in links for _, module in link.modules}
    parts: list[tuple[int, Link]] = []
    for i, link in enumerate(links):
        if link.stem or len(link.modules) != 1:
            continue
        name, block = link.modules[0]
        for path, child in _composite_children(block):
            if id(child) not in blocks:
                parts.append((i, Link(f"{name}.{path}", ((f"{name}.{path}", child),), part=True)))
    return parts


def _composite_children(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    for name, child in module._modules.items():
        if child is None:
            continue
        if isinstance(child, nn.ModuleList | nn.ModuleDict):  # never called: the block calls its elements
            yield from _composite_children(child, f"{prefix}{name}.")
        elif plain_sequential(child) and any(_composite(c) for c in child._modules.values() if c is not None):
            # a stage's blocks (a block that is a whole stage, as timm's switch checkpoints RepViT's): each is a part
            yield from _composite_children(child, f"{prefix}{name}.")
        elif _composite(child):
            yield f"{prefix}{name}", child


def _composite(module: nn.Module) -> bool:
    return bool(module._modules) and next(module.parameters(), None) is not None


def runs_named(
    links: list[Link], joinable: list[bool], runs: list[list[str]], parts: Sequence[tuple[int, Link]] = ()
) -> list[list[Link]]:
    """The model's links for each run of names (to re-apply a plan on a fresh copy of the model); a part of a block
    (:func:`link_parts`) is a run of its own.

    Raises:
        ValueError: a name the model does not have, or a run whose links may not share one checkpoint.
    """
    index = {link.name: i for i, link in enumerate(links)}
    named_parts = {part.name: part for _, part in parts}
    for run in runs:
        if len(run) == 1 and run[0] in named_parts and run[0] not in index:
            continue
        missing = [n for n in run if n not in index]
        if missing:
            raise ValueError(f"the model has no block named {missing[0]!r} to checkpoint")
        for a, b in zip(run, run[1:], strict=False):
            if index[b] != index[a] + 1 or not joinable[index[a]]:
                raise ValueError(
                    f"{a!r} and {b!r} cannot share a run: a run is made of consecutive blocks of one nn.Sequential,"
                    " none of them sharded by FSDP2's fully_shard"
                )
    return [[named_parts[n] for n in run] if run[0] not in index else [links[index[n]] for n in run] for run in runs]


def in_model_order(names: Sequence[str], links: list[Link], parts: Sequence[tuple[int, Link]] = ()) -> list[str]:
    order = {link.name: (i, -1) for i, link in enumerate(links)}
    order.update({part.name: (i, k) for k, (i, part) in enumerate(parts)})
    return sorted(names, key=order.__getitem__)


def can_rebuild(link: Link, layout: Layout) -> bool:
    if link.stem:
        return len(link.modules) == 4 and stem_rebuildable(*(m for _, m in link.modules[1:]))
    return any(rebuildable(m, layout) for _, m in link.modules)


def default_loss(output: Any) -> torch.Tensor:
    if torch.is_tensor(output):
        return output.float().sum()
    if isinstance(output, dict):
        output = list(output.values())
    return sum(default_loss(o) for o in output if torch.is_tensor(o) or isinstance(o, list | tuple | dict))  # type: ignore[return-value]


def tensors(args: Any) -> list[torch.Tensor]:
    if torch.is_tensor(args):
        return [args]
    if isinstance(args, list | tuple):
        return [t for a in args for t in tensors(a)]
    if isinstance(args, dict):
        return [t for a in args.values() for t in tensors(a)]
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


class StepMeter:
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
        self.cuda = any(t.is_cuda for t in tensors(example))
        # held whether or not anything is saved: parameters, buffers and the batch itself; everything else a
        # forward saves counts (the ledger's rules), also tensors that need no gradient (max-pooling indices)
        self.existing = [*model.parameters(), *model.buffers(), *tensors(example)]
        self.agree = _agreed.get()  # every rank's figures, where every rank measures (:func:`measured_alike`)

    def _run(self, between: Callable[[], None] = lambda: None) -> None:
        if self.runner is not None:
            out = self.runner(self.model, self.args, self.kwargs)
        else:
            out = self.model(*self.args, **self.kwargs)
        loss = self.loss_fn(out)
        between()  # the forward is over
        loss.backward()

    def seconds(self, steps: int = 3) -> float:
        """Median seconds of one forward and backward, after one untimed pass (a compile, where one is due)."""
        return self.agree(self._seconds(steps))

    def peak(self) -> int:
        """CUDA: the step's peak above what was allocated before. CPU: bytes of saved activations and kept inputs, as
        the ledger of saved tensors counts them (:class:`~lightning_memguard._ledger.Ledger`)."""
        return self.agree(self._peak())

    def profile(self, links: list[Link], parts: Sequence[tuple[int, Link]] = ()) -> list[BlockProfile]:
        """Each link's saved activations (split into input, output and the rest) and forward time, in one pass; then
        each part's (:func:`link_parts`), whose bytes its block's figures hold too."""
        return self.agree(self._profile(links, [part for _, part in parts]))

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
            ledger: Ledger[str] = Ledger(self.existing)

            def count(t: torch.Tensor) -> None:
                ledger.save(t, "")

            def pack(t: torch.Tensor) -> torch.Tensor:
                count(t)
                return t

            inside = [0]  # checkpoints running: one inside another keeps nothing (the outer one saves nothing)
            forward = [True]  # recomputation in backward calls checkpoints again, on tensors it makes anew

            def kept_inputs(module: nn.Module, args: Any, kwargs: Any) -> None:
                if torch.is_grad_enabled() and forward[0] and not inside[0]:
                    for t in tensors([args, kwargs]):
                        count(t)
                inside[0] += 1

            def left(module: nn.Module, args: Any, output: Any) -> None:
                inside[0] -= 1

            def forward_over() -> None:
                forward[0] = False

            # a checkpoint's inputs stay alive; a compiled step saves them as its own saved tensors, counted above
            checkpoints = [m for m in self.model.modules() if is_checkpointed(m)] if self.runner is None else []
            handles = [m.register_forward_pre_hook(kept_inputs, with_kwargs=True) for m in checkpoints]
            handles += [m.register_forward_hook(left) for m in checkpoints]
            try:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    self._run(forward_over)
            finally:
                for h in handles:
                    h.remove()
            return ledger.on_device

    def _profile(self, links: list[Link], parts: Sequence[Link] = ()) -> list[BlockProfile]:
        every = [*links, *parts]
        # each storage once, split by the link and the part running when its views were saved (the ledger's rules)
        ledger: Ledger[tuple[str | None, str | None]] = Ledger(self.existing)
        inputs: dict[str, set[Key]] = {link.name: set() for link in every}
        outputs: dict[str, set[Key]] = {link.name: set() for link in every}
        one_tensor: dict[str, bool] = {}
        calls: dict[str, int] = {}
        starts: dict[str, Any] = {}
        spans: dict[str, list[tuple[Any, Any]]] = {link.name: [] for link in every}
        given: dict[str, list[tuple[torch.Tensor, int]]] = {}  # each input and its version as the call began
        changes_input: set[str] = set()
        current: list[str] = []  # the links running, innermost last
        inner: list[str] = []  # the parts running

        def pack(t: torch.Tensor) -> torch.Tensor:
            if current or inner:
                ledger.save(t, (current[-1] if current else None, inner[-1] if inner else None))
            return t

        def clock() -> Any:
            if self.cuda:
                event = torch.cuda.Event(enable_timing=True)
                event.record()
                return event
            return time.perf_counter()

        def pre(name: str, stack: list[str]) -> Callable[..., None]:
            def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
                stack.append(name)
                calls[name] = calls.get(name, 0) + 1
                inputs[name] = {storage_key(t) for t in tensors([args, kwargs])}
                given[name] = [(t, _autograd.version(t)) for t in tensors([args, kwargs])]
                starts[name] = clock()

            return hook

        def post(name: str, stack: list[str]) -> Callable[..., None]:
            def hook(module: nn.Module, args: Any, output: Any) -> None:
                spans[name].append((starts[name], clock()))
                outputs[name] = {storage_key(t) for t in tensors(output)}
                one_tensor[name] = isinstance(output, torch.Tensor)
                if any(_autograd.version(t) != v for t, v in given.pop(name)):
                    changes_input.add(name)
                stack.pop()

            return hook

        handles = []
        for link, stack in [*((link, current) for link in links), *((part, inner) for part in parts)]:
            handles.append(link.modules[0][1].register_forward_pre_hook(pre(link.name, stack), with_kwargs=True))
            handles.append(link.modules[-1][1].register_forward_hook(post(link.name, stack)))
        try:
            with preserved_state(self.model), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                self._run()
        finally:
            for h in handles:
                h.remove()
        if self.cuda:
            torch.cuda.synchronize()
        saved: dict[str, dict[Key, int]] = {link.name: {} for link in every}
        for owners, shares in ledger.by_owner().items():
            for name in owners:
                if name is not None:
                    for key, size in shares.items():
                        saved[name][key] = saved[name].get(key, 0) + size
        profiles = []
        for link in every:
            if not spans[link.name] or link.name in changes_input:
                # its forward is called directly (HRNet's head: ``down.forward(y)``), past the hooks: nothing is
                # known of it; or it changes its input in place (a part that scales what its block hands it,
                # ``x.mul_(s)``), which a checkpoint's recomputation would see changed (an error alone, wrong
                # gradients nested in its checkpointed block). Either way it frees nothing a budget could count on,
                # and joins no run
                profiles.append(BlockProfile(link.name, 0, 0, 0, forward_ms=0.0, one_tensor=False, recomputable=False))
                continue
            ms = sum(start.elapsed_time(end) if self.cuda else (end - start) * 1e3 for start, end in spans[link.name])
            own = saved[link.name]
            profiles.append(
                BlockProfile(
                    link.name,
                    saved_bytes=sum(own.values()),
                    input_bytes=sum(own.get(k, 0) for k in inputs[link.name]),
                    output_bytes=sum(own.get(k, 0) for k in outputs[link.name]),
                    forward_ms=ms,
                    one_tensor=one_tensor.get(link.name, True),
                    calls=calls.get(link.name, 1),
                )
            )
        return profiles
