"""The tuners in users' own runs: schedules sized by steps, finite streams, stand-in sizes, the batch limit's refusal,
Lightning's learning-rate finder."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from conftest import FakeProbe, TinyModel, trainer_kwargs
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import LearningRateFinder, ModelCheckpoint
from torch.utils.data import DataLoader, IterableDataset
from tuner_helpers import BatchClock, PerSample

from lightning_memguard import AccumulationTuner, BatchSizeTuner
from lightning_memguard.tuning.trials import _check_delivered


class OneCycle(TinyModel):
    """A schedule sized by the run's optimizer steps, as Lightning's docs show it."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        total = self.trainer.estimated_stepping_batches
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1.0, total_steps=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class SeenBatches(Callback):
    """The samples of each batch the run itself trains (the tuners' trials switch other callbacks off)."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.lr_at_first: float | None = None
        self.scheduler_steps_at_first: int | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if not self.sizes and trainer.lr_scheduler_configs:
            self.lr_at_first = trainer.optimizers[0].param_groups[0]["lr"]
            self.scheduler_steps_at_first = trainer.lr_scheduler_configs[0].scheduler.last_epoch
        self.sizes.append(len(batch[0]))


def _fresh_one_cycle_lr() -> float:
    optimizer = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1.0, total_steps=8)
    return optimizer.param_groups[0]["lr"]


def _at_end_of_its_cycle(trainer: Trainer) -> None:
    """The schedule spans the run: as many steps as the run took, none left, none past its end."""
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.total_steps == trainer.global_step == scheduler.last_epoch


def test_batch_size_tuner_steps_no_schedule_in_its_trials_and_sizes_it_for_the_run(tmp_path):
    clock, seen = BatchClock(), SeenBatches()
    model = OneCycle(batch_size=8, n=64)
    tuner = BatchSizeTuner(init_size=8, max_size=32, probe=FakeProbe(), clock=clock, cache=False, mode="max_fit")
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=2, callbacks=[tuner, clock, seen]))
    trainer.fit(model)  # before: "Tried to step 9 times. The specified number of total steps is 8" in a trial
    assert tuner.batch_size == 32 and [r.size for r in tuner.results] == [8, 16, 32]
    assert seen.scheduler_steps_at_first == 0 and seen.lr_at_first == pytest.approx(_fresh_one_cycle_lr())
    assert trainer.global_step == 4  # 2 epochs of 2 batches of 32
    _at_end_of_its_cycle(trainer)  # before: a cycle of 16 steps (batch 8) cut at its quarter


class ManualOneCycle(TinyModel):
    """Manual optimization stepping its own schedule in ``training_step``, as Lightning's docs show it."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False
        self.schedulers_seen: list[object] = []

    def training_step(self, batch, batch_idx):
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        self.schedulers_seen.append(scheduler)
        loss = super().training_step(batch, batch_idx)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        scheduler.step()  # before: None in the trials ('NoneType' object has no attribute 'step')
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        total = self.trainer.estimated_stepping_batches
        return [optimizer], [torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1.0, total_steps=total)]


def test_manual_optimization_sees_its_schedulers_in_the_trials_and_gets_their_state_back(tmp_path):
    """The trials hid the strategy's scheduler configs: ``self.lr_schedulers()`` was None in the user's
    ``training_step`` and the fit crashed. Each trial now starts from the schedule as the run has it (a cycle of 16
    steps is not stepped 3 x 6 times), and the run starts it afresh."""
    clock, seen = BatchClock(), SeenBatches()
    model = ManualOneCycle(batch_size=8, n=64)
    tuner = BatchSizeTuner(init_size=8, max_size=32, probe=FakeProbe(), clock=clock, cache=False, mode="max_fit")
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=2, callbacks=[tuner, clock, seen]))
    trainer.fit(model)
    assert [r.size for r in tuner.results] == [8, 16, 32] and tuner.batch_size == 32
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert model.schedulers_seen and all(s is scheduler for s in model.schedulers_seen)  # trials and run alike
    assert seen.scheduler_steps_at_first == 0 and seen.lr_at_first == pytest.approx(_fresh_one_cycle_lr())
    assert trainer.global_step == 4 and scheduler.last_epoch == 4  # the run's own steps, none of the trials'


def test_accumulation_tuner_resizes_a_schedule_by_steps_and_a_resumed_run_keeps_it(tmp_path):
    clock = BatchClock()
    model = OneCycle(batch_size=8, n=128)  # a OneCycle of 32 steps at batch 8 over two epochs
    tuner = AccumulationTuner(32, min_micro_batch=8, probe=FakeProbe(), clock=clock, cache=False)
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, filename="{epoch}")
    trainer = Trainer(
        **trainer_kwargs(tmp_path, max_epochs=2, enable_checkpointing=True, callbacks=[tuner, clock, saver])
    )
    trainer.fit(model)
    assert tuner.batch_size * tuner.accumulate_grad_batches == 32 and trainer.global_step == 8
    _at_end_of_its_cycle(trainer)  # before: 8 of the 32 steps, the run ended near the largest learning rate

    # resumed after its first epoch, in a fresh Trainer whose model says batch 8 again
    resumed_tuner = AccumulationTuner(32, min_micro_batch=8, probe=FakeProbe(), clock=clock, cache=False)
    resumed = Trainer(**trainer_kwargs(tmp_path, max_epochs=2, callbacks=[resumed_tuner, clock]))
    resumed.fit(OneCycle(batch_size=8, n=128), ckpt_path=tmp_path / "ckpt" / "epoch=0.ckpt")
    assert (resumed_tuner.batch_size, resumed_tuner.accumulate_grad_batches) == (
        tuner.batch_size,
        tuner.accumulate_grad_batches,
    )
    _at_end_of_its_cycle(resumed)


class Stream(IterableDataset):
    """A finite stream without ``__len__``."""

    def __init__(self, x, y) -> None:
        self.x, self.y = x, y

    def __iter__(self):
        return iter(zip(self.x, self.y, strict=True))


class StreamModel(TinyModel):
    def train_dataloader(self):
        return DataLoader(Stream(self.x, self.y), batch_size=self.batch_size)


def test_a_finite_stream_without_length_is_capped_at_what_it_delivers(tmp_path):
    clock, seen = BatchClock(), SeenBatches()
    model = StreamModel(batch_size=8, n=48)
    tuner = BatchSizeTuner(init_size=8, max_size=64, probe=FakeProbe(), clock=clock, cache=False, mode="max_fit")
    Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[tuner, clock, seen])).fit(model)
    # before: 64 reported "ok" from a trial that only saw batches of 48, and set
    assert [r.size for r in tuner.results] == [8, 16, 32, 48]
    assert tuner.batch_size == model.batch_size == 48 and seen.sizes == [48]


def test_a_trial_that_saw_no_batch_of_its_size_is_an_error_not_a_row():
    with pytest.raises(ValueError, match="delivered at most 48 samples a batch while `batch_size` was set to 64"):
        _check_delivered([[(48,)], [(48,)]], None, 64, "batch_size")
    _check_delivered([[(64,), (64,), (20,)]], None, 64, "batch_size")  # a short last batch of a full one is fine


class BatchNormModel(TinyModel):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(), torch.nn.Linear(32, 2)
        )


def test_a_stand_in_size_leaves_no_last_batch_batchnorm_cannot_train_and_is_said(tmp_path, caplog):
    clock, seen = BatchClock(), SeenBatches()
    model = BatchNormModel(batch_size=8, n=64, val=True)
    tuner = BatchSizeTuner(init_size=8, max_size=32, probe=FakeProbe(), clock=clock, cache=False, mode="max_fit")
    trainer = Trainer(
        **trainer_kwargs(
            tmp_path, max_epochs=1, val_check_interval=4, limit_val_batches=1.0, callbacks=[tuner, clock, seen]
        )
    )
    with caplog.at_level(logging.INFO):
        trainer.fit(model)  # before: 21 stood in, 21 + 21 + 21 + 1, and BatchNorm failed on the batch of one
    assert tuner.batch_size == 16 and seen.sizes == [16, 16, 16, 16]
    assert "32 not tried: one epoch of 64 samples needs at least a whole batch and 4 batches" in caplog.text
    assert "16 stands in (4 batches of 16)" in caplog.text


def test_a_batch_limit_that_forces_a_larger_micro_batch_is_named_in_the_refusal(tmp_path):
    clock = BatchClock()
    model = TinyModel(batch_size=8, n=256)
    tuner = AccumulationTuner(
        64, min_micro_batch=8, probe=PerSample(model, capacity=int(2e9)), clock=clock, cache=False
    )
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=1, limit_train_batches=2, callbacks=[tuner, clock]))
    with pytest.raises(RuntimeError, match=r"not even a micro-batch of 32 fits") as error:
        trainer.fit(model)
    assert "`Trainer(limit_train_batches=2)` forces a micro-batch of at least 32" in str(error.value)
    assert "min_micro_batch" not in str(error.value)  # before: "lower `min_micro_batch`", never set by the user

    lower = AccumulationTuner(64, min_micro_batch=32, probe=PerSample(model, capacity=int(2e9)), cache=False)
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[lower, clock]))
    with pytest.raises(RuntimeError, match=r"lower `min_micro_batch`"):
        trainer.fit(model)  # where `min_micro_batch` is the bound, it is still the advice


class LearningRateModel(TinyModel):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.lr = 0.1

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class BatchAtSearch(LearningRateFinder):
    def lr_find(self, trainer, pl_module):
        self.batch_size = pl_module.batch_size
        return super().lr_find(trainer, pl_module)


@pytest.mark.parametrize("finder_first", [True, False])
def test_lightnings_learning_rate_finder_searches_at_the_tuned_batch_size(tmp_path, finder_first):
    clock = BatchClock()
    model = LearningRateModel(batch_size=8, n=64)
    tuner = BatchSizeTuner(init_size=8, max_size=32, probe=FakeProbe(), clock=clock, cache=False, mode="max_fit")
    finder = BatchAtSearch(num_training_steps=4, early_stop_threshold=None)
    callbacks = [finder, tuner, clock] if finder_first else [tuner, finder, clock]
    Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=callbacks)).fit(model)
    assert tuner.batch_size == 32 and finder.batch_size == 32  # before: the finder searched at 8


class WarnsWhenItsLoaderIsBuilt(TinyModel):
    def train_dataloader(self):
        warnings.warn("the loader was built again", FutureWarning, stacklevel=1)
        return super().train_dataloader()


def test_a_warning_the_trials_raise_is_shown_once_a_search_not_once_a_trial(tmp_path, recwarn):
    def shown(max_size: int) -> tuple[int, int]:
        clock = BatchClock()
        tuner = BatchSizeTuner(
            init_size=4, max_size=max_size, probe=FakeProbe(), clock=clock, cache=False, warmup_steps=1, timed_steps=1
        )
        recwarn.clear()
        trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[tuner, clock]))
        trainer.fit(WarnsWhenItsLoaderIsBuilt(batch_size=4, n=128))
        return len(tuner.results), sum("the loader was built again" in str(w.message) for w in recwarn)

    (few_trials, few_shown), (many_trials, many_shown) = shown(8), shown(128)
    assert many_trials > few_trials + 3
    assert many_shown == few_shown <= 4  # before: once more for every trial (and every loader built for one)
