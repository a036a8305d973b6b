"""Which modules hold a training step's memory: one forward and backward measured under saved-tensor hooks.

Every tensor autograd saves for the backward pass goes into the one ledger of saved tensors
(:mod:`lightning_memguard._ledger`, kept by the planner's measurement and the spill emulator too): each storage counted
once and whole, and charged to the innermost modules whose forward was running when views of it were saved, each its own
bytes first, the rest in proportion; what is kept for backward out of the hooks' sight (a selective checkpoint's cache:
the pointwise lever's) is handed to it by the ledger (:func:`~lightning_memguard._ledger.counting_unseen`), charged to
the module whose forward keeps it. The modules' stack is kept by forward pre-hooks and forward hooks registered on every
submodule for the measured step only, and removed in ``finally``. Parameters, autocast's low-precision copies of them,
the buffers and the batch (where the caller names it) existed before the step: they are not activations, and are left
out. At each module's forward end the running total is noted (on CUDA with ``torch.cuda.memory_allocated()``, a host
counter that does not synchronise): the timeline of the step that the report draws.

Nothing here runs during training that is not measured: the hooks exist only inside :class:`SavedTensorRecorder`.
Torch only, no Lightning; the callback hands in the step to measure.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_memguard import _autograd
from lightning_memguard._ledger import Ledger, counting_unseen, storage_bytes, tensors_in


@dataclass
class Forward:
    """What one forward pass saved for its backward: bytes by module, and the events in the order saved.

    Attributes:
        saved: bytes charged to each module (the innermost running; ``""`` for code outside every module: the loss);
            they sum to the bytes of every storage saved, each once and whole (``lightning_memguard._ledger``).
        events: ``(module, bytes)`` as saved, in order (:meth:`~lightning_memguard._ledger.Ledger.timeline`).
        marks: ``(module, events so far, allocated)`` at each module's forward end: the timeline's points.
        samples: samples in the batch (or micro-batch) this forward ran on, where the caller knows them.
    """

    saved: dict[str, int] = field(default_factory=dict)
    events: list[tuple[str, int]] = field(default_factory=list)
    marks: list[tuple[str, int, int | None]] = field(default_factory=list)
    samples: int | None = None

    @property
    def total(self) -> int:
        return sum(self.saved.values())


class SavedTensorRecorder:
    """A context manager around forward passes (each ``with`` one :class:`Forward`): module hooks on every
    submodule of ``model`` and saved-tensor hooks that hand each tensor on to the hooks already in force (the spill
    emulator's, a checkpoint's), so recording changes nothing the step computes or keeps. ``with recorder.on(batch)``
    names the forward's batch: its tensors existed before the step, and are not activations.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 2))
        >>> recorder = SavedTensorRecorder(model)
        >>> with recorder:
        ...     model(torch.randn(8, 4)).sum().backward()
        >>> sorted(recorder.largest().saved)  # the input saved by the first Linear, the ReLU's output
        ['0', '1']
    """

    def __init__(self, model: nn.Module, names: dict[nn.Module, str] | None = None, modules: bool = True) -> None:
        self.model = model
        self.modules = modules  # False: no module hooks (a compiled graph runs them as it is traced, not as it runs)
        self.names = names if names is not None else {m: n for n, m in model.named_modules()}
        self.forwards: list[Forward] = []
        self._stack: list[str] = []
        self._ledger: Ledger[str] = Ledger()  # the forward's saved tensors
        self._batch: Any = None  # the next forward's batch (:meth:`on`)
        self._handles: list[Any] = []
        self._saved_hooks: Any = None
        self._unseen: Any = None  # the ledger's count of what the hooks do not see
        self._cuda = False

    def on(self, batch: Any) -> SavedTensorRecorder:
        """The next ``with`` records a forward on ``batch`` (a tensor, or a structure of them): not activations."""
        self._batch = batch
        return self

    def __enter__(self) -> SavedTensorRecorder:
        existing = [*self.model.parameters(), *self.model.buffers(), *tensors_in(self._batch)]
        self._ledger = Ledger(existing)
        self._batch = None
        self._stack = []
        self._cuda = any(p.device.type == "cuda" for p in self.model.parameters()) and torch.cuda.is_available()
        self.forwards.append(Forward())
        try:
            for module, name in self.names.items() if self.modules else ():
                if module is self.model:
                    continue
                self._handles.append(module.register_forward_pre_hook(self._pre_hook(name)))
                self._handles.append(module.register_forward_hook(self._post_hook(name), always_call=True))
            outer = _autograd.saved_tensors_hooks_in_force()
            self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(*self._saved_pair(outer))
            self._saved_hooks.__enter__()
            self._unseen = counting_unseen(self._count, hand_on=True)  # as its hooks, hands on to the counts outside
            self._unseen.__enter__()
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._remove()
        forward, ledger = self.forwards[-1], self._ledger
        forward.saved = {module: size for module, size in ledger.shares().items() if size}
        forward.events = ledger.timeline()

    def _remove(self) -> None:
        if self._unseen is not None:
            unseen, self._unseen = self._unseen, None
            unseen.__exit__(None, None, None)
        if self._saved_hooks is not None:
            hooks, self._saved_hooks = self._saved_hooks, None
            hooks.__exit__(None, None, None)
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def largest(self) -> Forward:
        """The forward pass that saved most (one per ``with``: a batch's largest micro-batch)."""
        return max(self.forwards, key=lambda f: f.total, default=Forward())

    # ------------------------------------------------------------------ hooks

    def _pre_hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if not _autograd.in_backward():  # a checkpoint's recomputation is not the forward
                self._stack.append(name)

        return hook

    def _post_hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if _autograd.in_backward():
                return
            if self._stack and self._stack[-1] == name:
                self._stack.pop()
            allocated = torch.cuda.memory_allocated() if self._cuda else None
            self.forwards[-1].marks.append((name, len(self._ledger.events), allocated))

        return hook

    def _saved_pair(self, outer: _autograd.Hooks | None) -> _autograd.Hooks:
        def pack(tensor: torch.Tensor) -> Any:
            self._count(tensor)
            return _autograd.hand_on(tensor, outer)

        return pack, _autograd.handed_back

    def _count(self, tensor: torch.Tensor) -> None:
        if not _autograd.in_backward():  # a checkpoint's recomputation is not the forward
            self._ledger.save(tensor, self._stack[-1] if self._stack else "")


@dataclass
class StepMemory:
    """A measured step's memory, in bytes.

    Attributes:
        weights: the model's parameters.
        gradients: the parameters' gradients after the backward (or, where none were kept, the trainable ones').
        optimizer: the tensors of the optimizers' state.
        activations: what the forward saved for the backward (the largest micro-batch's, times ``scale``).
        peak: the step's peak: measured on CUDA (``torch.cuda.max_memory_allocated``), else the sum of the parts.
        peak_measured: whether ``peak`` was measured (CUDA) rather than summed.
        forward: the largest forward pass's record.
        classes: each module's class name.
        blocks: the model's blocks as ``checkpoint_blocks`` finds them (empty where it finds none).
        vocabularies: names of ``nn.Linear`` modules with at least 32k outputs (a vocabulary's logits).
        scale: the activations measured on a part of the batch were multiplied by this (1: the whole batch).
        samples: samples in the measured batch (or part), where known.
        device: where the step ran.
        compiled: the model ran compiled: its graph saves its tensors as one, and modules are not told apart.
        plain: the names are those of a plain ``nn.Module`` (not a LightningModule's): its blocks are checkpointed
            with ``checkpoint_blocks(model, units=...)``.
    """

    weights: int
    gradients: int
    optimizer: int
    activations: int
    peak: int
    peak_measured: bool
    forward: Forward
    classes: dict[str, str]
    blocks: list[str]
    vocabularies: list[str]
    scale: float = 1
    samples: int | None = None
    device: str = "cpu"
    compiled: bool = False
    plain: bool = False


OUTSIDE_LABEL = "(outside any module: the loss)"  # how reports name code outside every module
MODEL_LABEL = "(the model)"  # how reports name a wrapped model's own forward, outside its submodules
VOCABULARY = 32_000  # a Linear with this many outputs or more computes a vocabulary's logits


def model_facts(model: nn.Module) -> tuple[dict[str, str], list[str], list[str]]:
    """Each module's class, the blocks ``checkpoint_blocks`` would find, and the vocabulary-sized Linear layers."""
    from lightning_memguard.checkpointing.families import find_units

    classes = {name: type(m).__name__ for name, m in model.named_modules()}
    try:
        blocks = [name for name, _ in find_units(model)]
    except (ValueError, TypeError):
        blocks = []
    vocabularies = [
        name for name, m in model.named_modules() if isinstance(m, nn.Linear) and m.out_features >= VOCABULARY
    ]
    return classes, blocks, vocabularies


def inside(memory: StepMemory, prefix: str) -> StepMemory:
    """``memory`` named as the model at ``prefix`` names its modules, for a model a wrapper holds (``memguard sweep``
    wraps a plain model as its LightningModule's ``net``): ``net.layer1.0`` is ``layer1.0``, ``net`` itself
    :data:`MODEL_LABEL`, the wrapper's own code (the loss) outside every module; the fixes then call
    ``checkpoint_blocks(model, ...)`` on it.

    Example:
        >>> memory = StepMemory(0, 0, 0, 8, 8, False, Forward({"net.layer1.0": 8}, [("net.layer1.0", 8)]),
        ...     {"": "Wrapper", "net": "ResNet", "net.layer1.0": "BasicBlock"}, ["net.layer1.0"], [])
        >>> moved = inside(memory, "net")
        >>> moved.forward.saved, moved.blocks, moved.classes[MODEL_LABEL], moved.plain
        ({'layer1.0': 8}, ['layer1.0'], 'ResNet', True)
    """

    def name(n: str) -> str:
        if n == prefix:
            return MODEL_LABEL
        if n.startswith(prefix + "."):
            return n[len(prefix) + 1 :]
        return "" if n == "" else n

    forward = memory.forward
    saved: dict[str, int] = {}
    for module, size in forward.saved.items():
        saved[name(module)] = saved.get(name(module), 0) + size
    moved = Forward(
        saved, [(name(m), b) for m, b in forward.events], [(name(m), n, a) for m, n, a in forward.marks],
        forward.samples,
    )  # fmt: skip
    classes = {name(n): c for n, c in memory.classes.items() if n == prefix or n.startswith(prefix + ".")}
    return dataclasses.replace(
        memory, forward=moved, classes=classes, blocks=[name(b) for b in memory.blocks],
        vocabularies=[name(v) for v in memory.vocabularies], plain=True,
    )  # fmt: skip


def resting_bytes(model: nn.Module, optimizers: list[Any]) -> tuple[int, int, int]:
    """Weights, gradients (or trainable parameters where no gradient is kept) and optimizer state, in bytes."""
    parameters = list(model.parameters())
    weights = storage_bytes(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    gradients = storage_bytes(grads) if grads else storage_bytes([p for p in parameters if p.requires_grad])
    state: list[torch.Tensor] = []
    for optimizer in optimizers:
        for entry in getattr(optimizer, "state", {}).values():
            if isinstance(entry, dict):
                state.extend(v for v in entry.values() if isinstance(v, torch.Tensor))
    return weights, gradients, storage_bytes(state)


@contextlib.contextmanager
def step_undone(model: nn.Module) -> Iterator[None]:
    """A measured step leaves no trace: the gradients (the same tensors, put back), the buffers (BatchNorm's
    statistics) and the random number generators (of the CPU and the model's CUDA devices) as they were."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    grads = [(p, p.grad) for p in model.parameters()]
    cuda = sorted({t.device.index or 0 for t in [*model.parameters(), *model.buffers()] if t.device.type == "cuda"})
    for p, _ in grads:
        p.grad = None
    try:
        with torch.random.fork_rng(devices=cuda):
            yield
    finally:
        with torch.no_grad():
            for b, kept in buffers:
                b.copy_(kept)
        for p, grad in grads:
            p.grad = grad


def measure_step(
    model: nn.Module,
    run: Callable[[], Any],
    optimizers: list[Any] | None = None,
    scale: float = 1,
    samples: int | None = None,
    compiled: bool = False,
    batch: Any = None,
) -> StepMemory:
    """One forward (``run()``, returning the loss or a dict with ``"loss"``) and its backward, measured, then undone
    (:func:`step_undone`): the model's gradients, buffers and generators are as before. ``batch``: what ``run``
    trains on (a tensor or a structure of them), which existed before the step: not activations.

    On CUDA the allocator's peak is reset for the step (the caller resets or reads its own peak around it).
    ``scale``: the batch measured is a ``1/scale`` part of the one that ran (after an out-of-memory error): the
    activations are multiplied by it.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 2))
        >>> memory = measure_step(model, lambda: model(torch.randn(8, 4)).sum())
        >>> memory.activations == memory.forward.total, memory.peak == memory.weights * 2 + memory.activations
        (True, True)
        >>> all(p.grad is None for p in model.parameters())
        True
    """
    optimizers = optimizers or []
    classes, blocks, vocabularies = model_facts(model)
    cuda = any(p.device.type == "cuda" for p in model.parameters()) and torch.cuda.is_available()
    device = next((str(p.device) for p in model.parameters()), "cpu")
    recorder = SavedTensorRecorder(model, modules=not compiled)
    with step_undone(model):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        with recorder.on(batch):
            output = run()
        loss = output.get("loss") if isinstance(output, dict) else output
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            loss.backward()
        del output, loss
        weights, gradients, optimizer = resting_bytes(model, optimizers)
        peak = torch.cuda.max_memory_allocated() if cuda else None
    forward = recorder.largest()
    memory = assemble(
        forward, weights, gradients, optimizer, peak, classes, blocks, vocabularies, scale, samples, device
    )
    memory.compiled = compiled
    return memory


def assemble(
    forward: Forward,
    weights: int,
    gradients: int,
    optimizer: int,
    peak: int | None,
    classes: dict[str, str],
    blocks: list[str],
    vocabularies: list[str],
    scale: float = 1,
    samples: int | None = None,
    device: str = "cpu",
) -> StepMemory:
    """The figures of a step put together: activations scaled, the peak the measured one or the sum of the parts."""
    if scale > 1:
        forward = Forward(
            {k: round(v * scale) for k, v in forward.saved.items()},
            [(m, round(b * scale)) for m, b in forward.events],
            [(m, n, a) for m, n, a in forward.marks],
            forward.samples,
        )
    activations = forward.total
    parts = weights + gradients + optimizer + activations
    measured = peak is not None and scale == 1
    return StepMemory(
        weights, gradients, optimizer, activations, peak if measured and peak is not None else parts,
        measured, forward, classes, blocks, vocabularies, scale, samples, device,
    )  # fmt: skip
