"""MemGuard through the runs users make: the last step of the last epoch, `fast_dev_run`, the same instance in a
second `fit`, several loaders in one batch. Clocks and memory are injected: nothing here depends on this machine's
speed."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import StepClock, TinyModel, trainer_kwargs
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.utilities import CombinedLoader
from torch.utils.data import DataLoader, TensorDataset

from lightning_memguard import MemGuard, SysmemSpillError

# ---------------------------------------------------------------- a spill found at the very end is acted on


class OutgrowAt(Callback):
    """The card's peak goes above its 16 GB at one batch of one epoch (every epoch starts at 1 GB again)."""

    def __init__(self, probe, epoch: int, batch_idx: int) -> None:
        self.probe, self.epoch, self.batch_idx = probe, epoch, batch_idx

    def on_train_epoch_start(self, trainer, pl_module):
        self.probe.peak = 10**9

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if (trainer.current_epoch, batch_idx) == (self.epoch, self.batch_idx):
            self.probe.peak = 17 * 10**9


LAST_STEPS = [
    pytest.param({"fast_dev_run": True}, (0, 0), 1, id="fast_dev_run"),
    pytest.param({"max_epochs": 1, "limit_train_batches": 1}, (0, 0), 1, id="limit_train_batches=1"),
    pytest.param({"max_epochs": 2}, (1, 7), 16, id="outgrown-in-the-last-step"),
    pytest.param({"max_epochs": 3, "max_steps": 20}, (2, 3), 20, id="max_steps-mid-epoch"),
]


@pytest.mark.parametrize(("limits", "at", "steps"), LAST_STEPS)
def test_a_spill_in_the_last_step_raises(tmp_path, fake_probe, limits, at, steps):
    guard = MemGuard(probe=fake_probe, clock=StepClock(0.1), read_every=100)
    trainer = Trainer(**trainer_kwargs(tmp_path, callbacks=[OutgrowAt(fake_probe, *at), guard], **limits))
    with pytest.raises(SysmemSpillError, match="peak 17.00 GB against 16.00 GB") as info:
        trainer.fit(TinyModel(batch_size=8, n=64))
    assert trainer.global_step == steps
    assert info.value.report is not None and info.value.report.step == steps
    assert info.value.checkpoint_path is not None and f"step={steps}" in info.value.checkpoint_path


@pytest.mark.parametrize(("limits", "at", "steps"), LAST_STEPS)
def test_a_spill_in_the_last_step_stops_with_a_warning(tmp_path, fake_probe, limits, at, steps):
    guard = MemGuard(probe=fake_probe, clock=StepClock(0.1), read_every=100, on_spill="stop")
    trainer = Trainer(**trainer_kwargs(tmp_path, callbacks=[OutgrowAt(fake_probe, *at), guard], **limits))
    with pytest.warns(RuntimeWarning, match=r"peak 17.00 GB against 16.00 GB(.*\n)*MemGuard stopped the Trainer"):
        trainer.fit(TinyModel(batch_size=8, n=64))
    assert trainer.should_stop and trainer.global_step == steps
    assert guard.spill is not None and guard.epochs[-1].peak_allocated_gb == pytest.approx(17.0)


def test_a_spill_at_an_earlier_epochs_end_stops_there(tmp_path, fake_probe):
    guard = MemGuard(probe=fake_probe, clock=StepClock(0.1), read_every=100, on_spill="stop")
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=4, callbacks=[OutgrowAt(fake_probe, 1, 7), guard]))
    with pytest.warns(RuntimeWarning, match="MemGuard stopped the Trainer"):
        trainer.fit(TinyModel(batch_size=8, n=64))
    assert trainer.global_step == 16 and [r.epoch for r in guard.epochs] == [0, 1]


# ---------------------------------------------------------------- the same instance in a second fit


def test_a_reused_guard_forgets_the_last_fits_spill_and_table(tmp_path, fake_probe, caplog):
    guard = MemGuard(probe=fake_probe, clock=StepClock(0.1), on_spill="stop")
    fake_probe.peak = 17 * 10**9  # fit 1: the card is too small
    with pytest.warns(RuntimeWarning, match="MemGuard stopped the Trainer"):
        Trainer(**trainer_kwargs(tmp_path, max_epochs=3, callbacks=[guard])).fit(TinyModel(batch_size=8, n=64))
    assert guard.spill is not None and len(guard.epochs) == 1

    fake_probe.peak = 10**9  # fit 2: room to spare
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=2, callbacks=[guard]))
    with caplog.at_level(logging.INFO):
        trainer.fit(TinyModel(batch_size=8, n=64))
    assert not trainer.should_stop and trainer.global_step == 16
    assert guard.spill is None and guard.checkpoint_path is None
    assert [(r.epoch, r.peak_allocated_gb) for r in guard.epochs] == [(0, 1.0), (1, 1.0)]
    table = caplog.text.split("MemGuard: peak memory against throughput")[-1]
    assert "17.00" not in table and table.count(" / 16.00") == 2


def test_a_reused_guard_warns_of_the_second_fits_own_spill(tmp_path, fake_probe):
    guard = MemGuard(probe=fake_probe, clock=StepClock(0.1), on_spill="warn")
    fake_probe.peak = 17 * 10**9
    for _ in range(2):
        trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[guard]))
        with pytest.warns(RuntimeWarning, match="spilling into system RAM") as record:
            trainer.fit(TinyModel(batch_size=8, n=64))
        assert len([w for w in record if "spilling" in str(w.message)]) == 1
        assert guard.spill is not None and trainer.global_step == 8


def test_a_reused_guard_resumed_from_a_checkpoint_keeps_that_checkpoints_history(tmp_path, fake_probe):
    guard = MemGuard(probe=fake_probe, clock=StepClock(0.1), warmup_steps=0, reference_steps=2)
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=2, enable_checkpointing=True, callbacks=[guard]))
    trainer.fit(TinyModel())
    ckpt = trainer.checkpoint_callback.best_model_path
    Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[guard])).fit(TinyModel())  # an unrelated fit
    assert [r.epoch for r in guard.epochs] == [0]

    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=3, callbacks=[guard]))
    trainer.fit(TinyModel(), ckpt_path=ckpt)
    assert [r.epoch for r in guard.epochs] == [0, 1, 2]  # the checkpoint's two epochs, then this fit's
    assert guard._timeline is not None and guard._timeline.detector.reference_rate == pytest.approx(80.0)


# ---------------------------------------------------------------- several loaders in one batch


def _loader(model: TinyModel, batch_size: int) -> DataLoader:
    return DataLoader(TensorDataset(model.x, model.y), batch_size=batch_size)


class TwoLoaders(TinyModel):
    """Batches of 8 from one loader and 4 from another, together in each training batch."""

    def __init__(self, form: str) -> None:
        super().__init__(batch_size=8, n=64)
        self.form = form

    def train_dataloader(self):
        a, b = _loader(self, 8), _loader(self, 4)
        if self.form == "dict":
            return {"a": a, "b": b}
        if self.form == "list":
            return [a, b]
        return CombinedLoader({"a": a, "nested": [b]}, mode="min_size")

    def training_step(self, batch, batch_idx):
        parts = [batch["a"], batch["b"]] if self.form == "dict" else batch if self.form == "list" else None
        if parts is None:
            parts = [batch["a"], batch["nested"][0]]
        x = torch.cat([p[0] for p in parts])
        y = torch.cat([p[1] for p in parts])
        return torch.nn.functional.cross_entropy(self.net(x), y)


@pytest.mark.parametrize("form", ["dict", "list", "combined-nested"])
def test_every_loaders_samples_count(tmp_path, fake_probe, form):
    guard = MemGuard(probe=fake_probe, clock=StepClock(0.1))
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[guard]))
    trainer.fit(TwoLoaders(form))
    assert guard.epochs[0].samples_per_sec == pytest.approx(120.0)  # 8 + 4 samples every 0.1 s


class DictBatches(TinyModel):
    """One loader whose batches are dicts of tensors: its samples are counted once, not once per key."""

    def train_dataloader(self):
        rows = [{"x": x, "y": y} for x, y in zip(self.x, self.y, strict=True)]
        return {"only": DataLoader(rows, batch_size=8)}

    def training_step(self, batch, batch_idx):
        part = batch["only"]
        return torch.nn.functional.cross_entropy(self.net(part["x"]), part["y"])


def test_a_single_loader_of_dict_batches_counts_its_batch_once(tmp_path, fake_probe):
    guard = MemGuard(probe=fake_probe, clock=StepClock(0.1))
    Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[guard])).fit(DictBatches())
    assert guard.epochs[0].samples_per_sec == pytest.approx(80.0)
