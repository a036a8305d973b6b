"""The Lightning features that change the batch, the data or the loop, each a scenario:
``overfit_batches``, ``reload_dataloaders_every_n_epochs``, ``val_check_interval``, ``check_val_every_n_epoch`` and
``CombinedLoader`` train loaders in every mode, with the tuners and MemGuard.

Each asserts what a user would notice: the choice is what the real batches hold, every epoch; the run trains
exactly as one without tuners at the chosen size (the same batches, steps, epochs, validation points and final
weights); samples are counted from every loader; what cannot work is refused, naming what to change. Every clock
is injected (BatchClock: a batch of n samples takes 10 ms + 1 ms per sample unless a test says otherwise).
"""

from __future__ import annotations

import pytest
import torch
from conftest import FakeProbe, StepClock, TinyModel, trainer_kwargs
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.utilities import CombinedLoader
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.utils.data import DataLoader, TensorDataset
from tuner_helpers import BatchClock

from lightning_memguard import AccumulationTuner, BatchSizeTuner, MemGuard

QUICK = dict(warmup_steps=1, timed_steps=2, cache=False)
# BatchClock sizes a batch with Lightning's `extract_batch_size`, which remarks on a CombinedLoader's dict batches
AMBIGUOUS = pytest.mark.filterwarnings("ignore:Trying to infer the `batch_size` from an ambiguous collection")


def per_batch(n: int) -> float:
    """BatchClock's default: seconds one batch of ``n`` samples takes."""
    return 0.01 + 0.001 * n


def small_is_fast(n: int) -> float:
    """A batch of n samples takes n^2 ms: the smaller the micro-batch, the faster a step of the same samples."""
    return 0.001 * n * n


def batch_tuner(clock, **kw):
    return BatchSizeTuner(probe=FakeProbe(), clock=clock, **{"init_size": 4, "max_size": 64, **QUICK, **kw})


def accumulation_tuner(clock, **kw):
    return AccumulationTuner(16, min_micro_batch=4, probe=FakeProbe(), clock=clock, **QUICK, **kw)


def _parts(batch) -> list[int]:
    """Samples of each loader's part of a training batch (0 for a loader that has run out, under "max_size")."""
    if isinstance(batch, dict):
        return [0 if part is None else len(part[0]) for part in batch.values()]
    return [len(batch[0])]


def _flat(loaders) -> list[DataLoader]:
    return list(loaders.values()) if isinstance(loaders, dict) else [loaders]


class Seen(Callback):
    """What the real run does (the tuners' trials switch it off): each training batch (its epoch, the samples of
    each loader's part), the train loaders each epoch starts with, and where validation ran."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, list[int]]] = []
        self.loaders: list[list[DataLoader]] = []
        self.validations: list[tuple[int, int]] = []

    def on_train_epoch_start(self, trainer, pl_module):
        self.loaders.append(_flat(trainer.train_dataloader))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append((trainer.current_epoch, _parts(batch)))

    def on_validation_start(self, trainer, pl_module):
        self.validations.append((trainer.current_epoch, trainer.global_step))


class SlowValidation(Callback):
    """Validation takes five seconds of the injected clock; it stays on in the trials, where it must never run."""

    memguard_keep_in_trials = True

    def __init__(self, clock: BatchClock) -> None:
        self.clock = clock
        self.runs = 0

    def on_validation_end(self, trainer, pl_module):
        self.runs += 1
        self.clock.now += 5.0


class Shuffled(TinyModel):
    """A shuffled train loader, as most users write it (``overfit_batches`` turns the shuffling off), and a
    validation loader of the same samples (``overfit_batches`` limits validation too)."""

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.x, self.y), batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(TensorDataset(self.x, self.y), batch_size=self.batch_size)


class TwoLoaders(TinyModel):
    """A CombinedLoader of two loaders, both built from ``self.batch_size``: ``a`` holds the first ``na`` samples,
    ``b`` the first ``nb``; a training step takes every part there is."""

    def __init__(self, mode: str, na: int, nb: int, batch_size: int = 4, fixed_b: int | None = None) -> None:
        super().__init__(batch_size=batch_size, n=max(na, nb))
        self.mode, self.na, self.nb, self.fixed_b = mode, na, nb, fixed_b

    def train_dataloader(self):
        a = DataLoader(TensorDataset(self.x[: self.na], self.y[: self.na]), batch_size=self.batch_size)
        b_size = self.fixed_b or self.batch_size
        b = DataLoader(TensorDataset(self.x[: self.nb], self.y[: self.nb]), batch_size=b_size)
        return CombinedLoader({"a": a, "b": b}, mode=self.mode)

    def training_step(self, batch, batch_idx):
        parts = [part for part in (batch.values() if isinstance(batch, dict) else [batch]) if part is not None]
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        return torch.nn.functional.cross_entropy(self.net(x), y)


def fit(tmp_path, model, callbacks, **kw) -> tuple[Trainer, Seen]:
    seen = Seen()
    trainer = Trainer(**trainer_kwargs(tmp_path, callbacks=[*callbacks, seen], **kw))
    trainer.fit(model)
    return trainer, seen


def make(cls, *args, **kw):
    torch.manual_seed(0)  # the same initial weights for the tuned run and its plain twin
    return cls(*args, **kw)


def assert_as_if_set_by_hand(tmp_path, trainer, seen, tuner, model_for, **kw) -> None:
    """The tuned run trained exactly as a run without any tuner at the chosen size (and accumulation) does: the same
    batches, epochs, optimizer steps, validation points and final weights. ``model_for(size)``: a fresh model."""
    accumulate = tuner.accumulate_grad_batches or 1
    plain, plain_seen = fit(
        tmp_path / "plain", model_for(tuner.batch_size), [], accumulate_grad_batches=accumulate, **kw
    )
    assert seen.batches == plain_seen.batches and seen.batches
    assert seen.validations == plain_seen.validations
    assert (trainer.global_step, trainer.current_epoch) == (plain.global_step, plain.current_epoch)
    assert trainer.accumulate_grad_batches == accumulate
    tuned = dict(trainer.lightning_module.named_parameters())
    for name, weight in plain.lightning_module.named_parameters():
        assert torch.equal(tuned[name], weight), name  # it trained, and as the plain run did


def assert_every_epoch_loads_at(seen: Seen, size: int, epochs: int) -> None:
    assert len(seen.loaders) == epochs
    assert all(loader.batch_size == size for loaders in seen.loaders for loader in loaders)


# ---------------------------------------------------------------- overfit_batches


@pytest.mark.parametrize("overfit, batches", [(2, 2), (0.5, 1)], ids=["int", "fraction"])
def test_overfit_batches_runs_its_batches_at_the_chosen_size(tmp_path, overfit, batches):
    """An int ``overfit_batches`` caps the batches of an epoch, a fraction keeps that share of them (already in the
    core's EpochLength); Lightning swaps the shuffled sampler for a sequential one, in every trial as in the run."""
    clock = BatchClock()
    tuner, guard = batch_tuner(clock), MemGuard(probe=FakeProbe(), clock=clock)
    kw = dict(max_epochs=2, overfit_batches=overfit)
    trainer, seen = fit(tmp_path, make(Shuffled, batch_size=4, n=128), [clock, tuner, guard], **kw)
    assert [r.size for r in tuner.results] == [4, 8, 16, 32, 64] and tuner.batch_size == 64
    assert seen.batches == [(epoch, [64]) for epoch in range(2) for _ in range(batches)]
    assert [round(e.samples_per_sec, 3) for e in guard.epochs] == [round(64 / per_batch(64), 3)] * 2
    assert_as_if_set_by_hand(tmp_path, trainer, seen, tuner, lambda size: make(Shuffled, size, 128), **kw)


# ---------------------------------------------------------------- reload_dataloaders_every_n_epochs


@pytest.mark.parametrize("kind", ["batch", "accumulation"])
def test_every_reloaded_loader_uses_the_choice(tmp_path, kind):
    """The loader is built again at every epoch start, from the attribute: the choice must be there each time."""
    clock = BatchClock() if kind == "batch" else BatchClock(small_is_fast)
    tuner = batch_tuner(clock) if kind == "batch" else accumulation_tuner(clock)
    guard = MemGuard(probe=FakeProbe(), clock=clock)
    kw = dict(max_epochs=3, reload_dataloaders_every_n_epochs=1)
    trainer, seen = fit(tmp_path, make(TinyModel, batch_size=4, n=64), [clock, tuner, guard], **kw)
    chosen = (64, None) if kind == "batch" else (4, 4)
    assert (tuner.batch_size, tuner.accumulate_grad_batches) == chosen
    assert_every_epoch_loads_at(seen, chosen[0], epochs=3)
    assert len({id(loader) for loaders in seen.loaders for loader in loaders}) == 3  # built anew each epoch
    assert len(guard.epochs) == 3
    assert_as_if_set_by_hand(tmp_path, trainer, seen, tuner, lambda size: make(TinyModel, size, 64), **kw)


# ---------------------------------------------------------------- val_check_interval


@pytest.mark.parametrize(
    "kind, interval, tried, chosen",
    [
        # at 32 an epoch runs 2 batches, which Lightning would refuse; 16 stands in for it (4 whole batches; the
        # largest that runs 3, 31, would end the epoch in a batch of 2)
        ("batch", 3, [4, 8, 16], (16, None)),
        ("accumulation", 6, [4, 8], (8, 2)),  # 16 x 1 runs 4 batches an epoch, fewer than 6
        ("batch", 0.5, [4, 8, 16, 32], (32, None)),  # a fraction holds at any size
    ],
    ids=["int-batch", "int-accumulation", "fraction"],
)  # fmt: skip
def test_validation_inside_the_epoch(tmp_path, kind, interval, tried, chosen):
    """An int ``val_check_interval`` is a number of batches Lightning refuses an epoch to run fewer of: sizes at
    which one epoch runs fewer are not tried (before, the largest was chosen and Lightning raised after the whole
    search). Validation never runs in a trial, and its time is in neither the trials' nor MemGuard's step times."""
    clock = BatchClock()
    tuner = batch_tuner(clock, max_size=32 if interval == 0.5 else 64) if kind == "batch" else accumulation_tuner(clock)
    guard, slow = MemGuard(probe=FakeProbe(), clock=clock), SlowValidation(clock)
    kw = dict(max_epochs=2, val_check_interval=interval, limit_val_batches=2)

    def model_for(size):
        return make(TinyModel, size, 64, val=True)

    trainer, seen = fit(tmp_path, model_for(4), [clock, slow, tuner, guard], **kw)
    assert [r.size for r in tuner.results] == tried
    assert (tuner.batch_size, tuner.accumulate_grad_batches) == chosen
    full = [r for r in tuner.results if 64 % r.size == 0]  # every step of their trials holds whole batches
    assert full and all(r.samples_per_sec == pytest.approx(r.size / per_batch(r.size), abs=1e-3) for r in full)
    assert seen.validations and slow.runs == len(seen.validations)  # none ran in a trial
    size = chosen[0]
    assert all(e.step_ms == pytest.approx(per_batch(size) * 1e3) for e in guard.epochs) and len(guard.epochs) == 2
    assert all(e.samples_per_sec == pytest.approx(size / per_batch(size)) for e in guard.epochs)
    assert guard.spill is None
    assert_as_if_set_by_hand(tmp_path, trainer, seen, tuner, model_for, **kw)


def test_a_choice_cached_without_validation_inside_the_epoch_is_not_reused_with_it(tmp_path):
    """The same model and data, first without validation inside the epoch, then with ``val_check_interval=3``: the
    cached 64 would make Lightning refuse the run (before: it was reused, and Lightning raised), so it is measured
    again, and that choice is reused."""
    clock = BatchClock()
    kw = dict(max_epochs=1, limit_val_batches=2)
    for interval, expected in ((1.0, (64, False)), (3, (16, False)), (3, (16, True))):
        tuner = BatchSizeTuner(
            init_size=4, max_size=64, probe=FakeProbe(), clock=clock, warmup_steps=1, timed_steps=2,
            cache_dir=str(tmp_path / "cache"),
        )  # fmt: skip
        fit(tmp_path, TinyModel(batch_size=4, n=64, val=True), [clock, tuner], val_check_interval=interval, **kw)
        assert (tuner.batch_size, tuner.from_cache) == expected, interval


def test_a_time_based_val_check_interval_caps_nothing(tmp_path):
    """``val_check_interval`` as a time: validation comes by the clock, not after so many batches of an epoch."""
    clock = BatchClock()
    tuner = batch_tuner(clock)
    kw = dict(max_epochs=1, val_check_interval={"hours": 1}, limit_val_batches=2)
    trainer, seen = fit(tmp_path, TinyModel(batch_size=4, n=64, val=True), [clock, tuner], **kw)
    assert [r.size for r in tuner.results] == [4, 8, 16, 32, 64] and tuner.batch_size == 64
    assert seen.batches == [(0, [64])] and trainer.global_step == 1


@pytest.mark.xfail(
    strict=True,
    raises=MisconfigurationException,
    reason="not fixed: the size is capped by the train loaders only; a validation loader built from the same"
    " attribute, with a fraction `limit_val_batches` (or `overfit_batches`), can run no batch at the chosen size,"
    " and Lightning refuses when validation first runs, after the whole search",
)
def test_a_fraction_of_a_small_validation_set_at_the_chosen_size(tmp_path):
    clock = BatchClock()
    tuner = batch_tuner(clock)  # chooses 64: the validation loader's 16 samples make one batch, half of it none
    fit(tmp_path, TinyModel(batch_size=4, n=64, val=True), [clock, tuner], max_epochs=1, limit_val_batches=0.5)


# ---------------------------------------------------------------- check_val_every_n_epoch


@pytest.mark.parametrize(
    "every, interval, tried, chosen",
    [
        (2, 1.0, [4, 8, 16, 32, 64], 64),
        (None, 3, [4, 8, 16, 32, 64], 64),  # batches counted across epochs: no epoch has to hold 3
        (2, 3, [4, 8, 16], 16),  # counted within each epoch, which Lightning checks even where it does not validate
    ],
    ids=["every-2nd-epoch", "across-epochs", "every-2nd-epoch-int"],
)  # fmt: skip
def test_check_val_every_n_epoch(tmp_path, every, interval, tried, chosen):
    clock = BatchClock()
    tuner, guard = batch_tuner(clock), MemGuard(probe=FakeProbe(), clock=clock)
    kw = dict(max_epochs=4, check_val_every_n_epoch=every, val_check_interval=interval, limit_val_batches=2)

    def model_for(size):
        return make(TinyModel, size, 64, val=True)

    trainer, seen = fit(tmp_path, model_for(4), [clock, tuner, guard], **kw)
    assert [r.size for r in tuner.results] == tried and tuner.batch_size == chosen
    assert seen.validations
    if every == 2:
        assert {epoch for epoch, _ in seen.validations} == {1, 3}
    assert len(guard.epochs) == 4
    assert_as_if_set_by_hand(tmp_path, trainer, seen, tuner, model_for, **kw)


# ---------------------------------------------------------------- CombinedLoader train loaders


@AMBIGUOUS
@pytest.mark.parametrize(
    "mode, na, nb, tried, epoch, guard_rate",
    [
        # the shorter loader cycles: its short batch comes in the middle of the epoch, and is no sign that the
        # loader ignores the attribute
        ("max_size_cycle", 40, 64, [4, 8, 16, 32, 40], [[40, 40], [40, 24]], 80 / per_batch(40)),
        # the second loader is the shorter: past its 40 samples its batches could not grow
        ("min_size", 64, 40, [4, 8, 16, 32, 40], [[40, 40]], 80 / per_batch(40)),
        # a loader that ran out gives None: no samples
        ("max_size", 24, 64, [4, 8, 16, 24], [[24, 24], [0, 24], [0, 16]], 72 / (2 * per_batch(24))),
    ],
)  # fmt: skip
def test_a_combined_loader_trains_every_loader_at_the_choice(tmp_path, mode, na, nb, tried, epoch, guard_rate):
    """Every loader of a CombinedLoader is built from the attribute: the ladder stops at the shortest loader (the
    size at which each still delivers whole batches), the trials and MemGuard count every loader's samples."""
    clock = BatchClock()  # it times a batch by its first loader's part
    tuner, guard = batch_tuner(clock, mode="max_fit", timed_steps=3), MemGuard(probe=FakeProbe(), clock=clock)

    def model_for(size):
        return make(TwoLoaders, mode, na, nb, batch_size=size)

    trainer, seen = fit(tmp_path, model_for(4), [clock, tuner, guard], max_epochs=2)
    assert [r.size for r in tuner.results] == tried and tuner.batch_size == tried[-1]
    assert tuner.results[0].samples_per_sec == pytest.approx(2 * 4 / per_batch(4), abs=1e-3)  # both loaders' samples
    assert seen.batches == [(e, parts) for e in range(2) for parts in epoch]
    assert_every_epoch_loads_at(seen, tuner.batch_size, epochs=2)
    assert [e.samples_per_sec for e in guard.epochs] == [pytest.approx(guard_rate)] * 2
    assert_as_if_set_by_hand(tmp_path, trainer, seen, tuner, model_for, max_epochs=2)


@AMBIGUOUS
def test_a_combined_loader_with_the_accumulation_tuner(tmp_path):
    """``min_size``: each optimizer step holds the effective batch of both loaders."""
    clock = BatchClock(small_is_fast)
    tuner, guard = accumulation_tuner(clock), MemGuard(probe=FakeProbe(), clock=clock)

    def model_for(size):
        return make(TwoLoaders, "min_size", 64, 32, batch_size=size)

    trainer, seen = fit(tmp_path, model_for(4), [clock, tuner, guard], max_epochs=2)
    assert [(r.size, r.accumulate) for r in tuner.results] == [(4, 4), (8, 2), (16, 1)]  # each measured
    assert (tuner.batch_size, tuner.accumulate_grad_batches) == (4, 4)
    assert seen.batches == [(e, [4, 4]) for e in range(2) for _ in range(8)]  # 8 batches: b's 32 samples
    assert_as_if_set_by_hand(tmp_path, trainer, seen, tuner, model_for, max_epochs=2)


def test_a_combined_loader_shorter_than_the_effective_batch_is_refused(tmp_path):
    """Before: 4 x 4 was chosen and every optimizer step held 3 batches of ``b``'s 12 samples (min_size)."""
    probe = FakeProbe()
    tuner = AccumulationTuner(16, min_micro_batch=4, probe=probe, clock=BatchClock(small_is_fast), **QUICK)
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[tuner]))
    with pytest.raises(
        ValueError,
        match=r"`effective_batch_size` 16 needs 16 samples per device for one optimizer step, but an epoch of the"
        r" shortest train loader \(of 2\) holds only 12 per device",
    ):
        trainer.fit(TwoLoaders("min_size", 64, 12))
    assert probe.resets == 0 and not tuner.results


@AMBIGUOUS
@pytest.mark.parametrize("kind", ["batch", "accumulation"])
def test_a_combined_loader_with_a_loader_that_ignores_the_attribute_is_refused_naming_it(tmp_path, kind):
    clock = BatchClock()
    tuner = batch_tuner(clock) if kind == "batch" else accumulation_tuner(clock)
    model = TwoLoaders("max_size_cycle", 64, 64, fixed_b=4)
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[clock, tuner]))
    with pytest.raises(ValueError, match=r"the train loader 'b' delivered batches of \[4\] samples while `batch_size`"):
        trainer.fit(model)
    assert model.batch_size == 4


@pytest.mark.parametrize("kind", ["batch", "accumulation", "guard"])
def test_a_sequential_combined_loader_is_refused_naming_the_mode(tmp_path, kind):
    """Lightning cannot train on ``mode="sequential"`` and says so, naming the mode, before anything trains."""
    clock, probe = BatchClock(), FakeProbe()
    if kind == "guard":
        callback = MemGuard(probe=probe, clock=StepClock())
    else:
        callback = batch_tuner(clock) if kind == "batch" else accumulation_tuner(clock)
    model = make(TwoLoaders, "sequential", 64, 64)
    weights = [p.detach().clone() for p in model.parameters()]
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[clock, callback]))
    with pytest.raises(ValueError, match=r'does not support the `CombinedLoader\(mode="sequential"\)` mode'):
        trainer.fit(model)
    assert trainer.global_step == 0 and model.batch_size == 4
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters(), strict=True))
    if kind != "guard":
        assert not callback.results and callback.batch_size is None
