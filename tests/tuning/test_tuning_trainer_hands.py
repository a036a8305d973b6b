"""The Trainer's other hands on the batch size, the accumulation and the data: Lightning's
BatchSizeFinder and GradientAccumulationScheduler, ``limit_train_batches`` / ``overfit_batches``, ``max_time``, an
iterable without length. Each is refused in ``setup`` with a message that names both things, or accounted for;
every clock is injected."""

from __future__ import annotations

import types

import pytest
from conftest import FakeProbe, TinyModel, trainer_kwargs
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import BatchSizeFinder, GradientAccumulationScheduler
from torch.utils.data import DataLoader, IterableDataset
from tuner_helpers import BatchClock

from lightning_memguard import AccumulationTuner, BatchSizeTuner
from lightning_memguard.tuning.epoch import EpochLength
from lightning_memguard.tuning.search import AccumulationSearch, TrialResult, capped_ladder

QUICK = dict(warmup_steps=1, timed_steps=2, cache=False)


class StepSamples(Callback):
    """Samples in each optimizer step of the real run (the tuners' trials switch it off)."""

    def __init__(self) -> None:
        self.pending, self.steps = 0, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.pending += len(batch[0])

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.steps.append(self.pending)
        self.pending = 0


def small_is_fast(n: int) -> float:
    """A batch of n samples takes n^2 ms: the smaller the micro-batch, the faster a step of the same samples."""
    return 0.001 * n * n


def accumulation_tuner(clock, probe=None, **kw):
    return AccumulationTuner(16, min_micro_batch=4, probe=probe or FakeProbe(), clock=clock, **QUICK, **kw)


def batch_tuner(clock, probe=None, **kw):
    kw = {"init_size": 4, "max_size": 64, **kw}
    return BatchSizeTuner(probe=probe or FakeProbe(), clock=clock, **QUICK, **kw)


# ---------------------------------------------------------------- the core: one epoch, one notion


def test_an_epoch_runs_what_lightning_runs():
    assert [EpochLength(64, 2).samples_at(b) for b in (4, 8, 16, 64)] == [8, 16, 32, 64]
    assert [EpochLength(60, 0.25).batches(b) for b in (4, 8, 16)] == [3, 2, 1]  # int(15 * .25), int(8 * .25), ...
    assert EpochLength(60, 0.25).samples_at(8) == 16
    assert EpochLength(40, drop_last=True).samples_at(16) == 32
    assert EpochLength(None, 2).batches(8) == 2 and EpochLength(None, 2).samples_at(8) is None
    assert EpochLength(None).batches(8) is None
    # a whole optimizer step of `accumulate` full batches, or not
    assert [EpochLength(64, 2).holds(m, a) for m, a in [(4, 4), (8, 2), (16, 1)]] == [False, True, True]
    assert [EpochLength(20).holds(8, 3), EpochLength(24).holds(8, 3)] == [False, True]
    assert EpochLength(None, 2).holds(4, 4) is False and EpochLength(None).holds(4, 4) is True
    assert EpochLength(64, 0.2).largest_batch(1) == 15 and EpochLength(64, 1).largest_batch(4) == 0
    assert EpochLength(None).largest_batch() is None


def test_the_ladder_stops_where_an_epoch_holds_a_whole_step():
    assert capped_ladder([16, 32, 64, 128], EpochLength(100, 2)) == [16, 32, 64, 100]  # an int limit: any batch
    assert capped_ladder([16, 32, 64, 128], EpochLength(100, 0.25)) == [16, 32, 33]
    assert capped_ladder([4, 8, 16, 32, 64], EpochLength(64), accumulate=2) == [4, 8, 16, 32]
    with pytest.raises(ValueError, match="runs no whole optimizer step of 4 batches"):
        capped_ladder([4, 8], EpochLength(64, 2), accumulate=4)


def test_the_accumulation_search_keeps_the_direct_batch_within_min_gain():
    def run(rates, **kw):
        search = AccumulationSearch(sorted(rates), **kw)
        while (size := search.propose()) is not None:
            fits = rates[size] is not None
            search.observe(TrialResult(size, 1.0, 0, rates[size], "ok" if fits else "oom"))
        return [r.size for r in search.results], search.result.size

    assert run({4: 400.0, 8: 1016.0, 16: 1000.0}) == ([4, 8, 16], 16)  # 1.6 %: noise, the direct batch
    assert run({4: 400.0, 8: 1100.0, 16: 1000.0}) == ([4, 8, 16], 8)  # 10 %: it pays
    assert run({4: 1000.0, 8: 900.0, 16: 1200.0}) == ([4, 8, 16], 16)  # a slower 8 does not end it
    assert run({4: 400.0, 8: 1000.0, 16: None}) == ([4, 8, 16], 8)
    assert run({4: 400.0, 8: 1016.0, 16: 1000.0}, min_gain=0.0) == ([4, 8, 16], 8)


# ---------------------------------------------------------------- item 2: GradientAccumulationScheduler


@pytest.mark.parametrize("scheduler_first", [True, False])
def test_a_gradient_accumulation_scheduler_beside_the_accumulation_tuner_is_refused_before_measuring(
    tmp_path, scheduler_first
):
    clock, probe = BatchClock(), FakeProbe()
    tuner, scheduler = accumulation_tuner(clock, probe), GradientAccumulationScheduler({1: 2})
    callbacks = [scheduler, clock, tuner] if scheduler_first else [clock, tuner, scheduler]
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=2, callbacks=callbacks))
    with pytest.raises(
        ValueError,
        match=r"GradientAccumulationScheduler\(scheduling=\{0: 1, 1: 2\}\) and AccumulationTuner both set"
        r" `accumulate_grad_batches`: the scheduler would reset AccumulationTuner's choice at every epoch start.*"
        r" remove GradientAccumulationScheduler from `Trainer\(callbacks=...\)`",
    ):
        trainer.fit(TinyModel(batch_size=4))
    assert probe.resets == 0 and not tuner.results  # refused in setup, before any trial


def test_the_trainers_own_accumulation_beside_the_accumulation_tuner_names_what_to_remove(tmp_path):
    tuner = accumulation_tuner(BatchClock())
    trainer = Trainer(**trainer_kwargs(tmp_path, accumulate_grad_batches=2, callbacks=[tuner]))
    with pytest.raises(ValueError, match=r"remove `accumulate_grad_batches` from the Trainer \(AccumulationTuner"):
        trainer.fit(TinyModel(batch_size=4))
    assert not tuner.results


@pytest.mark.parametrize("setter", ["trainer", "scheduler"])
def test_the_batch_size_tuner_measures_at_the_accumulation_in_force_and_says_so(tmp_path, setter):
    """Item 7: the rows said "x 1" while the Trainer accumulated; and no size is chosen of which an epoch holds no
    whole optimizer step (64 samples: at 64, one batch for a step of two)."""
    clock, seen = BatchClock(), StepSamples()
    tuner = batch_tuner(clock)
    kw = {"accumulate_grad_batches": 2} if setter == "trainer" else {}
    callbacks = [clock, tuner, seen] + ([GradientAccumulationScheduler({0: 2})] if setter == "scheduler" else [])
    Trainer(**trainer_kwargs(tmp_path, max_epochs=2, max_steps=2, callbacks=callbacks, **kw)).fit(
        TinyModel(batch_size=4, n=64)
    )
    assert [(r.size, r.accumulate) for r in tuner.results] == [(4, 2), (8, 2), (16, 2), (32, 2)]
    assert tuner.batch_size == 32
    assert seen.steps == [64, 64]  # two batches of 32 in every optimizer step


# ---------------------------------------------------------------- item 3: the epoch the Trainer really runs


@pytest.mark.parametrize(
    "n, limit",
    [(64, {"limit_train_batches": 2}), (60, {"limit_train_batches": 0.25}), (64, {"overfit_batches": 2})],
    ids=["int", "fraction", "overfit_batches"],
)
def test_the_accumulation_tuner_tries_only_micro_batches_an_epoch_holds_a_whole_step_of(tmp_path, n, limit):
    clock, seen = BatchClock(small_is_fast), StepSamples()
    tuner = accumulation_tuner(clock)
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=2, callbacks=[clock, tuner, seen], **limit))
    trainer.fit(TinyModel(batch_size=4, n=n))
    # 4 x 4 is the fastest, but an epoch runs 2 (or 3) batches: every optimizer step would hold 8 (12) samples
    assert [(r.size, r.accumulate) for r in tuner.results] == [(8, 2), (16, 1)]
    assert (tuner.batch_size, tuner.accumulate_grad_batches) == (8, 2)
    assert seen.steps and all(samples == 16 for samples in seen.steps)


def test_an_epoch_that_holds_no_whole_step_at_any_micro_batch_is_refused(tmp_path):
    probe = FakeProbe()
    tuner = accumulation_tuner(BatchClock(), probe)
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=1, limit_train_batches=0.2, callbacks=[tuner]))
    with pytest.raises(
        ValueError,
        match=r"`effective_batch_size` 16 needs 16 samples per device for one optimizer step, but with"
        r" `Trainer\(limit_train_batches=0.2\)` an epoch runs at most 12 samples per device: .*; raise"
        r" `Trainer\(limit_train_batches=0.2\)` or lower `effective_batch_size`",
    ):
        trainer.fit(TinyModel(batch_size=4, n=64))
    assert probe.resets == 0


def test_the_batch_size_ladder_stops_where_a_fraction_of_the_epoch_still_runs_a_batch(tmp_path):
    clock, seen = BatchClock(), StepSamples()
    tuner = batch_tuner(clock, init_size=16, max_size=128)
    callbacks = [clock, tuner, seen]
    Trainer(**trainer_kwargs(tmp_path, max_epochs=1, limit_train_batches=0.25, callbacks=callbacks)).fit(
        TinyModel(batch_size=4, n=100)
    )
    # at 64, a quarter of 2 batches is none: Lightning would refuse to train at the size chosen
    assert [r.size for r in tuner.results] == [16, 32, 33]
    assert seen.steps == [tuner.batch_size]


def test_the_batch_size_tuner_refuses_an_accumulation_no_epoch_holds(tmp_path):
    tuner = batch_tuner(BatchClock())
    kw = dict(max_epochs=1, limit_train_batches=2, accumulate_grad_batches=4, callbacks=[tuner])
    with pytest.raises(
        ValueError, match=r"`Trainer\(accumulate_grad_batches=4\)` makes one optimizer step 4 batches, but"
    ):
        Trainer(**trainer_kwargs(tmp_path, **kw)).fit(TinyModel(batch_size=4))
    assert not tuner.results


# ---------------------------------------------------------------- item 4: two batch-size searches


class MyFinder(BatchSizeFinder):
    pass


def _searchers(kind, clock, probe):
    if kind == "finder+batch":
        return [BatchSizeFinder(init_val=2, max_trials=2, steps_per_trial=1), batch_tuner(clock, probe)]
    if kind == "finder+accumulation":
        return [MyFinder(init_val=2, max_trials=2, steps_per_trial=1), accumulation_tuner(clock, probe)]
    return [batch_tuner(clock, probe), accumulation_tuner(clock, probe)]


@pytest.mark.parametrize(
    "kind, message",
    [
        ("finder+batch", r"BatchSizeFinder and BatchSizeTuner are both in the Trainer's callbacks and each sets the"
         r" batch size at fit start: .* \(moving from Lightning's tuner: remove BatchSizeFinder; BatchSizeTuner"),
        ("finder+accumulation", r"MyFinder \(a BatchSizeFinder\) and AccumulationTuner are both in"),
        ("batch+accumulation", r"BatchSizeTuner and AccumulationTuner are both in .*AccumulationTuner chooses the"
         r" micro-batch for a fixed effective batch"),
    ],
)  # fmt: skip
def test_two_batch_size_searches_are_refused_with_one_message_whatever_the_order(tmp_path, kind, message):
    errors = []
    for order in (1, -1):
        clock, probe, model = BatchClock(), FakeProbe(), TinyModel(batch_size=4)
        callbacks = [clock, *_searchers(kind, clock, probe)[::order]]
        trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=callbacks))
        with pytest.raises(ValueError, match=message) as err:
            trainer.fit(model)
        errors.append(str(err.value))
        assert probe.resets == 0 and model.batch_size == 4  # nothing measured, the finder did not run either
    assert errors[0] == errors[1]


# ---------------------------------------------------------------- item 6: a gain within timing noise


@pytest.mark.parametrize("gain, chosen", [(1.016, (16, 1)), (1.10, (8, 2))])
def test_the_accumulation_tuner_leaves_the_direct_batch_only_for_a_gain_beyond_noise(tmp_path, gain, chosen):
    seconds = {4: 0.1, 8: 0.05 / gain, 16: 0.1}  # per batch: 16 x 1 runs 160 samples/s, 8 x 2 160 x gain
    clock = BatchClock(lambda n: seconds[n])
    tuner = accumulation_tuner(clock)
    Trainer(**trainer_kwargs(tmp_path, max_epochs=1, max_steps=1, callbacks=[clock, tuner])).fit(
        TinyModel(batch_size=4, n=64)
    )
    rates = {r.size: r.samples_per_sec for r in tuner.results}
    assert rates[8] == pytest.approx(160 * gain) and rates[16] == pytest.approx(160)
    assert (tuner.batch_size, tuner.accumulate_grad_batches) == chosen


# ---------------------------------------------------------------- item 7: min_micro_batch


def test_a_min_micro_batch_above_the_effective_batch_is_refused_at_construction():
    with pytest.raises(ValueError, match=r"`min_micro_batch` must be <= `effective_batch_size` \(256\), got 512"):
        AccumulationTuner(256, min_micro_batch=512)


def test_a_min_micro_batch_above_the_per_device_batch_is_refused_in_setup():
    tuner = AccumulationTuner(16, min_micro_batch=16, cache=False)
    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False, enable_progress_bar=False)
    with pytest.raises(
        ValueError, match=r"`min_micro_batch` 16 is larger than the 8 samples per device that `effective_batch_size`"
    ):
        tuner.setup(trainer, TinyModel(), "fit")


def test_the_plan_command_refuses_a_min_micro_batch_above_the_effective_batch(monkeypatch, capsys):
    from lightning_memguard.commands import cli

    def went_on(*args, **kwargs):
        raise AssertionError("the command went on with --min-micro-batch 512")

    monkeypatch.setattr(cli, "_check_model_input", went_on)
    argv = ["plan", "--model", "resnet18", "--image-size", "32", "--device", "cpu"]
    assert cli.main([*argv, "--effective-batch", "256", "--min-micro-batch", "512"]) == 2
    assert "--min-micro-batch 512 is larger than --effective-batch 256" in capsys.readouterr().err


# ---------------------------------------------------------------- max_time and an iterable without length


def test_the_search_does_not_count_against_max_time(tmp_path, monkeypatch):
    """Decided: as with Lightning's BatchSizeFinder, the Timer starts at ``on_train_start``, after the search; the
    trials, which take longer than ``max_time`` here, leave the run its whole time."""
    from lightning.pytorch.callbacks import timer

    clock = BatchClock(lambda n: 1.0)  # every batch takes one second
    monkeypatch.setattr(timer, "time", types.SimpleNamespace(monotonic=clock))
    tuner, seen = accumulation_tuner(clock), StepSamples()
    Trainer(**trainer_kwargs(tmp_path, max_epochs=10, max_time={"seconds": 5}, callbacks=[clock, tuner, seen])).fit(
        TinyModel(batch_size=4, n=64)
    )
    assert tuner.search_s >= 10  # seconds of the injected clock
    assert sum(seen.steps) + seen.pending == 5 * tuner.batch_size  # five batches: the Timer's five seconds


class Stream(IterableDataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __iter__(self):
        return zip(self.x, self.y, strict=True)


class Streamed(TinyModel):
    def train_dataloader(self):
        return DataLoader(Stream(self.x, self.y), batch_size=self.batch_size)


@pytest.mark.parametrize("limit, tried, chosen", [(None, [4, 8, 16], (4, 4)), (2, [8, 16], (8, 2))])
def test_an_iterable_without_length(tmp_path, limit, tried, chosen):
    """Decided: no length: one pass counts the samples up to what a step needs (here 64 > 16: a stream that long is
    taken to run whole steps, no cap; a shorter one is capped, tests/tuning/test_tuning_users_runs.py); an int
    ``limit_train_batches`` still caps the batches of an epoch, and micro-batches that need more per step are left
    out."""
    clock, seen = BatchClock(small_is_fast), StepSamples()
    tuner = accumulation_tuner(clock)
    kw = {} if limit is None else {"limit_train_batches": limit}
    Trainer(**trainer_kwargs(tmp_path, max_epochs=1, max_steps=2, callbacks=[clock, tuner, seen], **kw)).fit(
        Streamed(batch_size=4, n=64)
    )
    assert [r.size for r in tuner.results] == tried
    assert (tuner.batch_size, tuner.accumulate_grad_batches) == chosen
    assert seen.steps == [16] * len(seen.steps) and seen.steps


def test_limit_train_batches_zero_measures_nothing(tmp_path):
    probe = FakeProbe()
    tuner = accumulation_tuner(BatchClock(), probe)
    Trainer(**trainer_kwargs(tmp_path, max_epochs=1, limit_train_batches=0, callbacks=[tuner])).fit(TinyModel())
    assert probe.resets == 0 and tuner.batch_size is None
