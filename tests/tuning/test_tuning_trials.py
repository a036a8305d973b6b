"""A tuner's trials in a real Trainer on the CPU: the choice set, a spill or an OOM not fitting, everything put back."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from conftest import FakeProbe, TinyModel, trainer_kwargs
from lightning.pytorch import Callback, LightningModule, Trainer
from tuner_helpers import BatchClock

from lightning_memguard import AccumulationTuner, BatchSizeTuner
from lightning_memguard.testing import ImageClassifier


class Snapshot(Callback):
    """At the first training batch after tuning: weights, optimizer state, RNG, counters (run one batch)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if hasattr(self, "weights"):
            return
        self.weights = copy.deepcopy(pl_module.state_dict())
        self.optim = copy.deepcopy(trainer.optimizers[0].state_dict())
        self.rng = (torch.get_rng_state(), random.getstate())
        self.global_step = trainer.global_step
        self.batch_size = pl_module.batch_size
        self.accumulate = trainer.accumulate_grad_batches
        loader = trainer.fit_loop._combined_loader
        self.loader_batch = loader.flattened[0].batch_size if loader is not None else None
        self.first_batch = batch


class MemoryByBatch(FakeProbe):
    """Peak memory grows with the model's batch size: 100 MB per sample."""

    def __init__(self, model, capacity):
        super().__init__(capacity=capacity)
        self.model = model

    def read(self):
        self.peak = self.model.batch_size * 100 * 10**6
        return super().read()


def small(**kwargs):
    defaults = dict(arch="resnet18", image_size=16, batch_size=4, steps_per_epoch=50, pool_size=16)
    defaults.update(kwargs)
    return ImageClassifier(**defaults)


def test_batch_size_tuner_sets_the_attribute_and_restores_everything(tmp_path):
    control = Snapshot()  # the same run without the tuner: what "restored" means
    torch.manual_seed(0), random.seed(0)
    Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[control], limit_train_batches=1)).fit(small())

    torch.manual_seed(0), random.seed(0)
    model = small()
    before = copy.deepcopy(model.state_dict())
    probe = MemoryByBatch(model, capacity=int(4e9))  # 40 samples fit below the capacity; 38 within the headroom
    tuner = BatchSizeTuner(init_size=4, max_size=64, probe=probe, cache=False, warmup_steps=1, timed_steps=2)
    snap = Snapshot()
    rng_before = control.rng
    Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[tuner, snap], limit_train_batches=1)).fit(model)

    tried = [r.size for r in tuner.results]
    assert tried[:1] == [4] and all(r.size <= 64 for r in tuner.results)
    assert all((r.outcome == "ok") == (r.size * 100e6 <= 4e9 * 0.95) for r in tuner.results)
    assert tuner.batch_size in [r.size for r in tuner.results if r.fits]  # never an untried size
    assert snap.batch_size == tuner.batch_size == snap.loader_batch
    assert snap.global_step == 0 and snap.optim["state"] == {}
    assert all(torch.equal(before[k], v) for k, v in snap.weights.items())
    assert torch.equal(snap.rng[0], rng_before[0]) and snap.rng[1] == rng_before[1]
    assert snap.first_batch.shape[0] == tuner.batch_size


def test_batch_size_tuner_rejects_a_spilling_size(tmp_path):
    model = small()
    probe = MemoryByBatch(model, capacity=int(1e9))  # 8 fits, 16 is over 1 GB: a spill
    clock = BatchClock()  # throughput rises with the size: the search climbs until something does not fit
    tuner = BatchSizeTuner(
        init_size=4, max_size=64, probe=probe, cache=False, warmup_steps=1, timed_steps=2, clock=clock, predict=False
    )  # (run, not predicted: the trial's own verdict is what is tested)
    callbacks = [clock, tuner, Snapshot()]
    Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=callbacks, limit_train_batches=1)).fit(model)
    assert [(r.size, r.outcome) for r in tuner.results] == [(4, "ok"), (8, "ok"), (16, "spill")]
    assert tuner.batch_size == 8
    assert model.batch_size == tuner.batch_size


class OomAbove(ImageClassifier):
    def __init__(self, limit, **kwargs):
        super().__init__(**kwargs)
        self.limit = limit

    def training_step(self, batch, batch_idx):
        if batch.shape[0] > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return super().training_step(batch, batch_idx)


def test_oom_trials_count_as_not_fitting_and_state_is_restored(tmp_path):
    model = OomAbove(20, arch="resnet18", image_size=16, batch_size=4, steps_per_epoch=50, pool_size=16)
    before = copy.deepcopy(model.state_dict())
    tuner = BatchSizeTuner(
        mode="max_fit", init_size=4, max_size=64, probe=FakeProbe(), cache=False, warmup_steps=1, timed_steps=1
    )
    snap = Snapshot()
    Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[tuner, snap], limit_train_batches=1)).fit(model)
    assert [(r.size, r.outcome) for r in tuner.results] == [(4, "ok"), (8, "ok"), (16, "ok"), (32, "oom"), (24, "oom")]
    assert tuner.batch_size == 16
    assert all(torch.equal(before[k], v) for k, v in snap.weights.items())


class Broken(ImageClassifier):
    def training_step(self, batch, batch_idx):
        if batch.shape[0] > 8:
            raise KeyError("not a memory problem")
        return super().training_step(batch, batch_idx)


def test_other_errors_propagate_after_restoring(tmp_path):
    model = Broken(arch="resnet18", image_size=16, batch_size=4, steps_per_epoch=50, pool_size=16)
    clock = BatchClock()  # throughput rises with the size: the search reaches 16, where the model breaks
    tuner = BatchSizeTuner(
        init_size=4, max_size=64, probe=FakeProbe(), cache=False, warmup_steps=1, timed_steps=1, clock=clock
    )
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[clock, tuner]))
    with pytest.raises(KeyError, match="not a memory problem"):
        trainer.fit(model)
    assert model.batch_size == 4  # put back


def test_missing_batch_size_attribute_is_a_clear_error(tmp_path):
    model = TinyModel()
    del model.batch_size
    trainer = Trainer(**trainer_kwargs(tmp_path, callbacks=[BatchSizeTuner(cache=False)]))
    with pytest.raises(ValueError, match="no `batch_size` attribute on the model, its hparams or the datamodule"):
        trainer.fit(model)


class ReadOnlyBatchSize(TinyModel):
    """TinyModel whose batch size is a property without a setter, read from a config it keeps."""

    def __init__(self) -> None:
        LightningModule.__init__(self)
        self.config, self.n, self.val = {"batch_size": 8}, 64, False
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
        self.x, self.y = torch.randn(64, 16), torch.randint(0, 2, (64,))

    @property
    def batch_size(self) -> int:  # type: ignore[override]
        return self.config["batch_size"]


def test_a_read_only_batch_size_property_is_refused_saying_what_to_do(tmp_path):
    trainer = Trainer(**trainer_kwargs(tmp_path, callbacks=[BatchSizeTuner(cache=False)]))
    # before: Python's bare "property 'batch_size' of 'ReadOnlyBatchSize' object has no setter", mid-search
    with pytest.raises(ValueError, match="`batch_size` on ReadOnlyBatchSize is a read-only property: the tuner sets"):
        trainer.fit(ReadOnlyBatchSize())


def test_resume_reapplies_without_searching_and_cache_skips_the_search(tmp_path):
    kwargs = dict(init_size=4, max_size=16, warmup_steps=1, timed_steps=1, cache_dir=str(tmp_path / "cache"))
    tuner = BatchSizeTuner(**kwargs)
    trainer = Trainer(
        **trainer_kwargs(tmp_path, max_epochs=1, limit_train_batches=2, enable_checkpointing=True, callbacks=[tuner])
    )
    trainer.fit(small())
    chosen, trials = tuner.batch_size, len(tuner.results)
    assert trials >= 2

    resumed = BatchSizeTuner(**kwargs)
    model = small()
    trainer2 = Trainer(**trainer_kwargs(tmp_path, max_epochs=2, limit_train_batches=2, callbacks=[resumed]))
    trainer2.fit(model, ckpt_path=trainer.checkpoint_callback.best_model_path)
    assert resumed.batch_size == chosen == model.batch_size and len(resumed.results) == trials
    assert not resumed.from_cache

    cached = BatchSizeTuner(**kwargs)
    model = small()
    Trainer(**trainer_kwargs(tmp_path, max_epochs=1, limit_train_batches=2, callbacks=[cached])).fit(model)
    assert cached.from_cache and cached.batch_size == chosen == model.batch_size

    uncached = BatchSizeTuner(**{**kwargs, "cache": False})
    Trainer(**trainer_kwargs(tmp_path, max_epochs=1, limit_train_batches=2, callbacks=[uncached])).fit(small())
    assert not uncached.from_cache


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"mode": "largest"}, ValueError, "`mode` must be one of"),
        ({"init_size": 0}, ValueError, "`init_size` must be >= 1, got 0"),
        ({"init_size": 64, "max_size": 32}, ValueError, "`max_size` must be >= 64, got 32"),
        ({"headroom": 1.0}, ValueError, r"`headroom` must be in \[0, 1\), got 1.0"),
        ({"capacity": "16XB"}, ValueError, "`capacity` must be .*'16XB'"),
        ({"timed_steps": 0}, ValueError, "`timed_steps` must be >= 1, got 0"),
        ({"probe": 3}, TypeError, "`probe` must have capacity"),
    ],
)
def test_batch_size_tuner_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        BatchSizeTuner(**kwargs)


# ---------------------------------------------------------------- AccumulationTuner


def test_accumulation_tuner_sets_micro_batch_and_accumulation(tmp_path):
    model = small(batch_size=7)
    probe = MemoryByBatch(model, capacity=int(2e9))  # micro-batches above 19 do not fit
    clock = BatchClock()  # 10 ms + 1 ms per sample: larger micro-batches are faster
    tuner = AccumulationTuner(
        effective_batch_size=64, min_micro_batch=8, probe=probe, cache=False, warmup_steps=1, timed_steps=1,
        clock=clock,
    )  # fmt: skip
    snap = Snapshot()
    callbacks = [clock, tuner, snap]
    with pytest.warns(UserWarning, match="BatchNorm, whose statistics are now per micro-batch of"):
        # one optimizer step after tuning (an epoch limited to one batch would hold no step of 4 micro-batches)
        Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=callbacks, max_steps=1)).fit(model)
    assert [(r.size, r.accumulate, r.outcome) for r in tuner.results] == [
        (8, 8, "ok"),
        (16, 4, "ok"),
        (32, 2, "predicted_over"),  # 8 and 16 put 32 at 3.2 GB on the 2 GB card: not run
    ]
    assert (tuner.batch_size, tuner.accumulate_grad_batches) == (16, 4)
    assert snap.batch_size == tuner.batch_size and snap.accumulate == tuner.accumulate_grad_batches
    assert snap.loader_batch == tuner.batch_size


def test_accumulation_tuner_errors(tmp_path):
    with pytest.raises(ValueError, match="`effective_batch_size` must be >= 1, got 0"):
        AccumulationTuner(effective_batch_size=0)
    trainer = Trainer(
        **trainer_kwargs(tmp_path, accumulate_grad_batches=4, callbacks=[AccumulationTuner(64, cache=False)])
    )
    with pytest.raises(ValueError, match="Trainer\\(accumulate_grad_batches=4\\) and AccumulationTuner both set"):
        trainer.fit(small())

    class Manual(ImageClassifier):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            return None

    trainer = Trainer(**trainer_kwargs(tmp_path, callbacks=[AccumulationTuner(64, cache=False)]))
    with pytest.raises(ValueError, match="AccumulationTuner needs automatic optimization"):
        trainer.fit(Manual(image_size=16, batch_size=4, steps_per_epoch=2))


def test_nothing_fits_falls_back_to_checkpointing_when_allowed(tmp_path):
    model = small(batch_size=8)
    fits_once_checkpointed = FakeProbe(capacity=int(1e9), peak=int(2e9))

    class Shrinks(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            from lightning_memguard.checkpointing import is_checkpointed

            if any(is_checkpointed(m) for m in pl_module.modules()):
                fits_once_checkpointed.peak = int(0.5e9)

    shrink = Shrinks()
    shrink.memguard_keep_in_trials = True
    tuner = AccumulationTuner(
        16,
        min_micro_batch=8,
        probe=fits_once_checkpointed,
        allow_checkpointing=True,
        cache=False,
        warmup_steps=1,
        timed_steps=1,
    )
    Trainer(**trainer_kwargs(tmp_path, max_epochs=1, limit_train_batches=2, callbacks=[shrink, tuner])).fit(model)
    assert tuner.checkpointing is True
    assert tuner.batch_size in (8, 16)

    stuck = AccumulationTuner(
        16,
        min_micro_batch=8,
        probe=FakeProbe(capacity=int(1e9), peak=int(2e9)),
        cache=False,
        warmup_steps=1,
        timed_steps=1,
    )
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[stuck]))
    with pytest.raises(RuntimeError, match="not even a micro-batch of 8 fits"):
        trainer.fit(small(batch_size=8))


class Grads(Callback):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads = [p.grad.detach().clone() for p in pl_module.parameters()]
        trainer.should_stop = True


class NormFree(TinyModel):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


@pytest.mark.parametrize("k", [2, 4, 8])
def test_accumulated_gradients_equal_the_direct_batch(tmp_path, k):
    """k x (B/k) micro-batches give the gradient of the direct batch B (mean loss, normalization-free model)."""
    direct, accumulated = Grads(), Grads()
    torch.manual_seed(0)
    Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[direct])).fit(NormFree(batch_size=64, n=64))
    torch.manual_seed(0)
    Trainer(**trainer_kwargs(tmp_path, max_epochs=1, accumulate_grad_batches=k, callbacks=[accumulated])).fit(
        NormFree(batch_size=64 // k, n=64)
    )
    for a, b in zip(direct.grads, accumulated.grads, strict=True):
        assert ((a - b).norm() / a.norm()).item() < 1e-5


def test_a_trial_that_spills_ends_after_its_first_step(tmp_path):
    model = small()
    probe = MemoryByBatch(model, capacity=int(1e9))  # 16 is over 1 GB: a spill from its first step
    steps = Counter()
    steps.memguard_keep_in_trials = True
    clock = BatchClock()
    tuner = BatchSizeTuner(init_size=4, max_size=64, probe=probe, cache=False, warmup_steps=2, timed_steps=4,
                           clock=clock, predict=False)  # fmt: skip
    callbacks = [clock, steps, tuner]
    Trainer(**trainer_kwargs(tmp_path, max_epochs=1, limit_train_batches=1, callbacks=callbacks)).fit(model)
    assert [(r.size, r.outcome) for r in tuner.results] == [(4, "ok"), (8, "ok"), (16, "spill")]
    assert tuner.batch_size == 8
    assert steps.by_size[4] == 6  # 2 warm-up + 4 timed
    assert steps.by_size[8] == 6 + 1  # and the real run's one batch: the cut trial did not stop it
    assert steps.by_size[16] == 1  # the first step only: memory read after it, the trial ends there


class Counter(Callback):
    def __init__(self):
        self.by_size = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.by_size[batch.shape[0]] = self.by_size.get(batch.shape[0], 0) + 1
