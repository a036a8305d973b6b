"""The spill emulator under torch.compile, on the CPU with ``backend="aot_eager"``: a compiled model spills as the
same model does in eager mode, MemGuard stops it, and a compiled model that fits (recompiles included) does not."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch
from conftest import TinyModel, trainer_kwargs
from lightning.pytorch import Callback, LightningModule, Trainer
from torch._dynamo.eval_frame import OptimizedModule

from lightning_memguard import MemGuard, SysmemSpillError, _compiler
from lightning_memguard.testing import ImageClassifier, SysmemSpillEmulator

BACKEND = "aot_eager"  # inductor on the CPU needs a C++ compiler and a minute per model; the logic is the same
BANDWIDTH = 1e9


class Clock:
    """Virtual host time: ``tick`` seconds a read (MemGuard reads once a batch) plus what the emulator sleeps."""

    def __init__(self, tick: float = 0.01) -> None:
        self.tick, self.now, self.slept = tick, 0.0, 0.0

    def clock(self) -> float:
        self.now += self.tick
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.slept += seconds


class RanCompiled(Callback):
    """Whether each training step's loss came through a compiled graph (dynamo did not fall back to eager)."""

    def __init__(self) -> None:
        self.steps: list[bool] = []

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        self.steps.append(_compiler.ran_compiled(loss))


def resnet(**kw) -> ImageClassifier:
    return ImageClassifier("resnet18", image_size=32, batch_size=8, steps_per_epoch=kw.pop("steps", 12), **kw)


def mlp(n: int = 256) -> LightningModule:
    return TinyModel(batch_size=64, n=n)


def compile_model(model: LightningModule) -> LightningModule:
    """As users compile: the whole LightningModule (Lightning runs its compiled forward) or, for a module whose
    training step does not call its forward, the network inside."""
    if type(model).forward is LightningModule.forward:
        model.net = torch.compile(model.net, backend=BACKEND)  # type: ignore[assignment]
        return model
    return torch.compile(model, backend=BACKEND)  # type: ignore[return-value]


def fit(model: LightningModule, tmp_path, *callbacks, **overrides) -> Trainer:
    """A short CPU run; where the model is compiled, every step must have run its compiled graph."""
    ran = RanCompiled()
    trainer = Trainer(**trainer_kwargs(tmp_path, **{"max_epochs": 1, "callbacks": [*callbacks, ran], **overrides}))
    trainer.fit(model)
    compiled = isinstance(model, OptimizedModule) or isinstance(getattr(model, "net", None), OptimizedModule)
    assert ran.steps and all(ran.steps) == compiled and any(ran.steps) == compiled
    return trainer


def everything_spills(factory, compiled: bool, tmp_path) -> tuple[int, int, float]:
    """On a card of one byte every saved activation spills: (the last step's saved bytes, the probe's peak, the
    seconds charged for transfers)."""
    clock = Clock()
    emu = SysmemSpillEmulator(capacity=1, bandwidth=BANDWIDTH, sleep=clock.sleep)
    model = factory()
    fit(compile_model(model) if compiled else model, tmp_path, emu, max_steps=2)
    return emu.spilled_bytes, emu.probe.read().peak_allocated, clock.slept


@pytest.fixture(scope="module", autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    """This file's models compile once (a new instance of the same model reuses the graph); other files start anew."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# ---------------------------------------------------------------- a compiled model's activations spill


@pytest.mark.parametrize(
    ("factory", "excess"),
    [(mlp, 0.0), (lambda: resnet(steps=2), 0.25)],
    ids=["mlp-same-bytes", "resnet18-within-25pct"],
)
def test_compiled_activations_spill_as_in_eager(tmp_path, factory, excess):
    eager, eager_peak, _ = everything_spills(factory, False, tmp_path)
    compiled, compiled_peak, slept = everything_spills(factory, True, tmp_path)
    assert eager > 0 and compiled > 0
    # A compiled graph saves what eager ops save, as the ledger counts them (max-pooling indices, BatchNorm's batch
    # statistics and the input made in the step included): nothing more for the MLP, 1 % more for this ResNet-18.
    assert eager <= compiled <= eager * (1 + excess)
    assert compiled_peak - compiled == eager_peak - eager  # the same base: weights, gradients, optimizer state
    # every spilled byte went out in forward and came back in backward (some are read twice): charged both ways
    assert slept >= 2 * 2 * compiled / BANDWIDTH * (1 - 1e-9)  # two steps


def test_compiled_function_spills_under_the_context_manager():
    slept: list[float] = []
    emu = SysmemSpillEmulator(capacity="100KB", bandwidth="1GB", sleep=slept.append)
    w = torch.randn(256, 256, requires_grad=True)

    def step(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ w).square().sum()  # saves the ReLU output (256 KB at 256 x 256)

    compiled = torch.compile(step, backend=BACKEND)
    x = torch.randn(256, 256)
    for fn in (step, compiled):
        w.grad = None
        with emu:
            fn(x).backward()
        assert emu.spilled_bytes > 0 and emu.probe.read().peak_allocated > emu.capacity
        grad = w.grad
    torch.testing.assert_close(grad, x.T @ (2 * torch.relu(x @ w.detach())))  # unchanged by the round trip
    assert len(slept) >= 4  # each of the two runs: out in forward, back in backward


# ---------------------------------------------------------------- MemGuard stops a compiled run as an eager one


@pytest.fixture(scope="module")
def eager_activations(tmp_path_factory) -> tuple[int, int]:
    """The ResNet-18's saved activations a step in eager mode, and its peak."""
    activations, peak, _ = everything_spills(lambda: resnet(steps=2), False, tmp_path_factory.mktemp("need"))
    return activations, peak


@pytest.fixture(scope="module")
def half_the_activations(eager_activations) -> int:
    """A capacity between what the ResNet-18 holds before a step and its peak: half its activations spill."""
    activations, peak = eager_activations
    return peak - activations // 2


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_memguard_stops_a_spilling_compiled_run_as_an_eager_one(
    tmp_path, eager_activations, half_the_activations, compiled
):
    clock = Clock()
    emu = SysmemSpillEmulator(capacity=half_the_activations, sleep=clock.sleep)
    guard = MemGuard(probe=emu.probe, warmup_steps=3, clock=clock.clock)
    model = resnet()
    with pytest.raises(SysmemSpillError, match="spilling into system RAM.*batch size 8") as info:
        fit(compile_model(model) if compiled else model, tmp_path, emu, guard, max_epochs=3)
    activations, peak = eager_activations
    assert emu.total_spilled_bytes > 0
    report = info.value.report
    assert report is not None and report.used_bytes > report.capacity == half_the_activations
    assert report.used_bytes <= peak + activations // 4  # the step's peak, what the compiled graph saved included


@pytest.mark.parametrize("on_spill", ["stop", "warn"])
def test_memguard_flags_a_compiled_run_that_spills(tmp_path, on_spill):
    activations, peak, _ = everything_spills(mlp, False, tmp_path)
    clock = Clock()
    emu = SysmemSpillEmulator(capacity=peak - activations // 2, sleep=clock.sleep)
    guard = MemGuard(probe=emu.probe, on_spill=on_spill, warmup_steps=2, clock=clock.clock)
    with pytest.warns(RuntimeWarning, match="spilling into system RAM"):
        trainer = fit(compile_model(mlp(n=64 * 8)), tmp_path, emu, guard)
    assert guard.spill is not None and emu.total_spilled_bytes > 0
    assert trainer.should_stop == (on_spill == "stop")


# ---------------------------------------------------------------- a compiled model that fits is left alone


def test_compiled_model_that_fits_is_not_spilling_across_recompiles(tmp_path):
    """A short last batch and validation make dynamo compile again mid-run: no spill, no alarm. (The MLP saves the
    same bytes compiled as in eager mode, so an eager run measures what it needs.)"""
    factory = lambda: mlp(n=64 * 3 + 32)  # noqa: E731  batches of 64, 64, 64 and 32
    probe_run = SysmemSpillEmulator(capacity="1TB")
    fit(factory(), tmp_path, probe_run, max_epochs=2, limit_val_batches=1)
    need = probe_run.probe.read().peak_allocated

    torch._dynamo.reset()  # compile within the measured run
    clock = Clock()
    emu = SysmemSpillEmulator(capacity=int(need * 1.02), sleep=clock.sleep)
    guard = MemGuard(probe=emu.probe, warmup_steps=2, reference_steps=2, clock=clock.clock)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*(spilling|cannot see)")
        trainer = fit(compile_model(factory()), tmp_path, emu, guard, max_epochs=2, limit_val_batches=1)
    assert trainer.state.finished and not trainer.should_stop and trainer.global_step == 8
    assert _compiler.compiles() >= 3  # batch 64, batch 32, validation: the recompiles did happen
    assert guard.spill is None and emu.total_spilled_bytes == 0
    assert emu.probe.read().peak_allocated == need  # every activation counted, within 2 % of the capacity


# ---------------------------------------------------------------- never a silent 0


def test_activations_the_emulator_cannot_see_are_a_warning_not_zero(tmp_path, monkeypatch):
    """As if a PyTorch release stopped passing a compiled graph's saved tensors through the hooks."""
    monkeypatch.setattr(_compiler, "saved_by_compiled_graph", lambda: False)
    emu = SysmemSpillEmulator(capacity=1, sleep=lambda s: None)
    with pytest.warns(RuntimeWarning, match="cannot see the activations of the torch.compile'd part") as record:
        fit(compile_model(mlp()), tmp_path, emu, max_steps=3)
    assert len([w for w in record if "cannot see" in str(w.message)]) == 1  # once, at the first step

    with warnings.catch_warnings():  # an eager model in the same process (dynamo has compiled) is not suspected
        warnings.filterwarnings("error", message=".*cannot see")
        fit(mlp(), tmp_path, SysmemSpillEmulator(capacity=1, sleep=lambda s: None), max_steps=2)
