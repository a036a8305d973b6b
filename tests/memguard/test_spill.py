"""Spill detection, actions and prevention with real Trainers on the CPU, under the emulator."""

from __future__ import annotations

import os
import random
import types

import pytest
import torch
from conftest import FakeProbe, TinyModel, trainer_kwargs
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from models import GrowingClassifier, small_classifier

from lightning_memguard import MemGuard, SysmemSpillError
from lightning_memguard.testing import ImageClassifier, SysmemSpillEmulator

WARMUP = 3


def measured_need(model_factory, steps: int = 2) -> int:
    """Peak of a run on an emulated card too large to spill: what the model needs."""
    emu = SysmemSpillEmulator(capacity="1TB")
    trainer = Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[emu],
    )
    trainer.fit(model_factory())
    assert emu.total_spilled_bytes == 0
    return emu.probe.read().peak_allocated


class VirtualTime:
    """Host time that passes only when told: ``tick`` seconds at every read of the clock (MemGuard reads it once a
    batch), plus whatever the emulator's transfers and the dataloader's stalls "sleep". No test waits on it, and a
    busy machine changes nothing."""

    def __init__(self, tick: float = 0.01) -> None:
        self.tick = tick
        self.now = 0.0

    def clock(self) -> float:
        self.now += self.tick
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class StepAtStop(Callback):
    def __init__(self):
        self.steps: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.steps.append(trainer.global_step)


# ---------------------------------------------------------------- the emulator itself


def test_emulator_charges_a_spill_in_proportion_to_the_steps_own_time_on_the_cpu():
    """With `spill_cost`, the CPU's spill costs what it would on a card relative to the step: a step that took 0.2 s
    and spilled half of the bytes it saved sleeps 2 x 10 x 0.2 x 0.5 = 2 s more, an 11x slower step, whatever the
    CPU's speed; a step that spilled nothing sleeps not at all."""
    now, slept = [100.0], []

    def clock():
        return now[0]

    def sleep(seconds):
        slept.append(seconds)
        now[0] += seconds

    x = torch.randn(512, 1024, requires_grad=True)  # 2 MB
    emu = SysmemSpillEmulator(
        capacity=3 * 2**20, sleep=sleep, spill_cost=10, clock=clock
    )  # room for one of the two activations
    with emu:
        a, b = x * 2, x * 3  # each saved by the products below, and a 2 MB activation
        now[0] += 0.2  # the step's own compute
        (a * a + b * b).sum().backward()
    assert emu.spilled_bytes == 2 * 2**20
    assert slept == [pytest.approx(2.0)]
    with SysmemSpillEmulator(capacity="1GB", sleep=slept.append, spill_cost=10, clock=clock):
        (x * 2).pow(2).sum().backward()
    assert len(slept) == 1


def test_emulator_charges_transfer_time_both_ways_on_the_cpu():
    slept: list[float] = []
    emu = SysmemSpillEmulator(capacity="1MB", bandwidth="1GB", sleep=slept.append)
    x = torch.randn(1024, 1024, requires_grad=True)
    with emu:
        y = x * 2  # a 4 MB activation; `y * y` saves it twice
        (y * y).sum().backward()
    assert emu.spilled_bytes == 4 * 2**20
    # out once in forward; each of the two uses in backward brings it back
    assert slept == [pytest.approx(4 * 2**20 / 1e9)] * 3
    reading = emu.probe.read()
    assert reading.capacity == 10**6 and reading.peak_allocated == 4 * 2**20
    torch.testing.assert_close(x.grad, 8 * x.detach())  # d/dx (2x)^2: unchanged by the detour


def test_emulator_leaves_parameters_and_their_views_alone():
    slept: list[float] = []
    emu = SysmemSpillEmulator(capacity=1, sleep=slept.append)
    layer = torch.nn.Linear(64, 64)
    x = torch.randn(8, 64)
    with emu:
        layer(x).sum().backward()  # saves the input and a transposed view of the weight
    assert slept == [] and emu.spilled_bytes == 0  # input and weight exist before the step: not activations
    with emu:
        out = layer(torch.relu(x * 1.0).requires_grad_())
        torch.relu(out).sum().backward()
    assert emu.spilled_bytes > 0  # the ReLU output is an activation and spills
    assert layer.weight.grad is not None


def test_emulator_below_capacity_spills_nothing():
    slept: list[float] = []
    emu = SysmemSpillEmulator(capacity="1GB", sleep=slept.append)
    x = torch.randn(256, 256, requires_grad=True)
    with emu:
        y = x * 2
        (y * y).sum().backward()
    assert emu.spilled_bytes == 0 and slept == []
    assert 0 < emu.probe.read().peak_allocated < 10**9


def test_emulator_rejects_bad_capacity():
    with pytest.raises(ValueError, match="`capacity` must be .*'16XB'"):
        SysmemSpillEmulator(capacity="16XB")
    with pytest.raises(ValueError, match="`bandwidth` must be a positive size"):
        SysmemSpillEmulator(capacity="16GB", bandwidth=0)


# ---------------------------------------------------------------- a run that spills is stopped


@pytest.fixture(scope="module")
def need() -> int:
    return measured_need(small_classifier)


def test_spill_from_the_start_raises_within_three_steps(tmp_path, need):
    emu = SysmemSpillEmulator(capacity=int(need * 0.8))
    guard = MemGuard(probe=emu.probe, warmup_steps=WARMUP)
    seen = StepAtStop()
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=3, callbacks=[emu, guard, seen]))
    with pytest.raises(SysmemSpillError, match="spilling into system RAM.*batch size 8") as info:
        trainer.fit(small_classifier())
    assert trainer.global_step <= WARMUP + 3
    assert info.value.report is not None and info.value.report.used_bytes > info.value.report.capacity
    assert "Prefer No Sysmem Fallback" in str(info.value)


def test_on_spill_stop_ends_fit_cleanly(tmp_path, need):
    emu = SysmemSpillEmulator(capacity=int(need * 0.8))
    guard = MemGuard(probe=emu.probe, on_spill="stop", warmup_steps=WARMUP)
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=3, callbacks=[emu, guard]))
    with pytest.warns(RuntimeWarning, match="spilling into system RAM.*\n(.*\n)*MemGuard stopped the Trainer"):
        trainer.fit(small_classifier())
    assert trainer.should_stop and trainer.state.finished
    assert trainer.global_step <= WARMUP + 4  # the batch in flight when stopping completes
    assert guard.spill is not None


def test_on_spill_warn_warns_once_and_trains_on(tmp_path, need):
    time = VirtualTime()
    emu = SysmemSpillEmulator(capacity=int(need * 0.8), sleep=time.sleep)
    guard = MemGuard(probe=emu.probe, on_spill="warn", clock=time.clock)
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=2, callbacks=[emu, guard]))
    with pytest.warns(RuntimeWarning, match="spilling into system RAM") as record:
        trainer.fit(small_classifier())
    assert len([w for w in record if "spilling" in str(w.message)]) == 1
    assert trainer.global_step == 24


def test_spill_after_progress_saves_a_checkpoint_that_resumes(tmp_path):
    def grow(**kw):
        return GrowingClassifier("resnet18", image_size=32, batch_size=8, steps_per_epoch=12, pool_size=16, **kw)

    small, large = measured_need(grow), measured_need(lambda: grow(grow_at=0))
    # a step takes 10 ms of virtual time; from step 16 the spilled activations' transfers (tens of MB at 1 GB/s)
    # add several times that, whatever this machine's own speed
    time = VirtualTime(tick=0.01)
    emu = SysmemSpillEmulator(capacity=(small + large) // 2, bandwidth="1GB", sleep=time.sleep)
    guard = MemGuard(probe=emu.probe, warmup_steps=2, reference_steps=3, clock=time.clock)
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=3, callbacks=[emu, guard]))
    with pytest.raises(SysmemSpillError) as info:
        trainer.fit(grow(grow_at=16))
    stopped_at = trainer.global_step
    assert 16 < stopped_at <= 16 + 3
    path = info.value.checkpoint_path
    assert path is not None and os.path.exists(path) and path in str(info.value)

    ckpt = torch.load(path, weights_only=False)
    assert ckpt["global_step"] == stopped_at
    resumed = Trainer(**trainer_kwargs(tmp_path, max_epochs=3, callbacks=[MemGuard()]))
    model = grow()
    resumed.fit(model, ckpt_path=path)
    assert resumed.global_step == 36  # 3 epochs of 12, continuing from the saved step
    assert resumed.state.finished


# ---------------------------------------------------------------- a healthy run is never stopped


class Jitter(Callback):
    """Dataloader stalls: every few batches, a pause of several step times (of virtual time)."""

    def __init__(self, sleep, every: int = 5, pause: float = 0.05, seed: int = 0):
        self.sleep, self.every, self.pause, self.rng = sleep, every, pause, random.Random(seed)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx % self.every == self.every - 1:
            self.sleep(self.pause * self.rng.uniform(1.0, 3.0))


@pytest.mark.parametrize(
    ("factory", "margin"),
    [
        (lambda: small_classifier(batch_size=4), 1.3),
        (lambda: small_classifier(batch_size=16, val_steps=2), 1.02),  # within the headroom: suspect at most
        (lambda: small_classifier(arch="resnext50_32x4d", image_size=16, batch_size=4, steps_per_epoch=8), 1.2),
        (lambda: TinyModel(batch_size=8, n=256), 1.02),
    ],
    ids=["resnet18-b4", "resnet18-b16-val-near-capacity", "resnext50-b4", "mlp-near-capacity"],
)
def test_no_false_alarm_with_validation_checkpoints_and_jitter(tmp_path, factory, margin):
    capacity = int(measured_need(factory) * margin)
    time = VirtualTime(tick=0.01)  # stalls of 5 to 15 steps' time every 5th batch, validation and checkpoints
    emu = SysmemSpillEmulator(capacity=capacity, sleep=time.sleep)
    guard = MemGuard(probe=emu.probe, warmup_steps=2, reference_steps=3, clock=time.clock)
    checkpoints = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1)
    trainer = Trainer(
        **trainer_kwargs(
            tmp_path,
            max_epochs=3,
            enable_checkpointing=True,
            limit_val_batches=2,
            val_check_interval=0.5,
            callbacks=[emu, guard, Jitter(time.sleep), checkpoints],
        )
    )
    trainer.fit(factory())
    assert trainer.state.finished and not trainer.should_stop
    assert guard.spill is None
    assert emu.total_spilled_bytes == 0


# ---------------------------------------------------------------- preflight, platform, prevention (CPU twins)


def test_preflight_reports_fallback_on_an_emulated_card(tmp_path):
    emu = SysmemSpillEmulator(capacity="1TB")
    guard = MemGuard(probe=emu.probe, preflight=True)
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[emu, guard]))
    with pytest.warns(RuntimeWarning, match="preflight: allocating more GPU memory than the card has succeeded"):
        trainer.fit(TinyModel())
    assert guard.fallback_enabled is True
    assert guard.state_dict()["fallback_enabled"] is True


def test_windows_notice_once(monkeypatch):
    import lightning_memguard.callbacks._prevention as prevention

    monkeypatch.setattr(prevention.platform, "system", lambda: "Windows")
    probe = FakeProbe()
    probe.driver_info = lambda: {"driver_model": "WDDM", "driver_version": "560.94"}
    with pytest.warns(UserWarning, match="under a WDDM driver.*Prefer No Sysmem Fallback"):
        prevention.notice_platform(probe)
    probe.driver_info = lambda: {"driver_model": "TCC", "driver_version": "560.94"}
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prevention.notice_platform(probe)


def test_prevent_caps_the_allocator_and_explains_the_oom(monkeypatch):
    calls = []
    props = types.SimpleNamespace(total_memory=141 * 10**9)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d=None: calls.append(f))
    guard = MemGuard(capacity="16GB", prevent=True)
    guard._cap.apply(torch.device("cuda", 0), 16 * 10**9, FakeProbe(other=10**9))
    assert calls == [pytest.approx((15 * 10**9 - 512 * 2**20) / (141 * 10**9))]  # less others and the margin
    err = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    trainer = types.SimpleNamespace(strategy=types.SimpleNamespace(root_device=torch.device("cuda", 0)))
    guard.on_exception(trainer, None, err)
    assert str(err).startswith("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert "MemGuard(prevent=True) capped PyTorch" in str(err) and "instead of spilling" in str(err)
    assert calls[-1] == 1.0  # lifted: Lightning calls no teardown after an exception
    guard.teardown(trainer, None, "fit")
    assert calls.count(1.0) == 1


def test_prevent_with_no_memory_left_is_a_clear_error(monkeypatch):
    props = types.SimpleNamespace(total_memory=16 * 10**9)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    guard = MemGuard(prevent=True)
    with pytest.raises(ValueError, match="`prevent=True` leaves no memory"):
        guard._cap.apply(torch.device("cuda", 0), 16 * 10**9, FakeProbe(other=16 * 10**9))


def test_image_classifier_rejects_unknown_model():
    with pytest.raises(ValueError, match="`arch` must be a torchvision classification model name, got 'resnet9000'"):
        ImageClassifier("resnet9000")
