"""The tuners in the situations Lightning users put them in: resume, loaders passed to fit, small datasets, the
result cache, fast_dev_run, hyperparameters that are not tensors. Every clock is injected."""

from __future__ import annotations

import logging
import pathlib
import warnings

import pytest
import torch
from conftest import FakeProbe, TinyModel, ticking_planner_clocks, trainer_kwargs
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset
from tuner_helpers import BatchClock, FirstBatch, PerSample

from lightning_memguard import AccumulationTuner, ActivationCheckpointing, BatchSizeTuner
from lightning_memguard.checkpointing import is_checkpointed
from lightning_memguard.testing import ImageClassifier

QUICK = dict(warmup_steps=1, timed_steps=2)


class Scheduled(TinyModel):
    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=3)}


def _tuner(kind, probe, clock, **kw):
    if kind == "batch":
        return BatchSizeTuner(init_size=4, max_size=16, probe=probe, cache=False, clock=clock, **QUICK, **kw)
    return AccumulationTuner(8, min_micro_batch=4, probe=probe, cache=False, clock=clock, **QUICK, **kw)


# ---------------------------------------------------------------- item 1: resume


@pytest.mark.parametrize("kind", ["batch", "accumulation"])
def test_resume_with_a_tuner_the_checkpoint_did_not_have_continues_where_it_was_saved(tmp_path, caplog, kind):
    first = Trainer(**trainer_kwargs(tmp_path, max_epochs=2, limit_train_batches=4, enable_checkpointing=True))
    first.fit(Scheduled(batch_size=8))
    ckpt = first.checkpoint_callback.best_model_path
    saved = torch.load(ckpt, weights_only=False)

    model = Scheduled(batch_size=8)
    clock, seen = BatchClock(), FirstBatch()
    tuner = _tuner(kind, PerSample(model), clock)
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=3, limit_train_batches=4, callbacks=[clock, tuner, seen]))
    with caplog.at_level(logging.INFO):
        trainer.fit(model, ckpt_path=ckpt)
    assert tuner.results  # it measured, then training went on from the checkpoint
    assert (seen.epoch, seen.global_step) == (2, 8)
    momentum = [s["momentum_buffer"] for s in seen.optim["state"].values()]
    expected = [s["momentum_buffer"] for s in saved["optimizer_states"][0]["state"].values()]
    assert len(momentum) == len(expected) > 0 and all(
        torch.equal(a, b) for a, b in zip(momentum, expected, strict=True)
    )
    assert seen.scheduler["last_epoch"] == saved["lr_schedulers"][0]["last_epoch"] == 2  # stepped each epoch
    # the user's checkpoint is what Lightning names, never the trials' file
    assert seen.ckpt_path == ckpt and trainer.ckpt_path == ckpt
    assert f"Restored all states from the checkpoint at {ckpt}" in caplog.text
    assert ".memguard_trials" not in caplog.text
    assert not list(pathlib.Path(tmp_path).glob(".memguard_trials_*"))


def test_resume_with_the_tuners_state_reapplies_it_without_measuring(tmp_path):
    model = TinyModel(batch_size=4)
    clock = BatchClock()
    tuner = _tuner("accumulation", PerSample(model), clock)
    first = Trainer(
        **trainer_kwargs(
            tmp_path, max_epochs=1, limit_train_batches=2, enable_checkpointing=True, callbacks=[clock, tuner]
        )
    )
    first.fit(model)
    ckpt = first.checkpoint_callback.best_model_path

    model = TinyModel(batch_size=5)
    probe = PerSample(model)
    resumed, seen = _tuner("accumulation", probe, clock), FirstBatch()
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=2, limit_train_batches=2, callbacks=[clock, resumed, seen]))
    trainer.fit(model, ckpt_path=ckpt)
    assert probe.resets == 0  # no trial ran
    assert (resumed.batch_size, resumed.accumulate_grad_batches) == (tuner.batch_size, tuner.accumulate_grad_batches)
    assert model.batch_size == seen.batch_samples == tuner.batch_size
    assert trainer.accumulate_grad_batches == tuner.accumulate_grad_batches
    assert (seen.epoch, seen.global_step) == (1, 2 // tuner.accumulate_grad_batches)


# ---------------------------------------------------------------- item 2: loaders the tuner cannot size


@pytest.mark.parametrize("kind", ["batch", "accumulation"])
def test_a_dataloader_passed_to_fit_is_refused(tmp_path, kind):
    model = TinyModel(batch_size=4)
    tuner = _tuner(kind, PerSample(model), BatchClock())
    loader = DataLoader(TensorDataset(model.x, model.y), batch_size=4)
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[tuner]))
    with pytest.raises(ValueError, match=r"cannot change the batch size of a DataLoader passed to `fit\(\)`"):
        trainer.fit(model, train_dataloaders=loader)
    assert tuner.batch_size is None and not tuner.results


class FixedLoader(TinyModel):
    """Has a `batch_size` attribute, but its loader always delivers 4 samples."""

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.x, self.y), batch_size=4)


@pytest.mark.parametrize("kind", ["batch", "accumulation"])
def test_a_loader_that_ignores_the_attribute_is_refused(tmp_path, kind):
    model = FixedLoader(batch_size=4)
    clock = BatchClock()
    tuner = _tuner(kind, PerSample(model), clock)
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[clock, tuner]))
    with pytest.raises(ValueError, match=r"delivered batches of \[4\] samples while `batch_size` was set to 8"):
        trainer.fit(model)
    assert model.batch_size == 4  # put back
    assert not list(pathlib.Path(tmp_path).glob(".memguard_trials_*"))


# ---------------------------------------------------------------- item 3: small datasets


def test_the_ladder_stops_at_the_dataset_and_real_samples_are_counted(tmp_path):
    model = TinyModel(batch_size=4, n=100)
    clock = BatchClock()  # a batch of n samples takes 10 ms + 1 ms per sample
    tuner = BatchSizeTuner(
        init_size=16, max_size=512, probe=FakeProbe(), cache=False, clock=clock, warmup_steps=2, timed_steps=4
    )
    Trainer(**trainer_kwargs(tmp_path, max_epochs=1, limit_train_batches=2, callbacks=[clock, tuner])).fit(model)
    assert [r.size for r in tuner.results] == [16, 32, 64, 100]
    rates = {r.size: r.samples_per_sec for r in tuner.results}
    assert rates[100] == pytest.approx(100 / 0.110)
    # 64 delivers batches of 64 and 36 (the rest of the 100): only whole steps of 64 are timed
    assert rates[64] == pytest.approx(64 / 0.074)
    assert tuner.batch_size == model.batch_size == 100


def test_an_effective_batch_larger_than_the_dataset_is_refused(tmp_path):
    model = TinyModel(batch_size=4, n=40)
    tuner = AccumulationTuner(64, min_micro_batch=8, probe=FakeProbe(), cache=False, clock=BatchClock())
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[tuner]))
    with pytest.raises(ValueError, match="`effective_batch_size` 64 needs 64 samples .* holds only 40 per device"):
        trainer.fit(model)


# ---------------------------------------------------------------- item 4: the cache


class Images(LightningDataModule):
    """Images whose size is a plain attribute (not a hyperparameter): only the batches show it."""

    def __init__(self, size, batch_size=4):
        super().__init__()
        self.size, self.batch_size = size, batch_size
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(64, 3, size, size, generator=gen)
        self.y = torch.randint(0, 2, (64,), generator=gen)

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.x, self.y), batch_size=self.batch_size)


class Pooled(LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(3, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _cached_tuner(tmp_path, probe, clock, max_size=16, **kw):
    return BatchSizeTuner(
        init_size=4, max_size=max_size, probe=probe, clock=clock, cache_dir=str(tmp_path / "c"), **QUICK, **kw
    )


def test_the_cache_key_holds_the_input_shape_from_the_datamodule(tmp_path):
    clock = BatchClock()
    for size, expect_cached in ((8, False), (8, True), (32, False)):
        dm = Images(size)
        tuner = _cached_tuner(tmp_path, PerSample(dm), clock)
        Trainer(**trainer_kwargs(tmp_path, max_epochs=1, limit_train_batches=1, callbacks=[clock, tuner])).fit(
            Pooled(), datamodule=dm
        )
        assert tuner.from_cache is expect_cached, size
        assert dm.batch_size == tuner.batch_size


def test_the_cache_key_holds_the_probes_capacity(tmp_path):
    clock = BatchClock()
    chosen = {}
    for capacity in (int(16e9), int(1e9)):
        model = TinyModel(batch_size=4)
        tuner = _cached_tuner(tmp_path, PerSample(model, capacity=capacity), clock)
        Trainer(**trainer_kwargs(tmp_path, max_epochs=1, limit_train_batches=1, callbacks=[clock, tuner])).fit(model)
        assert not tuner.from_cache
        chosen[capacity] = tuner.batch_size
    assert chosen == {int(16e9): 16, int(1e9): 8}


def small_image_model(**kw):
    return ImageClassifier("resnet18", image_size=16, batch_size=4, steps_per_epoch=20, pool_size=8, **kw)


def test_the_cache_key_holds_whether_the_model_is_checkpointed(tmp_path):
    clock = BatchClock()
    for checkpointing, expect_cached in ((True, False), (True, True), (False, False)):
        model = small_image_model()
        tuner = _cached_tuner(tmp_path, PerSample(model), clock, max_size=8)
        callbacks = [clock, *([ActivationCheckpointing()] if checkpointing else []), tuner]
        Trainer(**trainer_kwargs(tmp_path, max_epochs=1, limit_train_batches=1, callbacks=callbacks)).fit(model)
        assert tuner.from_cache is expect_cached, checkpointing


def test_the_cache_key_holds_whether_the_levers_plan_the_fused_loss(tmp_path, monkeypatch):
    """``ActivationCheckpointing(levers=True, fused_loss=False)`` plans other savers than the default (a step that
    reads the logits keeps them): a choice measured with one is not the other's.

    The planner's clocks tick once a reading: it chooses links by milliseconds per byte, and the key holds which
    blocks it checkpointed, so timed by this machine under load two fits of one setting could choose apart."""
    ticking_planner_clocks(monkeypatch)
    clock = BatchClock()
    for fused_loss, expect_cached in ((True, False), (True, True), (False, False), (False, True)):
        model = small_image_model()
        model.example_input_array = torch.randn(4, 3, 16, 16)  # the budget is measured on the images, not indices
        tuner = _cached_tuner(tmp_path, PerSample(model), clock, max_size=8)
        levers = ActivationCheckpointing(memory_budget=0.8, levers=True, fused_loss=fused_loss)
        callbacks = [clock, levers, tuner]
        Trainer(**trainer_kwargs(tmp_path, max_epochs=1, limit_train_batches=1, callbacks=callbacks)).fit(model)
        assert tuner.from_cache is expect_cached, fused_loss


def test_a_cached_choice_that_no_longer_fits_is_measured_again(tmp_path):
    clock = BatchClock()
    model = TinyModel(batch_size=4)
    tuner = _cached_tuner(tmp_path, PerSample(model, capacity=int(4e9)), clock)
    Trainer(**trainer_kwargs(tmp_path, max_epochs=1, limit_train_batches=1, callbacks=[clock, tuner])).fit(model)
    assert tuner.batch_size == 16

    model = TinyModel(batch_size=4)  # same key, but now every sample costs 400 MB: 16 would spill
    probe = PerSample(model, capacity=int(4e9), per_sample=4 * 10**8)
    again = _cached_tuner(tmp_path, probe, clock)
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=1, limit_train_batches=1, callbacks=[clock, again]))
    with pytest.warns(UserWarning, match=r"earlier choice \(batch size 16 x 1\) no longer fits: spill, peak 6.40 GB"):
        trainer.fit(model)
    assert not again.from_cache
    # measured again: 4 and 8 fix the memory line, which puts 16 at 6.4 GB on the 4 GB card: not run
    assert [(r.size, r.outcome) for r in again.results] == [(4, "ok"), (8, "ok"), (16, "predicted_over")]
    assert again.batch_size == model.batch_size == 8


class Shrinks(Callback):
    """Peak memory drops below the capacity once the model is checkpointed."""

    memguard_keep_in_trials = True

    def __init__(self, probe):
        self.probe = probe

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        checkpointed = any(is_checkpointed(m) for m in pl_module.modules())
        self.probe.peak = int(0.5e9) if checkpointed else int(2e9)


def _fallback_tuner(probe, clock, **kw):
    return AccumulationTuner(8, min_micro_batch=4, probe=probe, allow_checkpointing=True, clock=clock, **QUICK, **kw)


def test_a_choice_made_with_checkpointing_turns_it_on_again_from_the_cache_and_on_resume(tmp_path):
    clock = BatchClock()
    probe = FakeProbe(capacity=int(1e9), peak=int(2e9))  # nothing fits until the model is checkpointed
    tuner = _fallback_tuner(probe, clock, cache_dir=str(tmp_path / "c"))
    first = Trainer(
        **trainer_kwargs(
            tmp_path, max_epochs=1, limit_train_batches=2, enable_checkpointing=True,
            callbacks=[clock, Shrinks(probe), tuner],
        )
    )  # fmt: skip
    first.fit(small_image_model())
    assert tuner.checkpointing is True

    for resume in (False, True):
        probe = FakeProbe(capacity=int(1e9), peak=int(2e9))
        again, seen = _fallback_tuner(probe, clock, cache_dir=str(tmp_path / "c")), FirstBatch()
        trainer = Trainer(
            **trainer_kwargs(
                tmp_path, max_epochs=2, limit_train_batches=2, callbacks=[clock, Shrinks(probe), again, seen]
            )
        )
        trainer.fit(small_image_model(), ckpt_path=first.checkpoint_callback.best_model_path if resume else None)
        assert again.from_cache is not resume
        assert again.checkpointing is True and seen.checkpointed, resume
        assert (again.batch_size, again.accumulate_grad_batches) == (tuner.batch_size, tuner.accumulate_grad_batches)


# ---------------------------------------------------------------- item 5: slow is not a spill


def test_a_slow_trial_far_from_the_capacity_is_just_slow(tmp_path):
    model = TinyModel(batch_size=4)
    clock = BatchClock(lambda n: 0.01 * n if n < 16 else 0.05 * n)  # 16 is 5x slower per sample, at 1.6 of 100 GB
    tuner = BatchSizeTuner(
        mode="max_fit", init_size=4, max_size=32, probe=PerSample(model, capacity=int(100e9)), cache=False,
        clock=clock, **QUICK,
    )  # fmt: skip
    Trainer(**trainer_kwargs(tmp_path, max_epochs=1, limit_train_batches=1, callbacks=[clock, tuner])).fit(model)
    assert [(r.size, r.outcome) for r in tuner.results] == [(4, "ok"), (8, "ok"), (16, "ok"), (32, "ok")]
    assert tuner.batch_size == 32


# ---------------------------------------------------------------- item 6: the trials' checkpoint


class PathHparams(TinyModel):
    def __init__(self, data_dir: pathlib.Path, batch_size: int = 4):
        super().__init__(batch_size=batch_size)
        self.save_hyperparameters()


class Remembers(Callback):
    """A stateful callback whose state is not made of tensors."""

    def state_dict(self):
        return {"where": pathlib.Path("/tmp/somewhere"), "seen": {1, 2}}

    def load_state_dict(self, state_dict):
        self.loaded = state_dict


def test_trials_survive_hparams_and_callback_state_that_are_not_tensors(tmp_path, caplog):
    model = PathHparams(pathlib.Path(tmp_path) / "data")
    clock = BatchClock()
    tuner = _tuner("batch", PerSample(model), clock)
    trainer = Trainer(
        **trainer_kwargs(tmp_path, max_epochs=1, limit_train_batches=1, callbacks=[clock, Remembers(), tuner])
    )
    with caplog.at_level(logging.INFO):
        trainer.fit(model)
    assert tuner.batch_size == model.batch_size == 16
    assert trainer.ckpt_path is None
    assert ".memguard_trials" not in caplog.text and "Restored all states" not in caplog.text
    assert not list(pathlib.Path(tmp_path).glob(".memguard_trials_*"))


class Broken(TinyModel):
    def training_step(self, batch, batch_idx):
        if len(batch[0]) > 4:
            raise KeyError("not a memory problem")
        return super().training_step(batch, batch_idx)


def test_the_trials_checkpoint_is_removed_when_a_trial_fails(tmp_path):
    model = Broken(batch_size=4)
    clock = BatchClock()
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[clock, _tuner("batch", FakeProbe(), clock)]))
    with pytest.raises(KeyError, match="not a memory problem"):
        trainer.fit(model)
    assert not list(pathlib.Path(tmp_path).glob(".memguard_trials_*"))
    assert model.batch_size == 4


# ---------------------------------------------------------------- item 7: fast_dev_run


@pytest.mark.parametrize("kind", ["batch", "accumulation"])
def test_fast_dev_run_skips_the_search_as_lightning_does(tmp_path, kind):
    model = TinyModel(batch_size=4)
    probe = PerSample(model)
    tuner = _tuner(kind, probe, BatchClock())
    name = type(tuner).__name__
    trainer = Trainer(**trainer_kwargs(tmp_path, fast_dev_run=True, callbacks=[tuner]))
    with pytest.warns(UserWarning, match=f"Skipping {name} since `fast_dev_run` is enabled"):
        trainer.fit(model)
    assert probe.resets == 0 and not tuner.results and tuner.batch_size is None
    assert model.batch_size == 4 and trainer.accumulate_grad_batches == 1


# ---------------------------------------------------------------- item 8: a spilling trial ends after one step


class BatchCounter(Callback):
    memguard_keep_in_trials = True

    def __init__(self):
        self.by_size = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        n = len(batch[0])
        self.by_size[n] = self.by_size.get(n, 0) + 1


def test_a_spilling_trial_ends_after_its_first_step_even_with_min_steps(tmp_path):
    model = TinyModel(batch_size=4)
    clock, counter = BatchClock(), BatchCounter()
    tuner = BatchSizeTuner(
        init_size=4, max_size=16, probe=PerSample(model, capacity=int(1e9)), cache=False, clock=clock,
        warmup_steps=2, timed_steps=4, predict=False,  # the spilling trial runs (with the forecast it would not)
    )  # fmt: skip
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=1, min_steps=50, callbacks=[clock, counter, tuner]))
    trainer.fit(model)
    assert [(r.size, r.outcome) for r in tuner.results] == [(4, "ok"), (8, "ok"), (16, "spill")]
    assert counter.by_size[16] == 1


def test_a_spilling_micro_batch_ends_after_its_first_optimizer_step(tmp_path):
    model = TinyModel(batch_size=4, n=128)
    clock, counter = BatchClock(), BatchCounter()
    tuner = AccumulationTuner(
        32, min_micro_batch=8, probe=PerSample(model, capacity=int(2e9)), cache=False, clock=clock,
        warmup_steps=2, timed_steps=4, predict=False,  # the spilling trial runs (with the forecast it would not)
    )  # fmt: skip
    Trainer(**trainer_kwargs(tmp_path, max_epochs=1, limit_train_batches=4, callbacks=[clock, counter, tuner])).fit(
        model
    )
    assert [(r.size, r.accumulate, r.outcome) for r in tuner.results] == [(8, 4, "ok"), (16, 2, "ok"), (32, 1, "spill")]
    assert counter.by_size[32] == 1  # one optimizer step of one batch
    assert counter.by_size[8] == 6 * 4  # the trials that fit ran all their steps


# ---------------------------------------------------------------- item 13: arguments


@pytest.mark.parametrize("cls", [BatchSizeTuner, lambda **kw: AccumulationTuner(64, **kw)])
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"cache": "no"}, TypeError, "`cache` must be a bool, got 'no'"),
        ({"cache": 1}, TypeError, "`cache` must be a bool, got 1"),
        ({"cache_dir": 3}, TypeError, "`cache_dir` must be a path .*got 3"),
        ({"cache_dir": ""}, ValueError, "`cache_dir` must be a non-empty path or None, got ''"),
        ({"clock": 3}, TypeError, "`clock` must be a callable .*got 3"),
        ({"batch_arg_name": 3}, TypeError, "`batch_arg_name` must be a string, got 3"),
        ({"batch_arg_name": ""}, ValueError, "`batch_arg_name` must be a non-empty string, got ''"),
        ({"warmup_steps": 1.5}, TypeError, "`warmup_steps` must be an int, got 1.5"),
        ({"headroom": "5%"}, TypeError, "`headroom` must be a float, got '5%'"),
        ({"probe": object()}, TypeError, "`probe` must have capacity"),
    ],
)
def test_every_tuner_argument_is_checked(cls, kwargs, error, match):
    with pytest.raises(error, match=match):
        cls(**kwargs)


def test_tuner_specific_arguments_are_checked():
    with pytest.raises(ValueError, match="`mode` must be one of .*got 3"):
        BatchSizeTuner(mode=3)
    with pytest.raises(TypeError, match="`max_size` must be an int, got '64'"):
        BatchSizeTuner(max_size="64")
    with pytest.raises(TypeError, match="`effective_batch_size` must be an int, got 64.0"):
        AccumulationTuner(64.0)
    with pytest.raises(TypeError, match="`allow_checkpointing` must be a bool, got 'yes'"):
        AccumulationTuner(64, allow_checkpointing="yes")
    assert BatchSizeTuner(cache_dir=pathlib.Path("/tmp/x")).cache_dir == "/tmp/x"


# ---------------------------------------------------------------- item 16: the exact search on a fake card


def test_the_search_on_a_fake_card_is_exact_whatever_this_machines_speed(tmp_path):
    model = TinyModel(batch_size=4)
    clock = BatchClock()
    tuner = BatchSizeTuner(init_size=4, max_size=64, probe=PerSample(model, capacity=int(4e9)), cache=False,
                           clock=clock, **QUICK)  # fmt: skip
    Trainer(**trainer_kwargs(tmp_path, max_epochs=1, limit_train_batches=1, callbacks=[clock, tuner])).fit(model)
    assert [(r.size, r.outcome) for r in tuner.results] == [
        (4, "ok"),
        (8, "ok"),
        (16, "ok"),
        (32, "ok"),
        (64, "predicted_over"),  # 6.4 GB predicted on a 4 GB card: not run (nor 48, predicted at 4.8 GB)
    ]
    assert tuner.results[-1].peak_bytes == pytest.approx(6.4e9, rel=1e-6) and tuner.results[-1].samples_per_sec is None
    assert [r.samples_per_sec for r in tuner.results[:4]] == pytest.approx(
        [n / (0.01 + 0.001 * n) for n in (4, 8, 16, 32)], abs=1e-3
    )
    assert tuner.batch_size == model.batch_size == 32


@pytest.mark.parametrize("tuner_cls", [BatchSizeTuner, AccumulationTuner])
def test_a_budgeted_checkpointing_listed_after_a_tuner_plans_first(tmp_path, tuner_cls, monkeypatch):
    """Listed after the tuner, the checkpointing still plans before the tuner measures, so the tuner measures the
    checkpointed model, which is the one that trains; the plan is made once."""
    from lightning_memguard.checkpointing import policy
    from lightning_memguard.tuning import workflow

    settings = dict(cache=False, probe=FakeProbe(), **QUICK)
    if tuner_cls is BatchSizeTuner:
        tuner = BatchSizeTuner(init_size=4, max_size=8, **settings)
    else:
        tuner = AccumulationTuner(8, **settings)
    checkpointing = ActivationCheckpointing(memory_budget=0.6)
    applied, measured_checkpointed = [], []
    real_plan, real_search = policy.checkpoint_blocks, workflow.search

    def plan(model, units, memory_budget, **kwargs):  # the plan's measuring is tested elsewhere: every block here
        applied.append(memory_budget)
        kwargs.pop("example_input")
        return real_plan(model, units, **kwargs)

    def search(trainer, *args, **kwargs):
        measured_checkpointed.append(bool(checkpointing.blocks))
        return real_search(trainer, *args, **kwargs)

    monkeypatch.setattr(policy, "checkpoint_blocks", plan)
    monkeypatch.setattr(workflow, "search", search)
    model = ImageClassifier("resnet18", image_size=16, batch_size=4, steps_per_epoch=2, pool_size=8)
    model.example_input_array = torch.randn(4, 3, 16, 16)
    Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[tuner, checkpointing])).fit(model)
    assert applied == [0.6]
    assert measured_checkpointed == [True]
    assert any(is_checkpointed(module) for module in model.modules())


def test_when_nothing_fits_with_checkpointing_on_the_advice_does_not_repeat_it(tmp_path):
    model = ImageClassifier("resnet18", image_size=16, batch_size=8, steps_per_epoch=8, pool_size=8)
    probe = FakeProbe(capacity=10**6, peak=10**9)  # nothing fits, checkpointed or not
    tuner = AccumulationTuner(32, min_micro_batch=8, allow_checkpointing=True, probe=probe, cache=False, **QUICK)
    trainer = Trainer(**trainer_kwargs(tmp_path, callbacks=[tuner]))
    with pytest.raises(RuntimeError, match="lower `min_micro_batch`$"):
        trainer.fit(model)


def test_lightning_says_nothing_about_the_trials_as_if_they_were_the_run(tmp_path, caplog):
    """No "`Trainer.fit` stopped: `max_steps=...` reached" per trial, and the logging-interval warning at most once
    (for the run), not once per trial."""
    model = ImageClassifier("resnet18", image_size=16, batch_size=4, steps_per_epoch=4, pool_size=16)
    tuner = BatchSizeTuner(init_size=2, max_size=8, cache=False, probe=FakeProbe(), **QUICK)
    kwargs = trainer_kwargs(tmp_path, max_epochs=1, callbacks=[tuner], log_every_n_steps=50)
    kwargs["logger"] = True
    with caplog.at_level(logging.INFO), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer(**kwargs).fit(model)
    assert len(tuner.results) >= 2
    assert "stopped: `max_steps" not in caplog.text
    assert "`max_epochs=1` reached" in caplog.text  # the run's own end is still said
    assert len([w for w in caught if "logging interval" in str(w.message)]) <= 1
    assert not [w for w in caught if "weights_only" in str(w.message)] and "weights_only" not in caplog.text
