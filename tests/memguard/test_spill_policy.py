"""The spill policy's decision table: what each ``on_spill`` does with a spill that every rank agreed on, at a batch's
start and at an epoch's end, and, for ``"adapt"``, where the adapter adapts, cannot adapt, or has reached its floor.

The policies are driven without a Trainer (a stand-in with the few attributes they read) and with the real
``RunAdapter`` on a real LightningModule, so each row is what ``MemGuard`` does at that point of a fit."""

from __future__ import annotations

import ast
import contextlib
import pathlib
import warnings
from types import SimpleNamespace

import pytest
from conftest import TinyModel

import lightning_memguard
from lightning_memguard.callbacks._reporting import MemoryReports
from lightning_memguard.callbacks._spill_policy import spill_policy
from lightning_memguard.core.messages import SysmemSpillError
from lightning_memguard.core.spill import SpillReport, Verdict

SPILL = SpillReport(Verdict.SPILL, "the peak is above the capacity", step=3, used_bytes=6000, capacity=5500)
SIZE = 8  # the run's batch size


def _trainer(model: TinyModel) -> SimpleNamespace:
    """What the policies (and the adapter, and the stop) read of a Trainer: one process, step 3, no logger."""

    def step(*args, **kwargs):
        raise AssertionError("no step runs in these tests")

    strategy = SimpleNamespace(
        training_step=step, backward=step, validation_step=step,
        reduce_boolean_decision=lambda decision, all=True: decision,
    )  # fmt: skip
    return SimpleNamespace(
        strategy=strategy, global_step=3, world_size=1, accumulate_grad_batches=1, loggers=[], should_stop=False,
        lightning_module=model, precision_plugin=SimpleNamespace(train_step_context=contextlib.nullcontext),
    )  # fmt: skip


# the adapter's situation for on_spill="adapt": (MemGuard's adapt_loss, the adapter's state from a checkpoint)
ADAPTER = {
    "adapts": ("mean", {}),  # 8 x 1: split further
    "cannot adapt": ("coupled", {}),  # a loss that couples the samples, and no blocks to checkpoint
    "floor reached": ("mean", {"chunks": SIZE, "weighting": "samples"}),  # 1 x 8 already, and no blocks
}

# on_spill, the adapter's situation -> what a spill agreed at a batch's start does, and one settled at an epoch's end
TABLE = [
    ("raise", None, "raises before the batch trains", "raises"),
    ("stop", None, "stops once the batch has trained", "stops"),
    ("warn", None, "warns when found, goes on", "goes on"),
    ("adapt", "adapts", "adapts, goes on", "adapts, goes on"),
    ("adapt", "cannot adapt", "stops once the batch has trained", "stops"),
    ("adapt", "floor reached", "stops once the batch has trained", "stops"),
]

WHY_NOT = {
    "cannot adapt": "could not adapt: the loss couples the samples of a batch (`MemGuard(adapt_loss='coupled')`)",
    "floor reached": "could not adapt: each micro-batch holds one sample, and activation checkpointing found no blocks",
}


def _policy(on_spill: str, situation: str | None):
    model = TinyModel()
    trainer = _trainer(model)
    loss, state = ADAPTER[situation] if situation is not None else ("auto", {})
    reports = MemoryReports(enabled=False, record=False, spill_checkpoint=False)
    policy = spill_policy(on_spill, reports, False, 0.05, adapt_loss=loss)
    policy.load_state_dict({"adapt": state})
    policy.train_start(trainer, model)
    return policy, trainer, model


def _said(caught: list[warnings.WarningMessage]) -> str:
    return "\n".join(str(w.message) for w in caught)


@pytest.mark.parametrize(("on_spill", "situation", "at_batch_start", "at_epoch_end"), TABLE)
def test_each_on_spill_does_what_its_row_says_with_a_spill_agreed_at_a_batch_start(
    on_spill, situation, at_batch_start, at_epoch_end
):
    policy, trainer, model = _policy(on_spill, situation)
    batch = (model.x[:SIZE], model.y[:SIZE])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        policy.found(trainer, SPILL, SIZE)  # this rank's detector found it
        if not policy.votes:  # no rank votes: nothing is agreed
            warned = "GPU memory is spilling into system RAM" in _said(caught)
            outcome = "warns when found, goes on" if warned else "nothing"
        else:
            try:
                adapted = policy.agreed(trainer, model, SPILL, None, SIZE, batch)
            except SysmemSpillError:
                outcome = "raises before the batch trains"
            else:
                stopped_before = trainer.should_stop
                policy.batch_end(trainer, None, SPILL, None, SIZE)  # the batch in flight trained
                if adapted and not trainer.should_stop and "MemGuard adapted" in _said(caught):
                    outcome = "adapts, goes on"
                elif trainer.should_stop and not stopped_before:
                    outcome = "stops once the batch has trained"
                else:
                    outcome = f"unclear: adapted={adapted}, should_stop={trainer.should_stop}"
    policy.end_fit()
    assert outcome == at_batch_start
    if situation in WHY_NOT:
        assert WHY_NOT[situation] in _said(caught)
    if outcome.startswith("adapts"):
        assert len(policy.adaptations) == 1 and policy.adaptations[0].after > policy.adaptations[0].before


@pytest.mark.parametrize(("on_spill", "situation", "at_batch_start", "at_epoch_end"), TABLE)
def test_each_on_spill_does_what_its_row_says_with_a_spill_in_an_epochs_last_steps(
    on_spill, situation, at_batch_start, at_epoch_end
):
    policy, trainer, model = _policy(on_spill, situation)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            adapted = policy.settle(trainer, model, SPILL, None, SIZE)
        except SysmemSpillError:
            outcome = "raises"
        else:
            if adapted and not trainer.should_stop and "MemGuard adapted" in _said(caught):
                outcome = "adapts, goes on"
            elif trainer.should_stop and not adapted:
                outcome = "stops"
            elif not adapted and not caught:
                outcome = "goes on"
            else:
                outcome = f"unclear: adapted={adapted}, should_stop={trainer.should_stop}"
    policy.end_fit()
    assert outcome == at_epoch_end
    if situation in WHY_NOT:
        assert WHY_NOT[situation] in _said(caught)


@pytest.mark.parametrize("on_spill", ["raise", "stop", "warn", "adapt"])
def test_without_a_spill_on_any_rank_no_policy_acts_at_an_epochs_end(on_spill):
    policy, trainer, model = _policy(on_spill, "adapts" if on_spill == "adapt" else None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert policy.settle(trainer, model, None, None, SIZE) is False
    policy.end_fit()
    assert not trainer.should_stop and not caught and policy.adaptations == []


def test_memguard_asks_its_spill_policy_and_drives_no_adapter_and_no_response_itself():
    source = pathlib.Path(lightning_memguard.__file__).parent / "callbacks" / "memguard.py"
    imported = {
        node.module
        for node in ast.walk(ast.parse(source.read_text()))
        if isinstance(node, ast.ImportFrom) and node.module is not None
    }
    assert "lightning_memguard.callbacks._spill_policy" in imported
    assert not imported & {"lightning_memguard.tuning.adapter", "lightning_memguard.callbacks._spill_response"}
    assert "adapter" not in source.read_text()


def test_a_setting_changed_between_two_fits_is_the_second_fits(tmp_path):
    """As before the policy: MemGuard reads ``on_spill`` and the adapter's settings at each fit's start."""
    from lightning import Trainer

    from lightning_memguard import MemGuard
    from lightning_memguard.callbacks._spill_policy import AdaptOnSpill, StopOnSpill

    guard = MemGuard(on_spill="stop")
    first = guard._policy
    trainer = Trainer(accelerator="cpu", max_steps=1, callbacks=[guard], logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(TinyModel())
    assert isinstance(guard._policy, StopOnSpill) and guard._policy is first  # unchanged: the same policy
    guard.on_spill, guard.grow_every = "adapt", 7
    trainer = Trainer(accelerator="cpu", max_steps=1, callbacks=[guard], logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(TinyModel())
    assert isinstance(guard._policy, AdaptOnSpill) and guard._policy.chosen_from[4] == 7
