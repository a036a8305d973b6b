"""Measuring a model on a real batch.

:class:`StepMeter` runs one forward and backward and reads its peak, its time, and each link's saved activations and
forward time (:class:`~.budget.BlockProfile`); the links are the model map's (:mod:`.model_map`). Nothing here changes
the model: :mod:`.surgery` does, as :mod:`.plan_eager` and :mod:`.plan_compiled` decide."""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn

from lightning_memguard import _autograd
from lightning_memguard._ledger import Key, Ledger, counting_unseen, storage_key
from lightning_memguard.checkpointing.budget import BlockProfile
from lightning_memguard.checkpointing.wrap import Link, preserved_state


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
    """Runs forward and backward once and measures memory (and, optionally, each block).

    Its counts of saved tensors are the ledger's (:mod:`lightning_memguard._ledger`): what the saved-tensor hooks see,
    and what is kept for backward out of their sight (the pointwise lever's selective checkpoints), handed to them by
    the ledger (:func:`~lightning_memguard._ledger.counting_unseen`).
    """

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
        self.warm = False  # CUDA: a step has run, so that what the first step allocates once is not its peak

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
        """CUDA: the step's peak above what was allocated before. CPU: bytes of saved activations (a checkpoint's
        inputs among them), as the ledger of saved tensors counts them (:class:`~lightning_memguard._ledger.Ledger`)."""
        return self.agree(self._peak())

    def profile(self, links: list[Link], parts: Sequence[tuple[int, Link]] = ()) -> list[BlockProfile]:
        """Each link's saved activations (split into input, output and the rest) and forward time, in one pass; then
        each part's (:func:`.model_map.link_parts`), whose bytes its block's figures hold too."""
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
        if self.cuda and not self.warm:
            # a process's first steps allocate what later steps reuse (cuBLAS's and cuDNN's workspaces, a compile):
            # measured cold, a ViT's baseline was twice its steps' peak. One step first, its own state restored
            with preserved_state(self.model):
                self._run()
            self.warm = True
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
                return _autograd.kept(t)

            # a checkpoint saves its inputs through the saved-tensor hooks open around it (every tensor among them:
            # wrap.recomputable passes each as an argument), so they are counted here, or by the hooks inside these
            # that take them (an offload, which hands on what it keeps: what it moves is not on the device); a
            # checkpoint inside another saves them through the outer one's hooks, which keep nothing. What is kept
            # past the hooks, also inside a whole checkpoint: a selective checkpoint's cache lives as long as its
            # block's graph, which the whole checkpoint's forward keeps until backward
            with counting_unseen(count), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                self._run()
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

        def count(t: torch.Tensor) -> None:
            if current or inner:
                ledger.save(t, (current[-1] if current else None, inner[-1] if inner else None))

        def pack(t: torch.Tensor) -> torch.Tensor:
            count(t)
            return _autograd.kept(t)

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
            with (
                preserved_state(self.model),
                counting_unseen(count),
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
            ):
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
        given_to = Counter(key for link in links for key in inputs[link.name])  # how many links take each storage
        chain = {link.name for link in links}
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
            mine = int(link.name in chain)  # a part is no link: any link's taking it counts (its block's does)
            given_in = tuple((own[k], given_to[k] > mine) for k in sorted(inputs[link.name]) if own.get(k, 0))
            profiles.append(
                BlockProfile(
                    link.name,
                    saved_bytes=sum(own.values()),
                    input_bytes=sum(own.get(k, 0) for k in inputs[link.name]),
                    output_bytes=sum(own.get(k, 0) for k in outputs[link.name]),
                    forward_ms=ms,
                    one_tensor=one_tensor.get(link.name, True),
                    calls=calls.get(link.name, 1),
                    input_storages=given_in,
                )
            )
        return profiles
