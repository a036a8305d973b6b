"""MemGuard(on_spill="adapt") on a model with blocks: the savers that keep the batch whole (the levers' planner:
checkpointing, pointwise recomputation) come before a split, and go last when memory frees. CPU twins under the
emulator, with the figures of a residual MLP of four blocks."""

from __future__ import annotations

import weakref

import pytest
import torch
from conftest import ddp_scenario_results, trainer_kwargs
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from models import Block, Blocks
from test_adapt import _close, _run

from lightning_memguard.checkpointing import apply_plan, is_checkpointed
from lightning_memguard.levers import LeverPlan, apply_record, plan_levers, remove_levers
from lightning_memguard.tuning.adapt import Adaptation
from lightning_memguard.tuning.adapter import RunAdapter

CAPACITY = 56 * 10**6
GUARD = {"headroom": 0.01}  # 55.44 MB usable: the room is 4.70 MB less what others take
HELD = 1_500_000  # the batch of 64 spills (56.8 MB); the room, 3.2 MB, is met by checkpointing blocks
NOT_HELD = 3_000_000  # the room, 1.7 MB, is below the floor (2.4 MB, every block): the savers and two micro-batches


def _plain(tmp_path, max_epochs=2, ckpt_path=None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = Blocks()
    Trainer(**trainer_kwargs(tmp_path / "plain", max_epochs=max_epochs)).fit(model, ckpt_path=ckpt_path)
    return [p.detach().clone() for p in model.parameters()]


def _oom(times: int = 1):
    """A change to the model (``Events``' ``model_changes``): its next ``times`` training steps run out of memory."""
    return lambda model: setattr(model, "ooms", times)


def _checkpointed(model) -> list[str]:
    return [name for name, m in model.named_modules() if is_checkpointed(m)]


def test_where_the_savers_plan_holds_the_batch_stays_whole_with_the_same_gradients_bit_for_bit(tmp_path):
    trainer, guard, events, model = _run(
        tmp_path, others={4: HELD}, model=Blocks, capacity=CAPACITY, guard_kwargs=GUARD
    )  # fmt: skip
    (adapted,) = guard.adaptations
    assert (adapted.before, adapted.after, adapted.checkpointing) == (1, 1, True)
    assert adapted.savers.startswith("levers: block recomputed in blocks.") and "budget not met" not in adapted.savers
    assert "no fused loss" not in adapted.savers  # a model without a vocabulary head: nothing to say of it
    assert events.micro_batches == [[64]] * 16 and events.samples_per_step == [64] * 16  # never split
    assert trainer.global_step == 16 and _checkpointed(model)
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), _plain(tmp_path), strict=True))


def test_the_switch_is_timed_by_memguards_clock_and_said(tmp_path):
    # the StepClock of _run advances 0.1 s a call: the switch reads it as it starts and as it ends
    _, guard, _, _ = _run(tmp_path, others={4: HELD}, model=Blocks, capacity=CAPACITY, guard_kwargs=GUARD)
    (adapted,) = guard.adaptations
    assert adapted.switch_s == pytest.approx(0.1)
    assert "; the savers, in 0.10 s: levers: block recomputed" in adapted.line()
    assert Adaptation(**adapted.to_dict()) == adapted  # as a checkpoint keeps it


def test_where_the_savers_plan_does_not_hold_they_stay_on_and_the_batch_is_split(tmp_path):
    trainer, guard, events, model = _run(
        tmp_path, others={4: NOT_HELD}, model=Blocks, capacity=CAPACITY, guard_kwargs=GUARD
    )  # fmt: skip
    (adapted,) = guard.adaptations
    assert (adapted.before, adapted.after, adapted.checkpointing) == (
        1,
        2,
        True,
    )  # from the floor: 2 (the readings alone: 4)
    assert "budget not met" in adapted.savers and "now 32 x 2, activation checkpointing on" in adapted.line()
    assert _checkpointed(model) and events.samples_per_step == [64] * 16
    assert all(m == [32, 32] for m in events.micro_batches[adapted.step + 1 :])
    assert _close(model, _plain(tmp_path))


def test_an_out_of_memory_error_takes_the_savers_planned_for_the_latest_readings_room(tmp_path):
    # a 55.5 MB card: the batch of 64 fits (55.26 MB), the room by the readings is 4.2 MB: some blocks free enough
    trainer, guard, events, model = _run(
        tmp_path, model_changes={5: _oom()}, model=Blocks, capacity=55_500_000, guard_kwargs=GUARD
    )  # fmt: skip
    (adapted,) = guard.adaptations
    assert adapted.why.endswith("ran out of memory") and (adapted.after, adapted.checkpointing) == (1, True)
    assert "budget not met" not in adapted.savers and events.micro_batches[5] == [64, 64]  # redone whole
    assert trainer.global_step == 16 and events.samples_per_step == [64] * 16
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), _plain(tmp_path), strict=True))


def test_an_out_of_memory_error_before_any_reading_plans_for_the_room_read_as_it_is_handled(tmp_path):
    # the first step fails: no reading between steps yet; the room is read once the failed step's tensors are gone,
    # less the gradients and momentum it would have made: 55.5 MB x 0.99 - 50.74 MB = 4.2 MB, as at step 5
    trainer, guard, events, model = _run(
        tmp_path, model_changes={0: _oom()}, model=Blocks, capacity=55_500_000, guard_kwargs=GUARD
    )  # fmt: skip
    (adapted,) = guard.adaptations
    assert adapted.step == 0 and (adapted.after, adapted.checkpointing) == (1, True)
    assert adapted.savers.startswith("levers: ") and "budget 4.2 MB" in adapted.savers  # planned for the room
    assert "budget not met" not in adapted.savers
    assert events.micro_batches[0] == [64, 64] and events.samples_per_step == [64] * 16  # redone whole
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), _plain(tmp_path), strict=True))


def _plan_fails(monkeypatch):
    import lightning_memguard.tuning.adapter as adapter

    def fails(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (injected, while the savers are measured)")

    monkeypatch.setattr(adapter, "plan_levers", fails)


@pytest.mark.parametrize("ooms", [1, 2])
def test_after_an_out_of_memory_error_unplanned_savers_are_tried_whole_and_the_batch_split_only_if_that_fails(
    tmp_path, monkeypatch, ooms
):
    # no room to plan in (the failed step's other tensors fill the capacity; measuring the plain model could run out
    # of memory too): every block, unplanned, and the step redone whole; a second error in that step (the savers
    # were not enough) splits it
    _plan_fails(monkeypatch)
    trainer, guard, events, model = _run(
        tmp_path, model_changes={5: _oom(ooms)}, model=Blocks, capacity=55_500_000, guard_kwargs=GUARD
    )  # fmt: skip
    # the second adaptation is the split alone: the savers are on from the first
    assert [(a.before, a.after, a.checkpointing) for a in guard.adaptations] == [(1, 1, True), (1, 2, False)][:ooms]
    assert guard.adaptations[0].savers.startswith("checkpointed 4 of 4 blocks")
    assert guard.adaptations[0].savers.endswith("not planned: no room left for activations (-12.7 MB)")  # why
    assert events.micro_batches[5] == ([64, 64] if ooms == 1 else [64, 64, 32, 32])
    assert trainer.global_step == 16 and events.samples_per_step == [64] * 16 and _checkpointed(model)
    assert _close(model, _plain(tmp_path))


def test_savers_that_could_not_be_measured_are_every_block_and_say_why(monkeypatch):
    _plan_fails(monkeypatch)
    adapter, model = RunAdapter(allow_batchnorm=False, grow_every=200, headroom=0.05), Blocks()
    batch = (model.x[:64], model.y[:64])
    savers = adapter._plan_savers(model, batch, 64, room=10**9)
    assert savers.held is None and {"blocks.0", "blocks.3"} <= set(_checkpointed(model))
    assert savers.said.endswith("not planned: measuring the batch raised OutOfMemoryError: CUDA out of memory "
                                "(injected, while the savers are measured)")  # fmt: skip
    remove_levers(model)
    assert adapter._plan_savers(model, None, 64, room=10**9).said.endswith("not planned: no batch in hand")
    remove_levers(model)
    assert adapter._plan_savers(model, batch, 64, room=None).said.endswith("the room for activations is not known")


def test_a_compiled_models_savers_are_planned_with_compiles_default_setting(monkeypatch):
    # the adapter holds no compile setting for the rest of the run: a plan that needed one would not be what runs
    import lightning_memguard.tuning.adapter as adapter_module

    plans, real = [], adapter_module.checkpoint_blocks

    def kept(*args, **kwargs):
        plans.append(real(*args, **kwargs))
        return plans[-1]

    monkeypatch.setattr(adapter_module, "checkpoint_blocks", kept)
    torch._dynamo.reset()
    model = Blocks()
    compiled = torch.compile(model, backend="aot_eager")
    batch = (model.x[:64], model.y[:64])
    savers = RunAdapter(allow_batchnorm=False, grow_every=200, headroom=0.05)._plan_savers(
        compiled, batch, 64, 3 * 10**6
    )
    (plan,) = plans
    assert plan.compiled and plan.activation_memory_budget is None and savers.held
    assert {c["activation_memory_budget"] for c in plan.compile_candidates} == {None} and _checkpointed(model)


def test_the_savers_are_measured_under_the_trainers_precision(tmp_path, monkeypatch):
    import lightning_memguard.tuning.adapter as adapter

    seen = []

    def spy(*args, **kwargs):
        seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)
        return plan_levers(*args, **kwargs)

    monkeypatch.setattr(adapter, "plan_levers", spy)
    _, guard, events, _ = _run(
        tmp_path, others={4: NOT_HELD}, model=Blocks, capacity=CAPACITY, guard_kwargs=GUARD, precision="bf16-mixed"
    )  # fmt: skip
    assert seen == [torch.bfloat16]
    # measured in bf16, the blocks' activations are half those in float32: the room (1.7 MB) that float32's floor
    # (2.4 MB) misses is met, and the batch stays whole
    (adapted,) = guard.adaptations
    assert adapted.after == 1 and "budget not met" not in adapted.savers and events.micro_batches[-1] == [64]


def test_the_room_is_judged_against_memguards_capacity_where_it_is_below_the_cards():
    from lightning_memguard.core.reading import MemoryReading

    adapter = RunAdapter(allow_batchnorm=False, grow_every=4, headroom=0.1)
    reading = MemoryReading(0, 0, capacity=80 * 10**9, allocated_now=2 * 10**9, other_processes=10**9)
    adapter.read(reading)
    assert adapter.room == 72 * 10**9 - 3 * 10**9  # the card's
    adapter.capacity = 16 * 10**9  # MemGuard(capacity="16GB") on an 80 GB card
    adapter.read(reading)
    assert adapter.room == int(16 * 10**9 * 0.9) - 3 * 10**9


def test_the_savers_say_why_the_fused_loss_is_left_out_of_a_hugging_face_model_held_by_the_module():
    transformers = pytest.importorskip("transformers")  # noqa: F841
    from language_model import LanguageModel, Tokens

    module = LanguageModel()  # GPT-2 as `self.model`: the planner would fuse its loss, adapt does not
    batch = {key: torch.stack([Tokens()[i][key] for i in range(8)]) for key in ("input_ids", "labels")}
    savers = RunAdapter(allow_batchnorm=False, grow_every=200, headroom=0.05)._plan_savers(module, batch, 8, 2 * 10**6)
    assert "no fused loss: not taken by on_spill='adapt'" in savers.said and not savers.record["fused_loss"]


class _FailsAfterItsForward(Blocks):
    """Runs out of memory once after its forward made activations, watched by a weak reference."""

    def training_step(self, batch, batch_idx):
        if self.ooms:
            self.ooms = 0
            activations = self(batch[0])
            self.made = weakref.ref(activations)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return super().training_step(batch, batch_idx)


def test_an_out_of_memory_errors_savers_are_measured_with_the_failed_steps_activations_freed(tmp_path, monkeypatch):
    alive = []
    plan = RunAdapter._plan_savers

    def watched(self, pl_module, *args):
        alive.append(pl_module.made() is not None)
        return plan(self, pl_module, *args)

    monkeypatch.setattr(RunAdapter, "_plan_savers", watched)
    _run(
        tmp_path, model_changes={5: _oom()}, model=_FailsAfterItsForward,
        capacity=55_500_000, guard_kwargs=GUARD,
    )  # fmt: skip
    assert alive == [False]


def test_growing_back_removes_the_split_first_then_the_savers(tmp_path):
    trainer, guard, events, model = _run(
        tmp_path, others={3: NOT_HELD, 8: 0}, model=Blocks, capacity=CAPACITY, guard_kwargs={**GUARD, "grow_every": 2}
    )  # fmt: skip
    said = [(a.before, a.after, a.checkpointing, a.savers_off) for a in guard.adaptations]
    assert said == [(1, 2, True, False), (2, 1, False, False), (1, 1, False, True)]
    removed = guard.adaptations[-1]
    assert removed.why.startswith("memory freed") and removed.switch_s == pytest.approx(0.1)
    assert "the savers removed, in 0.10 s (levers: block recomputed" in removed.line()
    assert not _checkpointed(model) and events.micro_batches[-1] == [64] and trainer.global_step == 16
    assert _close(model, _plain(tmp_path))


def _own_checkpointing() -> Blocks:
    """Blocks whose user checkpointed its first block before the fit."""
    model = Blocks()
    apply_plan(model, [["blocks.0"]], units=[Block])
    return model


def test_a_model_with_its_own_checkpointing_keeps_it_the_batch_split_and_it_grows_back_without_touching_it(tmp_path):
    # the user's levers are theirs: the savers are not planned over them (that would take them off, and growing
    # back would remove them); the split keeps the batch per optimizer step and goes when the memory frees
    trainer, guard, events, model = _run(
        tmp_path, others={3: HELD, 8: 0}, model=_own_checkpointing, capacity=CAPACITY,
        guard_kwargs={**GUARD, "grow_every": 2},
    )  # fmt: skip
    said = [(a.before, a.after, a.checkpointing, a.savers_off) for a in guard.adaptations]
    assert said == [(1, 2, False, False), (2, 1, False, False)]
    assert "; the model's own levers are kept (checkpointed: blocks.0); now 32 x 2" in guard.adaptations[0].line()
    assert _checkpointed(model) == ["blocks.0"] and events.samples_per_step == [64] * 16
    assert events.micro_batches[-1] == [64] and trainer.global_step == 16
    assert _close(model, _plain(tmp_path))


def test_a_removal_of_the_savers_that_spills_again_doubles_the_wait(tmp_path):
    _, guard, _, model = _run(
        tmp_path, others={3: NOT_HELD, 8: 0, 13: NOT_HELD}, model=Blocks, capacity=CAPACITY,
        guard_kwargs={**GUARD, "grow_every": 2},
    )  # fmt: skip
    said = [(a.before, a.after, a.checkpointing, a.savers_off) for a in guard.adaptations]
    assert said[:3] == [(1, 2, True, False), (2, 1, False, False), (1, 1, False, True)]
    assert said[3] == (1, 2, True, False) and _checkpointed(model)  # the savers again, and the split
    assert guard._policy.adapter.grow.interval == 4  # the card stayed full: twice as long before the next try


def test_the_checkpointing_metric_goes_back_to_zero_when_the_savers_are_removed(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    logger = CSVLogger(tmp_path / "logs")
    _run(
        tmp_path, others={3: NOT_HELD, 8: 0}, model=Blocks, capacity=CAPACITY, guard_kwargs={**GUARD, "grow_every": 2},
        logger=logger,
    )  # fmt: skip
    logger.save()
    import csv

    with open(logger.experiment.metrics_file_path, encoding="utf-8") as f:
        rows = [r for r in csv.DictReader(f) if r.get("memguard/checkpointing")]
    assert [float(r["memguard/checkpointing"]) for r in rows] == [1.0, 1.0, 0.0]


def test_a_resumed_run_restores_the_savers_without_planning_again(tmp_path, monkeypatch):
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, filename="{epoch}")
    _, first, _, first_model = _run(
        tmp_path, others={4: HELD}, model=Blocks, capacity=CAPACITY, guard_kwargs=GUARD, callbacks=[saver],
        enable_checkpointing=True,
    )  # fmt: skip
    import lightning_memguard.tuning.adapter as adapter

    def no_planning(*args, **kwargs):
        raise AssertionError("planned again")

    monkeypatch.setattr(adapter, "plan_levers", no_planning)
    ckpt = tmp_path / "ckpt" / "epoch=0.ckpt"
    trainer, guard, events, model = _run(
        tmp_path / "resumed", ckpt_path=ckpt, others={8: HELD}, model=Blocks, capacity=CAPACITY, guard_kwargs=GUARD,
        expect_adapting=False,
    )  # fmt: skip
    assert guard.adaptations == first.adaptations and _checkpointed(model) == _checkpointed(first_model)
    assert events.micro_batches == [[64]] * 8 and trainer.global_step == 16
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), _plain(tmp_path, ckpt_path=ckpt), strict=True))


def test_a_checkpoints_savers_are_not_applied_over_the_users_own_levers_and_a_spill_splits_the_batch(tmp_path):
    # the resumed adapter holds no claim on the model's levers: a later growth could not take the user's off
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, filename="{epoch}")
    _, first, _, _ = _run(
        tmp_path, others={4: HELD}, model=Blocks, capacity=CAPACITY, guard_kwargs=GUARD, callbacks=[saver],
        enable_checkpointing=True,
    )  # fmt: skip
    assert first.adaptations[0].checkpointing  # the checkpoint holds savers
    with pytest.warns(RuntimeWarning, match=r"the checkpoint's savers are not applied: the model carries levers of"
                                            r" its own \(checkpointed: blocks\.0\)"):  # fmt: skip
        _, guard, events, model = _run(
            tmp_path / "resumed", ckpt_path=tmp_path / "ckpt" / "epoch=0.ckpt", others={9: HELD},
            model=_own_checkpointing, capacity=CAPACITY, guard_kwargs=GUARD,
        )  # fmt: skip
    later = guard.adaptations[len(first.adaptations) :]
    assert [(a.after, a.checkpointing) for a in later] == [(2, False)] and not guard._policy.adapter.checkpointing
    assert "the model's own levers are kept" in later[0].line() and _checkpointed(model) == ["blocks.0"]
    assert events.samples_per_step == [64] * 8


def test_a_later_fit_of_the_same_model_starts_without_an_earlier_fits_savers(tmp_path):
    _, _, _, model = _run(tmp_path, others={4: HELD}, model=Blocks, capacity=CAPACITY, guard_kwargs=GUARD)
    assert _checkpointed(model)  # the savers the first fit took stay on the model it returns
    _, guard, _, again = _run(tmp_path / "again", model=lambda: model, capacity=CAPACITY, guard_kwargs=GUARD)
    assert again is model and not guard.adaptations and not _checkpointed(model)  # as it was built, nothing kept


def test_a_checkpoint_from_before_the_savers_were_kept_still_loads_with_every_block():
    old = {  # MemGuard's "adapt" state as the code before the levers' planner wrote it
        "adaptations": [
            {"step": 5, "batch": 32, "before": 1, "after": 1, "checkpointing": True, "why": "spilled",
             "accumulate": 1, "validation": False, "weighting": ""}
        ],
        "chunks": 1, "validation_chunks": 1, "checkpointing": True, "weighting": None, "grow_interval": 200,
    }  # fmt: skip
    adapter = RunAdapter(allow_batchnorm=False, grow_every=200, headroom=0.05)
    adapter.load_state_dict(old)
    assert adapter.checkpointing and adapter.savers is None and not adapter.can_grow  # no figure: the savers stay
    assert adapter.adaptations[0].savers == "" and adapter.adaptations[0].switch_s is None
    assert "activation checkpointing on" in adapter.adaptations[0].line()
    later = {**old, "adaptations": [{**old["adaptations"][0], "from_a_later_version": 1}],
             "savers": {"record": {}, "said": "every block", "from_a_later_version": 2}}  # fmt: skip
    adapter.load_state_dict(later)  # what a later version adds is left, what it kept is read
    assert adapter.adaptations[0].step == 5 and adapter.savers is not None and adapter.savers.said == "every block"
    adapter.load_state_dict(old)

    from types import SimpleNamespace

    model = Blocks()
    model.automatic_optimization = False  # no training step to own: the savers alone are started
    adapter.start(SimpleNamespace(global_step=5, world_size=1), model)
    assert {"blocks.0", "blocks.1", "blocks.2", "blocks.3"} <= set(_checkpointed(model))  # every block, as before


def test_a_plan_record_applies_again_exactly_and_comes_off():
    torch.manual_seed(0)
    model = Blocks()
    example = model.x[:32]
    plan = plan_levers(model, example, 0.5, fused_loss=False, offload=False)
    record = plan.record()
    planned = _checkpointed(model)
    assert record["checkpointed"] and record["checkpointed"] == plan.checkpointed
    assert remove_levers(model) and not _checkpointed(model)
    apply_record(model, record)
    assert _checkpointed(model) == planned
    assert isinstance(plan, LeverPlan) and remove_levers(model) and not remove_levers(model)


def test_a_record_that_fails_part_way_leaves_the_model_as_it_was():
    model = Blocks()
    with pytest.raises(ValueError, match="nowhere"):
        record = {"version": 1, "fused_loss": False, "loss_module": "", "checkpointed": ["blocks.0"]}
        apply_record(model, {**record, "pointwise": ["nowhere"]})
    assert not _checkpointed(model)


def test_two_ddp_ranks_take_the_same_savers_when_one_spills(ddp_launch):
    """Rank 1 alone meets less memory at step 2 (tests/ddp_adapt_run.py, scenario ``savers``): rank zero plans, both
    ranks apply its record, at the same step; neither splits; the weights are those of the DDP run without the
    spill, bit for bit."""
    results = ddp_scenario_results(ddp_launch, "ddp_adapt_run:savers", "savers{rank}.json")
    lines = [
        [(a["step"], a["before"], a["after"], a["checkpointing"]) for a in results[rank]["adaptations"]]
        for rank in (0, 1)
    ]
    assert lines[0] == lines[1] and len(lines[0]) == 1 and lines[0][0][1:] == (1, 1, True)
    assert results[0]["adaptations"][0]["savers"] == results[1]["adaptations"][0]["savers"]
    assert results[0]["checkpointed"] == results[1]["checkpointed"] != []
    assert "spilled on another rank" in results[0]["adaptations"][0]["why"]
    assert all(results[r]["same_as_plain"] for r in (0, 1))


def test_rank_zero_failing_while_it_plans_the_savers_raises_on_every_rank(ddp_launch):
    """Rank zero's planning raises a RuntimeError (tests/ddp_adapt_run.py, scenario ``planning_raises``): rank zero's
    fit raises it, and rank 1's, instead of waiting in the broadcast for a plan (where it waited until rank zero's
    process ended and gloo closed the connection), raises SaversNotPlanned naming it."""
    results = ddp_scenario_results(ddp_launch, "ddp_adapt_run:planning_raises", "planning{rank}.json")
    assert results[0]["raised"] == {"type": "RuntimeError", "message": "injected while rank zero plans the savers"}
    assert results[1]["raised"] == {
        "type": "SaversNotPlanned",
        "message": "rank zero failed planning the savers: RuntimeError: injected while rank zero plans the savers",
    }
