"""Measuring blocks on a real batch and checkpointing the ones that buy the most memory per millisecond."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_memguard.checkpointing.wrap import (
    Units,
    apply_checkpointing,
    find_units,
    is_checkpointed,
    preserved_state,
    remove_checkpointing,
)
from lightning_memguard.core.checkpoint_plan import BlockProfile, choose_blocks, predict_peak
from lightning_memguard.core.units import parse_bytes


@dataclass
class CheckpointPlan:
    """What was checkpointed and why. Memory in bytes: the peak of one forward and backward pass on CUDA, the bytes
    of saved activations on the CPU."""

    blocks: list[str]
    candidates: int
    baseline_bytes: int | None = None
    budget_bytes: int | None = None
    predicted_bytes: int | None = None
    measured_bytes: int | None = None
    profiles: list[BlockProfile] = field(default_factory=list)

    @property
    def held(self) -> bool | None:
        if self.budget_bytes is None or self.measured_bytes is None:
            return None
        return self.measured_bytes <= self.budget_bytes

    def summary(self) -> str:
        text = f"checkpointed {len(self.blocks)} of {self.candidates} blocks"
        if self.budget_bytes is not None:
            text += (
                f"; budget {self.budget_bytes / 1e9:.3f} GB of baseline {self.baseline_bytes / 1e9:.3f} GB,"  # type: ignore[operator]
                f" predicted {self.predicted_bytes / 1e9:.3f} GB, measured {self.measured_bytes / 1e9:.3f} GB"  # type: ignore[operator]
            )
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


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return (s.data_ptr(), s.nbytes())


class _StepMeter:
    """Runs forward and backward once and measures memory (and, optionally, each block)."""

    def __init__(self, model: nn.Module, example: Any, loss_fn: Callable[[Any], torch.Tensor]) -> None:
        self.model, self.example, self.loss_fn = model, example, loss_fn
        self.cuda = any(t.is_cuda for t in _tensors(example))

    def _run(self) -> None:
        out = self.model(*self.example) if isinstance(self.example, tuple) else self.model(self.example)
        self.loss_fn(out).backward()

    def peak(self) -> int:
        """CUDA: the step's peak above what was allocated before. CPU: bytes of saved activations and kept inputs."""
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
                root = t._base if t._base is not None else t
                key = _storage_key(t)
                if not root.is_leaf and key not in seen:
                    seen.add(key)
                    total += key[1]

            def pack(t: torch.Tensor) -> torch.Tensor:
                count(t)
                return t

            def kept_inputs(module: nn.Module, args: Any) -> None:
                if torch.is_grad_enabled():
                    for t in _tensors(args):
                        count(t)

            handles = [m.register_forward_pre_hook(kept_inputs) for m in self.model.modules() if is_checkpointed(m)]
            try:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    self._run()
            finally:
                for h in handles:
                    h.remove()
            return total

    def profile(self, units: list[tuple[str, nn.Module]]) -> list[BlockProfile]:
        saved: dict[str, int] = {name: 0 for name, _ in units}
        inputs: dict[str, int] = {name: 0 for name, _ in units}
        starts: dict[str, Any] = {}
        times: dict[str, float] = {name: 0.0 for name, _ in units}
        seen: set[tuple[int, int]] = set()
        current: list[str] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            root = t._base if t._base is not None else t
            key = _storage_key(t)
            if current and not root.is_leaf and key not in seen:
                seen.add(key)
                saved[current[-1]] += key[1]
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
                inputs[name] = sum(_storage_key(t)[1] for t in _tensors(args))
                starts[name] = clock()

            return hook

        def post(name: str) -> Callable[..., None]:
            def hook(module: nn.Module, args: Any, output: Any) -> None:
                end = clock()
                starts[name] = (starts[name], end)
                current.pop()

            return hook

        handles = []
        for name, module in units:
            handles.append(module.register_forward_pre_hook(pre(name)))
            handles.append(module.register_forward_hook(post(name)))
        try:
            with preserved_state(self.model), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                self._run()
        finally:
            for h in handles:
                h.remove()
        if self.cuda:
            torch.cuda.synchronize()
        for name, (start, end) in starts.items():
            times[name] = start.elapsed_time(end) if self.cuda else (end - start) * 1e3
        return [BlockProfile(name, saved[name], inputs[name], times[name]) for name, _ in units]


def checkpoint_blocks(
    model: nn.Module,
    units: Units = "auto",
    memory_budget: float | int | str | None = None,
    example_input: Any = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    bn_correct: bool = True,
) -> CheckpointPlan:
    """Checkpoint a block-structured model in place (``use_reentrant=False``); ``state_dict`` keys do not change.

    Without a budget, every block is checkpointed. With ``memory_budget`` (a fraction in (0, 1] of the
    un-checkpointed peak, or bytes such as ``"6GB"``), each block's saved activations and forward time are measured
    on ``example_input``, the blocks that save the most memory per millisecond of recomputation are checkpointed
    until the predicted peak fits, and the peak is then measured: more blocks are added if it does not fit, and
    blocks are given back, least valuable first, while it still fits.

    Args:
        model: the model, changed in place.
        units: ``"auto"`` (residual blocks: classes named ``*Block``, ``*Bottleneck``, ``*EncoderLayer``...), a set
            of module classes, or a predicate ``(name, module) -> bool``.
        memory_budget: see above; needs ``example_input``.
        example_input: a real batch of model inputs (a tensor, or a tuple of positional arguments).
        loss_fn: turns the model's output into a scalar for the profiling backward; default: the sum.
        bn_correct: BatchNorm running statistics are updated only by the first forward, not by recomputation.

    Raises:
        ValueError: no blocks found, a budget without an example input, or a budget out of range.
        TypeError: ``units`` of the wrong kind.

    Example:
        >>> import torchvision
        >>> model = torchvision.models.resnet18(num_classes=10)
        >>> plan = checkpoint_blocks(model)
        >>> plan.blocks[:2], plan.candidates
        (['layer1.0', 'layer1.1'], 8)
    """
    found = find_units(model, units)
    if memory_budget is None:
        changed = apply_checkpointing(found, bn_correct)
        return CheckpointPlan(blocks=[n for n, _ in found if n in changed], candidates=len(found))
    if example_input is None:
        raise ValueError("`memory_budget` needs `example_input`, a real batch to measure the blocks on")
    if isinstance(memory_budget, float) and not 0 < memory_budget <= 1:
        raise ValueError(f"`memory_budget` as a fraction must be in (0, 1], got {memory_budget!r}")
    if any(is_checkpointed(m) for _, m in found):
        warnings.warn("the model is already checkpointed; applying twice changes nothing", UserWarning, stacklevel=2)
        return CheckpointPlan(blocks=[], candidates=len(found))
    meter = _StepMeter(model, example_input, loss_fn or _default_loss)
    baseline = meter.peak()
    if isinstance(memory_budget, float):
        budget = int(baseline * memory_budget)
    else:
        budget = parse_bytes(memory_budget, "memory_budget")
    profiles = meter.profile(found)
    chosen, predicted = choose_blocks(profiles, baseline, budget)
    modules = dict(found)
    order = [p for p in profiles if p not in chosen]
    order.sort(key=lambda p: -p.saving / max(p.forward_ms, 1e-6))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        apply_checkpointing([(p.name, modules[p.name]) for p in chosen], bn_correct)
        measured = meter.peak()
        while measured > budget and order:  # the prediction was optimistic: add the next best block and measure
            nxt = order.pop(0)
            chosen.append(nxt)
            apply_checkpointing([(nxt.name, modules[nxt.name])], bn_correct)
            measured = meter.peak()
        if measured <= budget:  # the prediction was cautious: give back the least valuable blocks that fit without
            for block in sorted(chosen, key=lambda p: p.saving / max(p.forward_ms, 1e-6)):
                remove_checkpointing(modules[block.name])
                trial = meter.peak()
                if trial <= budget:
                    chosen.remove(block)
                    measured = trial
                else:
                    apply_checkpointing([(block.name, modules[block.name])], bn_correct)
    names = {p.name for p in chosen}
    plan = CheckpointPlan(
        blocks=[n for n, _ in found if n in names],
        candidates=len(found),
        baseline_bytes=baseline,
        budget_bytes=budget,
        predicted_bytes=predict_peak(baseline, chosen),
        measured_bytes=measured,
        profiles=profiles,
    )
    if not plan.held:
        warnings.warn(
            f"memory budget not met with every block checkpointed: {plan.summary()}", UserWarning, stacklevel=2
        )
    return plan


def checkpoint_resnet(
    model: nn.Module,
    memory_budget: float | int | str | None = None,
    example_input: Any = None,
    bn_correct: bool = True,
) -> CheckpointPlan:
    """Checkpoint a torchvision ResNet (resnet18..152, ResNeXt, Wide ResNet) block by block, in place.

    See :func:`checkpoint_blocks` for the budget and the BatchNorm handling.

    Raises:
        TypeError: if ``model`` is not a torchvision ResNet.

    Example:
        >>> import torchvision
        >>> plan = checkpoint_resnet(torchvision.models.resnet50(num_classes=10))
        >>> len(plan.blocks)
        16
    """
    import torchvision

    if not isinstance(model, torchvision.models.ResNet):
        raise TypeError(
            f"checkpoint_resnet needs a torchvision ResNet, got {type(model).__name__}; use checkpoint_blocks(model,"
            " units=...) for other block-structured models"
        )
    from torchvision.models.resnet import BasicBlock, Bottleneck

    return checkpoint_blocks(
        model,
        units={BasicBlock, Bottleneck},
        memory_budget=memory_budget,
        example_input=example_input,
        bn_correct=bn_correct,
    )
