"""A callback kept after its fit (a notebook's ``guard = MemGuard()`` in one cell, fits in the next ones) keeps none
of that fit's model, Trainer or optimizer alive. On a GPU those hold the weights, gradients and optimizer state, which
a second fit in the same process would otherwise find still allocated, the card smaller by that much. This holds for
every public callback, whether the fit ends well, in an exception or by Ctrl+C. What the callback learned stays, and
a second fit with the same instance works."""

from __future__ import annotations

import gc
import signal
import weakref
from collections.abc import Callable

import pytest
import torch
from conftest import StepClock, TinyModel, trainer_kwargs
from lightning.pytorch import Callback, Trainer

from lightning_memguard import AccumulationTuner, ActivationCheckpointing, BatchSizeTuner, MemGuard
from lightning_memguard.testing import SysmemSpillEmulator

# An emulated card of 5.5 kB: TinyModel's step starts from 4.9 kB (weights and gradients) and a batch of 8 saves
# 1.1 kB of activations, so 8 x 1 spills and MemGuard(on_spill="adapt") goes on in micro-batches
SPILLS_AT_8 = 5500
FAILED = "the user's training_step failed"


class Tiny(TinyModel):
    """TinyModel with a ``forward`` (a budget measures it) whose training step fails where asked, in the run's second
    epoch (after the tuners' trials, and after one epoch that MemGuard recorded)."""

    def __init__(self, fails_with: type[BaseException] | None = None) -> None:
        super().__init__()
        self.fails_with = fails_with

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        if self.fails_with is not None and self.current_epoch == 1 and batch_idx == 2:
            raise self.fails_with(FAILED)
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y)


def _adapting() -> list[Callback]:
    emulator = SysmemSpillEmulator(capacity=SPILLS_AT_8, sleep=lambda seconds: None)
    guard = MemGuard(
        on_spill="adapt", probe=emulator.probe, clock=StepClock(), read_every=1, warmup_steps=1, reference_steps=1,
        spill_checkpoint=False,
    )  # fmt: skip
    return [emulator, guard]


def _tuned(tuner: type[BatchSizeTuner | AccumulationTuner], **kwargs) -> list[Callback]:
    return [tuner(**kwargs, cache=False, warmup_steps=1, timed_steps=1, clock=StepClock())]


# each: the callbacks a notebook keeps, and what they learned in a fit (which must stay)
CALLBACKS: dict[str, tuple[Callable[[], list[Callback]], Callable[[list[Callback]], object]]] = {
    "MemGuard": (lambda: [MemGuard(clock=StepClock(), spill_checkpoint=False)], lambda cbs: cbs[0].epochs),
    "MemGuard adapting on SysmemSpillEmulator": (_adapting, lambda cbs: cbs[1].adaptations and cbs[1].reports),
    "BatchSizeTuner": (lambda: _tuned(BatchSizeTuner, init_size=4, max_size=8), lambda cbs: cbs[0].batch_size),
    "AccumulationTuner": (
        lambda: _tuned(AccumulationTuner, effective_batch_size=8, min_micro_batch=4),
        lambda cbs: cbs[0].accumulate_grad_batches,
    ),
    "ActivationCheckpointing": (lambda: [ActivationCheckpointing(units={torch.nn.Linear})], lambda cbs: cbs[0].runs),
    "ActivationCheckpointing with a budget": (
        lambda: [ActivationCheckpointing(units={torch.nn.Linear}, memory_budget=0.5)],
        lambda cbs: cbs[0].runs,
    ),
}

ENDINGS: dict[str, type[BaseException] | None] = {
    "well": None,
    "in an exception": RuntimeError,
    "by Ctrl+C": KeyboardInterrupt,
}


def _fit(tmp_path, callbacks: list[Callback], fails_with: type[BaseException] | None) -> dict[str, weakref.ref]:
    """One fit of a fresh model with ``callbacks``; only weak references to its model, Trainer and optimizer come
    back, as a notebook that drops them (``del model, trainer``) keeps nothing else."""
    model = Tiny(fails_with)
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=2, callbacks=callbacks))
    if fails_with is None:
        trainer.fit(model)
        assert trainer.global_step == 16  # 2 epochs of 8 batches
    elif fails_with is KeyboardInterrupt:
        with pytest.raises(SystemExit, match="1"):  # Lightning's answer to Ctrl+C inside fit
            trainer.fit(model)
    else:
        with pytest.raises(fails_with, match=FAILED):
            trainer.fit(model)
    optimizer = trainer.optimizers[0]
    return {"model": weakref.ref(model), "trainer": weakref.ref(trainer), "optimizer": weakref.ref(optimizer)}


@pytest.fixture
def sigint_kept():
    """Lightning ignores Ctrl+C for the rest of the process once it handled one inside fit: put back afterwards."""
    handler = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, handler)


@pytest.mark.usefixtures("sigint_kept")
@pytest.mark.filterwarnings("ignore:MemGuard adapted:RuntimeWarning", "ignore:memory budget not met")
@pytest.mark.parametrize("ending", list(ENDINGS))
@pytest.mark.parametrize("callback", list(CALLBACKS))
def test_a_kept_callback_keeps_nothing_of_a_finished_fit_alive(tmp_path, callback, ending):
    make, learned = CALLBACKS[callback]
    callbacks = make()
    first = _fit(tmp_path / "first", callbacks, ENDINGS[ending])
    gc.collect()
    assert [name for name, ref in first.items() if ref() is not None] == []  # freed: weights, gradients, optimizer
    assert learned(callbacks)  # what the fit taught the callback stays

    second = _fit(tmp_path / "second", callbacks, None)  # the same instances, a second fit: trains as before
    gc.collect()
    assert [name for name, ref in second.items() if ref() is not None] == []
    assert learned(callbacks)
