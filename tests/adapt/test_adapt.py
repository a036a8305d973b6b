"""MemGuard(on_spill="adapt"): the run goes on in a configuration that fits, training as it would have, instead of
stopping. CPU twins under the emulator; the H200 run is benchmarks/adapt.py."""

from __future__ import annotations

import pytest
import torch
from conftest import StepClock, ddp_scenario_results, trainer_kwargs
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_memguard import MemGuard
from lightning_memguard._lightning.batches import split_batch
from lightning_memguard.testing import SysmemSpillEmulator
from lightning_memguard.tuning.adapt import Adaptation

WIDTH = 4096  # 16 kB of saved activations per sample and layer: a batch of 32 saves about 1 MB


class Wide(LightningModule):
    """An MLP without BatchNorm or dropout whose saved activations grow with the batch: what fits is known."""

    def __init__(self, batch_size: int = 32, n: int = 32 * 12, batchnorm: bool = False) -> None:
        super().__init__()
        self.batch_size = batch_size
        layers: list[torch.nn.Module] = [torch.nn.Linear(16, WIDTH)]
        if batchnorm:
            layers.append(torch.nn.BatchNorm1d(WIDTH))
        layers += [torch.nn.ReLU(), torch.nn.Linear(WIDTH, 2)]
        self.net = torch.nn.Sequential(*layers)
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 16, generator=gen)
        self.y = torch.randint(0, 2, (n,), generator=gen)
        self.oom_above: int | None = None  # raise CUDA's out-of-memory error for a micro-batch larger than this
        self.oom_in_backward = False

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.oom_above is not None and len(x) > self.oom_above and not self.oom_in_backward:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected, in forward)")
        out = self(x)
        if self.oom_above is not None and len(x) > self.oom_above and self.oom_in_backward:

            def fail(grad):
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected, in backward)")

            out.register_hook(fail)
        return torch.nn.functional.cross_entropy(out, y)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.x, self.y), batch_size=self.batch_size, shuffle=True)


class Events(Callback):
    """What the run did: the samples of the batch each optimizer step took, the micro-batches training_step saw (a
    try that ran out of memory included), and, at given optimizer steps, memory another application takes or gives
    back on the emulated card, or a change to the model."""

    def __init__(self, emulator: SysmemSpillEmulator, others: dict[int, int] | None = None, model_changes=None):
        self.emulator, self.others, self.model_changes = emulator, others or {}, model_changes or {}
        self.samples_per_step: list[int] = []
        self.micro_batches: list[list[int]] = []
        self._batch = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        step = trainer.global_step
        if step in self.others:
            self.emulator.other_processes = self.others.pop(step)
        if step in self.model_changes:
            self.model_changes.pop(step)(pl_module)
        self._batch = _samples(batch)
        seen: list[int] = []
        self.micro_batches.append(seen)
        original = pl_module.training_step

        def counting(part, *args, **kwargs):
            if pl_module.training:  # not the check of the loss's weighting before the first split (in eval mode)
                seen.append(_samples(part))
            return original(part, *args, **kwargs)

        pl_module.training_step = counting

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        del pl_module.training_step

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.samples_per_step.append(self._batch)


def _samples(batch) -> int:
    return len(batch[0]) if isinstance(batch, list | tuple) else len(batch)


def _run(tmp_path, others=None, model_changes=None, guard_kwargs=None, model=None, max_epochs=2, callbacks=(),
         ckpt_path=None, expect_adapting=None, capacity=None, **trainer_kw):  # fmt: skip
    torch.manual_seed(0)
    model = Wide() if model is None else model()  # made after the seed, as the plain run's
    emulator = SysmemSpillEmulator(capacity=capacity or _capacity(), sleep=lambda s: None)
    events = Events(emulator, others, model_changes)
    guard = MemGuard(
        on_spill="adapt", probe=emulator.probe, clock=StepClock(), read_every=1, warmup_steps=1, reference_steps=1,
        spill_checkpoint=False, **(guard_kwargs or {}),
    )  # fmt: skip
    kwargs = trainer_kwargs(tmp_path, max_epochs=max_epochs, callbacks=[emulator, guard, events, *callbacks])
    trainer = Trainer(**{**kwargs, **trainer_kw})
    adapting = bool(others or model_changes) if expect_adapting is None else expect_adapting
    with pytest.warns(RuntimeWarning, match="MemGuard adapted") if adapting else _nothing():
        trainer.fit(model, ckpt_path=ckpt_path)
    return trainer, guard, events, model


def _capacity() -> int:
    # a step starts from 0.93 MB (weights, gradients, momentum) and saves 16 kB per sample: the batch of 32 needs
    # 1.46 MB of the 2 MB card
    return 2 * 10**6


def _plain(tmp_path, max_epochs=2, model=None, ckpt_path=None) -> list[torch.Tensor]:
    """The same run without MemGuard, nothing spilling: the weights adapting must reproduce."""
    torch.manual_seed(0)
    model = Wide() if model is None else model
    Trainer(**trainer_kwargs(tmp_path / "plain", max_epochs=max_epochs)).fit(model, ckpt_path=ckpt_path)
    return [p.detach().clone() for p in model.parameters()]


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _close(model, weights) -> bool:
    return all(torch.allclose(p, w, atol=1e-6, rtol=1e-5) for p, w in zip(model.parameters(), weights, strict=True))


TAKEN = 7 * 10**5  # another application takes 0.7 MB of the 2 MB card: 16 samples fit, not 32


def test_a_spill_adapts_and_the_run_trains_as_one_that_never_spilled(tmp_path):
    trainer, guard, events, model = _run(tmp_path, others={4: TAKEN})
    assert trainer.global_step == 24  # every step asked for: 2 epochs of 12 batches
    assert events.samples_per_step == [32] * 24  # the same samples in every optimizer step
    assert [len(m) for m in events.micro_batches[:4]] == [1, 1, 1, 1]
    first = guard.adaptations[0]
    assert (first.before, first.batch) == (1, 32) and first.after >= 2 and not first.checkpointing
    assert first.savers == "" and first.switch_s is None  # a model without blocks: split at once, as before
    assert "spilled" in first.why and first.step <= 6  # acted on within the steps it reads memory at
    assert all(len(m) == first.after for m in events.micro_batches[first.step + 1 :])
    assert _close(model, _plain(tmp_path))  # the weights of a run that never spilled


def test_without_a_spill_adapting_changes_nothing(tmp_path):
    trainer, guard, events, model = _run(tmp_path)
    assert guard.adaptations == [] and events.samples_per_step == [32] * 24
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), _plain(tmp_path), strict=True))  # bit for bit


def test_it_grows_back_when_memory_frees_and_adapts_again_on_a_second_spill(tmp_path):
    trainer, guard, events, model = _run(
        tmp_path, others={3: TAKEN, 8: 0, 16: TAKEN}, guard_kwargs={"grow_every": 2}, max_epochs=2
    )
    kinds = [("freed" in a.why, a.before, a.after) for a in guard.adaptations]
    assert kinds[0][0] is False and kinds[0][1] == 1  # the spill
    assert any(freed and after == 1 for freed, _, after in kinds)  # back to the whole batch once memory freed
    assert kinds[-1][0] is False and kinds[-1][2] >= 2  # the second spill, adapted again
    assert events.samples_per_step == [32] * 24
    assert _close(model, _plain(tmp_path))


def test_an_out_of_memory_error_in_forward_or_backward_redoes_the_step_split(tmp_path):
    for in_backward in (False, True):

        def fail_above_16(model, in_backward=in_backward):
            model.oom_above, model.oom_in_backward = 16, in_backward

        trainer, guard, events, model = _run(tmp_path / str(in_backward), model_changes={5: fail_above_16})
        assert trainer.global_step == 24 and events.samples_per_step == [32] * 24
        assert [a.why.endswith("ran out of memory") for a in guard.adaptations] == [True]
        assert events.micro_batches[5] == [32, 16, 16]  # the failed try, then the step redone in two
        assert _close(model, _plain(tmp_path))


def test_a_resumed_run_continues_in_the_adapted_configuration(tmp_path):
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, filename="{epoch}")
    _, first, _, _ = _run(tmp_path, others={4: TAKEN}, callbacks=[saver], enable_checkpointing=True)
    # resumed after its first epoch by a new Trainer and a new MemGuard, with the other application still there
    trainer, guard, events, model = _run(
        tmp_path / "resumed", ckpt_path=tmp_path / "ckpt" / "epoch=0.ckpt", others={12: TAKEN}, expect_adapting=False
    )
    assert guard.adaptations == first.adaptations[:1] and trainer.global_step == 24
    assert events.micro_batches == [[16, 16]] * 12  # where the first run had got to, from its first batch
    assert _close(model, _plain(tmp_path, ckpt_path=tmp_path / "ckpt" / "epoch=0.ckpt"))  # as the plain run resumed


def test_where_it_cannot_keep_the_training_the_same_it_stops_saying_why(tmp_path):
    # a model whose BatchNorm layers train and that has no blocks to checkpoint
    with pytest.warns(
        RuntimeWarning, match="could not adapt: the model's BatchNorm layers would take their statistics"
    ):
        trainer, guard, _, _ = _run(
            tmp_path, others={4: TAKEN}, model=lambda: Wide(batchnorm=True), expect_adapting=False
        )
    assert trainer.global_step < 24 and guard.adaptations == []


class Manual(Wide):
    """Optimizes by hand: its step is its own, so MemGuard cannot split it."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(self(batch[0]), batch[1])
        self.manual_backward(loss)
        optimizer.step()
        return loss


def test_manual_optimization_is_not_adapted_but_stopped_saying_why(tmp_path):
    with pytest.warns(RuntimeWarning, match="could not adapt: the model optimizes manually"):
        trainer, guard, _, _ = _run(tmp_path, others={4: TAKEN}, model=Manual, expect_adapting=False)
    assert trainer.global_step < 24 and guard.adaptations == []


def test_adapt_is_refused_under_deepspeed_in_setup():
    from types import SimpleNamespace

    from lightning.pytorch.strategies import DeepSpeedStrategy

    from lightning_memguard.tuning.adapter import refuse_to_adapt

    strategy = DeepSpeedStrategy.__new__(DeepSpeedStrategy)  # Lightning builds the real one only on CUDA
    with pytest.raises(ValueError, match="does not support DeepSpeedStrategy: DeepSpeed's engine runs the backward"):
        refuse_to_adapt(SimpleNamespace(strategy=strategy))


def test_a_spill_in_the_last_steps_of_an_epoch_adapts_the_next_epoch(tmp_path):
    trainer, guard, events, model = _run(tmp_path, others={11: TAKEN})  # the epoch's last batch spills
    assert [(a.step, a.after) for a in guard.adaptations] == [(12, 2)]  # found at the epoch's end, not a stop
    assert events.micro_batches == [[32]] * 12 + [[16, 16]] * 12 and trainer.global_step == 24
    assert _close(model, _plain(tmp_path))


def test_a_model_with_batchnorm_adapts_by_checkpointing_its_blocks_with_the_same_gradients(tmp_path):
    from lightning_memguard.checkpointing import is_checkpointed
    from lightning_memguard.testing import ImageClassifier

    def model():
        return ImageClassifier("resnet18", image_size=32, batch_size=16, steps_per_epoch=6, pool_size=8)

    torch.manual_seed(0)
    plain = model()
    Trainer(**trainer_kwargs(tmp_path / "plain", max_epochs=1)).fit(plain)
    torch.manual_seed(0)
    adapted = model()
    # the step starts from 134 MB (weights, gradients, momentum) and saves 6.6 MB of activations, 1.3 MB with every
    # block checkpointed: with 12 MB taken on the 150 MB card the first spills, the second fits
    emulator = SysmemSpillEmulator(capacity=150 * 10**6, sleep=lambda s: None)
    events = Events(emulator, {3: 12 * 10**6})
    guard = MemGuard(
        on_spill="adapt", probe=emulator.probe, read_every=1, warmup_steps=1, reference_steps=1, spill_checkpoint=False
    )
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[emulator, guard, events]))
    with pytest.warns(RuntimeWarning, match="activation checkpointing on"):
        trainer.fit(adapted)
    assert [(a.before, a.after, a.checkpointing) for a in guard.adaptations] == [(1, 1, True)]
    assert trainer.global_step == 6 and events.micro_batches == [[16]] * 6  # never split: BatchNorm sees the batch
    assert any(is_checkpointed(m) for m in adapted.modules()) and not emulator.spilled_bytes
    assert all(
        torch.allclose(a, b, atol=1e-6)
        for a, b in zip(adapted.state_dict().values(), plain.state_dict().values(), strict=True)
    )


class ResNetOnImages(LightningModule):
    """A torchvision ResNet (one block a stage) whose batches are (images, labels): its forward takes the first."""

    def __init__(self) -> None:
        super().__init__()
        from models import small_resnet

        self.net = small_resnet()
        gen = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(96, 3, 32, 32, generator=gen), torch.randint(0, 10, (96,), generator=gen)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.x, self.y), batch_size=16, shuffle=True)


def test_checkpointing_is_planned_for_the_memory_free_now_on_the_batch_in_hand(tmp_path):
    # a step starts from 58.9 MB and saves 4.6 MB (5.1 MB at its peak, as the planner counts), 0.75 MB with every
    # block checkpointed; on a 70 MB card with 7 MB taken, 62.3 MB is usable (1 % headroom): about 3.4 MB for
    # activations, which a plan of fewer than all the blocks meets
    torch.manual_seed(0)
    model = ResNetOnImages()
    emulator = SysmemSpillEmulator(capacity=70 * 10**6, sleep=lambda s: None)
    events = Events(emulator, {2: 7 * 10**6})
    guard = MemGuard(
        on_spill="adapt", probe=emulator.probe, read_every=1, warmup_steps=1, reference_steps=1, headroom=0.01,
        spill_checkpoint=False,
    )  # fmt: skip
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[emulator, guard, events]))
    # before the levers' planner: "activation checkpointing: checkpointed 1 of 5 blocks in 1 run(s); budget ..."
    with pytest.warns(RuntimeWarning, match=r"the savers, in [0-9.]+ s: levers: .*recomputed in .*; budget"):
        trainer.fit(model)
    assert [(a.before, a.after, a.checkpointing) for a in guard.adaptations] == [(1, 1, True)]
    assert "budget not met" not in guard.adaptations[0].savers  # the plan held: the batch is not split
    assert trainer.global_step == 6 and emulator.spilled_bytes == 0  # the last step fits
    torch.manual_seed(0)
    plain = ResNetOnImages()
    Trainer(**trainer_kwargs(tmp_path / "plain", max_epochs=1)).fit(plain)
    pairs = zip(model.state_dict().values(), plain.state_dict().values(), strict=True)
    assert all(torch.allclose(a.float(), b.float(), atol=1e-6) for a, b in pairs)  # BatchNorm's buffers included


def test_a_compiled_model_adapts_and_compiles_the_new_micro_batch_once(tmp_path):
    made = []

    def compiled():
        made.append(torch.compile(Wide(), backend="aot_eager"))
        return made[0]

    trainer, guard, events, _ = _run(tmp_path, others={4: TAKEN}, model=compiled, max_epochs=1)
    assert [(a.step, a.after) for a in guard.adaptations] == [(5, 2)] and trainer.global_step == 12
    assert events.micro_batches == [[32]] * 5 + [[16, 16]] * 7
    assert _close(made[0], _plain(tmp_path, max_epochs=1))


class SamplesProbe:
    """A card whose step peak is 1 MB plus 20 kB for each sample of the largest forward since the last reset."""

    def __init__(self) -> None:
        self.most = 0

    def capacity(self) -> int:
        return 2 * 10**6

    def reset_peak(self) -> None:
        self.most = 0

    def read(self):
        from lightning_memguard.probes import MemoryReading

        peak = 10**6 + 20_000 * self.most
        return MemoryReading(peak, peak, self.capacity(), 0, 10**6)


class Validated(Wide):
    """Batches of 32 to train (1.64 MB: they fit), of 64 to validate (2.28 MB on the 2 MB card: they spill)."""

    def __init__(self, probe: SamplesProbe) -> None:
        super().__init__()
        self.probe = probe
        self.validation_micro_batches: list[int] = []

    def forward(self, x):
        self.probe.most = max(self.probe.most, len(x))
        return super().forward(x)

    def validation_step(self, batch, batch_idx):
        self.validation_micro_batches.append(len(batch[0]))
        self.log("val_loss", torch.nn.functional.cross_entropy(self(batch[0]), batch[1]))

    def val_dataloader(self):
        return DataLoader(TensorDataset(self.x[:128], self.y[:128]), batch_size=64)


def test_a_spill_in_validation_splits_the_validation_batches_and_leaves_training_as_it_was(tmp_path):
    def fit(on_spill):
        torch.manual_seed(0)
        probe = SamplesProbe()
        model = Validated(probe)
        guard = MemGuard(on_spill=on_spill, probe=probe, read_every=1, warmup_steps=1, spill_checkpoint=False)
        kwargs = trainer_kwargs(tmp_path / on_spill, max_epochs=2, callbacks=[guard], limit_val_batches=1.0)
        trainer = Trainer(**kwargs)
        with (
            pytest.warns(RuntimeWarning, match="validation batches now run as 32 x 2")
            if on_spill == "adapt"
            else _nothing()
        ):
            trainer.fit(model)
        return trainer, guard, model

    trainer, guard, model = fit("adapt")
    assert [(a.validation, a.before, a.after) for a in guard.adaptations] == [(True, 1, 2)]
    assert model.validation_micro_batches == [64, 64] + [32, 32, 32, 32]  # epoch 0's validation, then split
    assert trainer.global_step == 24  # training was not stopped, nor split
    plain_trainer, _, plain = fit("warn")
    assert _close(model, [p.detach() for p in plain.parameters()])
    assert trainer.callback_metrics["val_loss"] == pytest.approx(plain_trainer.callback_metrics["val_loss"].item())


def test_split_batch_keeps_what_is_not_per_sample():
    x, mask = torch.arange(12).reshape(6, 2), torch.ones(3, 3)
    parts = split_batch({"x": x, "mask": mask, "name": "a"}, 6, 4)
    assert [n for _, n in parts] == [len(p["x"]) for p, _ in parts] == [2, 1, 1, 2]
    assert torch.equal(torch.cat([p["x"] for p, _ in parts]), x)
    assert all(p["mask"] is mask and p["name"] == "a" for p, _ in parts)


def test_an_adaptation_is_said_in_one_line_with_its_numbers():
    line = Adaptation(31, 256, 1, 2, False, "256 x 1 spilled (20.80 GB on a 16.00 GB card)").line()
    assert line == (
        "step 31: 256 x 1 spilled (20.80 GB on a 16.00 GB card); now 128 x 2, the same 256 samples per optimizer step"
    )


def test_two_ddp_ranks_adapt_in_the_same_step_to_the_same_split_when_one_spills(ddp_launch):
    """Rank 1 alone meets less memory at step 4 (tests/ddp_adapt_run.py); both ranks train on as one."""
    results = ddp_scenario_results(ddp_launch, "ddp_adapt_run:adapt", "adapt{rank}.json")
    for rank in (0, 1):
        r = results[rank]
        assert [(a["step"], a["before"], a["after"]) for a in r["adaptations"]] == [(5, 1, 2)]
        assert r["steps"] == 8 and r["micro_batches"] == [[32]] * 5 + [[16, 16]] * 3
        assert r["same_as_plain"]  # the weights of the same DDP run without the spill
    assert "spilled (2.2 MB on a 2.0 MB card" in results[1]["adaptations"][0]["why"]
    assert "spilled on another rank" in results[0]["adaptations"][0]["why"]
    assert results[0]["weights_sum"] == results[1]["weights_sum"]


class Logged(Wide):
    """Logs its loss for the epoch, and skips the batches that hold a sample marked bad (``bad``: their first inputs'
    value 99), as a guard in a user's training step would."""

    def __init__(self, bad_at: int | None = None) -> None:
        super().__init__(n=32 * 12 + 5)  # a last batch of 5
        if bad_at is not None:
            self.x[bad_at, 0] = 99.0

    def training_step(self, batch, batch_idx):
        if (batch[0][:, 0] == 99.0).any():
            return None
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.x, self.y), batch_size=self.batch_size)  # in order: the bad batch known


def test_logged_epoch_figures_are_the_whole_batches_when_split(tmp_path):
    trainer, guard, events, model = _run(tmp_path, others={4: TAKEN}, model=Logged)
    assert guard.adaptations and events.micro_batches[-1] == [2, 3]  # the last batch of 5, split
    torch.manual_seed(0)
    plain = Logged()
    plain_trainer = Trainer(**trainer_kwargs(tmp_path / "plain", max_epochs=2))
    plain_trainer.fit(plain)
    # before: each micro-batch's value weighed as the whole batch, 1.36 against 1.31
    assert trainer.callback_metrics["train_loss"].item() == pytest.approx(
        plain_trainer.callback_metrics["train_loss"].item(), rel=1e-5
    )
    assert _close(model, [p.detach() for p in plain.parameters()])


def test_a_step_skipped_by_some_micro_batches_only_is_refused_not_changed(tmp_path):
    # the bad sample in the second half of batch 7: the first half would train alone, at half its weight
    with pytest.raises(RuntimeError, match="returned None for 1 of them .* but not for the others"):
        _run(tmp_path, others={4: TAKEN}, model=lambda: Logged(bad_at=7 * 32 + 20), expect_adapting=True)
    # the whole batch skipped by every micro-batch: skipped, as the whole batch's step is
    trainer, *_ = _run(tmp_path / "all", others={4: TAKEN}, model=lambda: _bad_everywhere(7))
    assert trainer.global_step == 26  # 13 batches an epoch; Lightning steps the optimizer for a skipped one too


def _bad_everywhere(batch: int) -> Logged:
    model = Logged()
    model.x[batch * 32 : (batch + 1) * 32, 0] = 99.0
    return model


class TimeFirst(Wide):
    """Batches of (inputs of time x batch x features, targets of batch), as a time-first RNN takes them."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(1)
        self.sequences = torch.randn(32 * 12, 20, 16, generator=gen)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x.mean(0)), y)

    def train_dataloader(self):
        def collate(items):
            return torch.stack([s for s, _ in items], dim=1), torch.stack([t for _, t in items])

        return DataLoader(TensorDataset(self.sequences, self.y), batch_size=32, collate_fn=collate)


def test_a_batch_whose_tensors_disagree_on_its_samples_is_not_split_but_stopped(tmp_path):
    with pytest.warns(RuntimeWarning, match=r"could not adapt: the batch's tensors do not agree on its samples"):
        trainer, guard, _, _ = _run(tmp_path, others={4: TAKEN}, model=TimeFirst, expect_adapting=False)
    assert guard.adaptations == [] and trainer.global_step < 24  # before: the sequences were cut in time


class FailFromBatch(Callback):
    def __init__(self, batch_idx: int) -> None:
        self.batch_idx = batch_idx

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.batch_idx:
            pl_module.oom_above = 16


def test_an_out_of_memory_error_that_cannot_be_redone_says_why(tmp_path):
    with pytest.raises(torch.OutOfMemoryError, match="could not adapt to it: this batch is not the first of its"):
        # at accumulation 2 the error comes at batch 5, the second of its accumulation
        _run(tmp_path, callbacks=[FailFromBatch(5)], accumulate_grad_batches=2, expect_adapting=False)


def _warnings_of(record) -> str:
    return "\n".join(str(w.message) for w in record if "MemGuard" in str(w.message))


def test_where_other_processes_leave_no_room_for_one_sample_it_stops_at_once_naming_them(tmp_path):
    # another application takes 1.3 MB of the 2 MB card: what a step starts from (0.93 MB) does not fit beside it, so no
    # micro-batch can; before, the run split 1 -> 2 -> ... -> 32 over 5 spilled steps, then stopped
    with pytest.warns(RuntimeWarning, match="MemGuard stopped the Trainer") as record:
        trainer, guard, events, _ = _run(tmp_path, others={4: 1_300_000}, expect_adapting=False)
    said = _warnings_of(record)
    assert guard.adaptations == [] and "MemGuard adapted" not in said
    assert all(len(m) == 1 for m in events.micro_batches) and trainer.global_step <= 7  # no split, no further try
    assert "could not adapt: other processes hold 1.3 MB of the card's 2.0 MB, and what a step starts from" in said
    assert "close the other application" in said and "a lighter optimizer state" in said


def test_where_weights_gradients_and_optimizer_state_alone_exceed_the_card_it_stops_at_once(tmp_path):
    # a 0.9 MB card: what a step starts from (0.93 MB) alone exceeds it; checkpointing cannot help either (before, the
    # run split 1 -> 2 -> ... -> 32, then stopped advising activation checkpointing)
    with pytest.warns(RuntimeWarning, match="MemGuard stopped the Trainer") as record:
        trainer, guard, events, _ = _run(tmp_path, capacity=900_000, expect_adapting=False)
    said = _warnings_of(record)
    assert guard.adaptations == [] and all(len(m) == 1 for m in events.micro_batches)
    assert (
        "could not adapt: what a step starts from (the weights, gradients and optimizer state: 933.9 kB) alone"
        " exceeds the card's 900.0 kB" in said
    )
    assert "make what a step starts from smaller: a lighter optimizer state" in said and "sharded" in said
    assert "ActivationCheckpointing" not in said  # no advice that cannot help


def test_where_not_even_one_sample_fits_beside_what_is_held_it_does_not_split(tmp_path):
    # 0.96 MB taken: 6 kB is left beside what a step starts from, and each sample adds 16 kB; a split cannot help
    # (before: 1 -> 2 -> ... -> 32 over 5 spilled steps), checkpointing could, but this MLP has no blocks
    with pytest.warns(RuntimeWarning, match="MemGuard stopped the Trainer") as record:
        trainer, guard, events, _ = _run(tmp_path, others={4: 960_000}, expect_adapting=False)
    said = _warnings_of(record)
    assert guard.adaptations == [] and all(len(m) == 1 for m in events.micro_batches)
    assert "could not adapt: not even one sample fits (6.1 kB is left beside what a step starts from" in said
    assert "and activation checkpointing found no blocks" in said


@pytest.mark.parametrize("last", [1, 5])
def test_a_short_last_batch_is_not_the_runs_batch(tmp_path, last):
    # 12 batches of 32 and a last of 1 (or 5); the spill is read at the epoch's end, or at the last batch's start.
    # Before: with a last of 1, "not even a batch of one fits" and a stop at step 13 of 26; with a last of 5,
    # "5 x 1 spilled; now 2 x 3, the same 5 samples"
    def model():
        return Wide(n=32 * 12 + last)

    trainer, guard, events, adapted = _run(tmp_path, others={11: TAKEN}, model=model)
    assert [a.line().split(" (")[0] for a in guard.adaptations] == ["step 13: 32 x 1 spilled"]
    assert guard.adaptations[0].line().count("; now 16 x 2, the same 32 samples per optimizer step;") == 1
    assert trainer.global_step == 26 and events.micro_batches[13:25] == [[16, 16]] * 12
    torch.manual_seed(0)
    plain = model()
    Trainer(**trainer_kwargs(tmp_path / "plain", max_epochs=2)).fit(plain)
    assert _close(adapted, [p.detach() for p in plain.parameters()])


def test_a_stop_at_an_epochs_end_after_a_short_last_batch_advises_from_the_full_batches(tmp_path):
    emulator = SysmemSpillEmulator(capacity=_capacity(), sleep=lambda s: None)
    guard = MemGuard(
        on_spill="stop", probe=emulator.probe, clock=StepClock(), read_every=1, warmup_steps=1, reference_steps=1,
        spill_checkpoint=False,
    )  # fmt: skip
    events = Events(emulator, {11: TAKEN})
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=2, callbacks=[emulator, guard, events]))
    with pytest.warns(RuntimeWarning, match=r"at training step 13 \(batch size 32\)") as record:
        trainer.fit(Wide(n=32 * 12 + 1))
    said = _warnings_of(record)
    # before: "(batch size 1)", "each sample adds 524.5 kB: not even a batch of one fits"
    assert "each sample adds 16.4 kB): a batch of at most 16 fits" in said and trainer.global_step == 13


def test_a_resumed_split_run_on_a_card_free_again_grows_back_after_its_first_step(tmp_path):
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, filename="{epoch}")
    _run(tmp_path, others={4: TAKEN}, callbacks=[saver], enable_checkpointing=True)
    # resumed after its first epoch, the other application gone: before, it stayed split for `grow_every` steps
    trainer, guard, events, model = _run(tmp_path / "resumed", ckpt_path=tmp_path / "ckpt" / "epoch=0.ckpt")
    assert events.micro_batches == [[16, 16]] + [[32]] * 11 and trainer.global_step == 24
    grown = guard.adaptations[-1]
    assert (grown.step, grown.before, grown.after) == (13, 2, 1) and grown.why.startswith("memory freed")
    assert _close(model, _plain(tmp_path, ckpt_path=tmp_path / "ckpt" / "epoch=0.ckpt"))


def test_the_doubled_wait_after_a_growth_that_spilled_again_is_kept_in_the_checkpoint():
    from lightning_memguard.tuning.adapter import RunAdapter

    adapter = RunAdapter(allow_batchnorm=False, grow_every=100, headroom=0.05)
    adapter.chunks = 2
    adapter.grow.tried(300, undone=True)  # the card stayed full: the next attempt 200 steps later
    resumed = RunAdapter(allow_batchnorm=False, grow_every=100, headroom=0.05)
    resumed.load_state_dict(adapter.state_dict())
    assert resumed.grow.interval == 200  # before: back to 100, the full card tried twice as often
    resumed.grow.resumed(1000)  # a resumed run checks after its first step, then every 200
    assert resumed.grow.due(1001) and (resumed.grow.tried(1001, undone=True), resumed.grow.interval)[1] == 400


def test_a_changed_accumulation_leaves_the_split_training_the_same_and_each_line_true_at_its_step(tmp_path):
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    def schedule():
        return GradientAccumulationScheduler({0: 1, 1: 2})  # 2 batches per optimizer step from the second epoch

    trainer, guard, events, model = _run(tmp_path, others={4: TAKEN}, callbacks=[schedule()])
    (adapted,) = guard.adaptations  # said at its step, with the accumulation then: a record, not the state now
    assert (
        adapted.accumulate == 1 and adapted.line().count("; now 16 x 2, the same 32 samples per optimizer step;") == 1
    )
    assert events.micro_batches[-1] == [16, 16] and trainer.global_step == 12 + 6
    torch.manual_seed(0)
    plain = Wide()
    Trainer(**trainer_kwargs(tmp_path / "plain", max_epochs=2, callbacks=[schedule()])).fit(plain)
    assert _close(model, [p.detach() for p in plain.parameters()])  # weighted by the accumulation of each step


def test_a_resumed_run_keeps_its_doubled_grow_interval_unless_grow_every_was_changed():
    from lightning_memguard.tuning.adapter import RunAdapter

    first = RunAdapter(allow_batchnorm=False, grow_every=10, headroom=0.05)
    first.grow.tried(10, undone=True)  # a growth that spilled again: the next waits twice as long
    first.grow.tried(30, undone=True)
    state = first.state_dict()
    assert state["grow_interval"] == 40
    same = RunAdapter(allow_batchnorm=False, grow_every=10, headroom=0.05)
    same.load_state_dict(state)
    assert same.grow.interval == 40  # the card stayed full: resuming does not start the attempts over
    changed = RunAdapter(allow_batchnorm=False, grow_every=5, headroom=0.05)
    changed.load_state_dict(state)
    assert changed.grow.interval == 5  # the user's new setting
    older = RunAdapter(allow_batchnorm=False, grow_every=5, headroom=0.05)
    older.load_state_dict({k: v for k, v in state.items() if k != "grow_every"})  # written before it was kept
    assert older.grow.interval == 40
