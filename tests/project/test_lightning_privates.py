"""Every Lightning private, and every behaviour of Lightning's that is not documented, the package relies on: each
asserted as the installed Lightning does it, on a real tiny Trainer on the CPU, so that a Lightning release that
moves one fails here first, with a message naming where the package relies on it.

What is relied on, and where:

- ``on_spill="adapt"`` (``tuning/adapter.py``, ``MicroBatches``): the order of one optimizer step's calls under
  automatic optimization (the training step, then ``optimizer_zero_grad`` on the first batch of an accumulation,
  then the strategy's ``backward`` with ``on_before_backward`` / ``on_after_backward`` inside it, the optimizer's step
  after the last batch's backward); the loss given to ``backward`` being the training step's divided by
  ``accumulate_grad_batches``; the strategy's ``training_step``, ``backward``, ``validation_step`` and the module's
  ``optimizer_zero_grad`` called through the instance (so replacing them there takes effect); what
  ``on_train_batch_end`` and ``on_validation_batch_end`` get as outputs; ``self.log``'s epoch mean weighed by the
  result collection's (``trainer._results``) ``batch`` and ``batch_size``.
- ``_lightning/privates.py``: each function and class, on the attribute or method it names.
- ``_compiler/dynamo_state.py`` (``lightning_dynamo_context``): ``LightningModule._compiler_ctx``.
- ``commands/demo.py`` (``_Progress.on_train_epoch_end``): ``fit_loop.epoch_loop.batch_progress.current.completed``.
"""

from __future__ import annotations

import inspect
import random
from contextlib import ExitStack
from copy import deepcopy
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
import torch
from conftest import trainer_kwargs
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import Logger
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities.combined_loader import CombinedLoader
from torch.utils.data import DataLoader, TensorDataset

from lightning_memguard._compiler.dynamo_state import lightning_dynamo_context
from lightning_memguard._lightning import privates
from lightning_memguard._lightning.privates import (
    BeforeModelWrapped,
    as_training_step_gets_it,
    checkpoint_contents,
    drop_loaders,
    fsdp_checkpoints_itself,
    load_loop_state,
    loader_passed_to_fit,
    logged_as_batch,
    loop_limits,
    loop_state,
    model_logging_dropped,
    one_more_step,
    reset_fit_loop,
    reset_progress,
    rng_states,
    run_fit_loop,
    set_loop_limits,
    set_rng_states,
    setup_loaders,
    strategy_methods_replaced,
    train_loader,
    validation_by_time,
)

ACCUMULATE = 2


def relies(where: str, what: str) -> str:
    """The message of a failed check: what Lightning does now, and where the package relies on what it did."""
    return f"Lightning changed: {what}. lightning_memguard relies on it in {where}"


class Recorded(LightningModule):
    """A linear model whose batches pass through both batch-transfer hooks; its training step returns its loss and
    predictions, its validation step its predictions, and logs each validation batch's samples."""

    def __init__(self, n: int = 12, batch_size: int = 4, val_n: int = 8) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 4, generator=gen)
        self.y = torch.randn(n, 1, generator=gen)
        self.batch_size = batch_size
        self.val_n = val_n
        self.seen: list[Any] = []  # each batch as training_step got it

    def on_before_batch_transfer(self, batch, dataloader_idx):
        x, y = batch
        return x * 2, y

    def on_after_batch_transfer(self, batch, dataloader_idx):
        x, y = batch
        return x + 1, y

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.append(batch)
        preds = self.net(x)
        return {"loss": torch.nn.functional.mse_loss(preds, y), "preds": preds.detach()}

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_samples", float(len(x)))
        return {"preds": self.net(x)}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.x, self.y), batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(TensorDataset(self.x[: self.val_n], self.y[: self.val_n]), batch_size=4)


class Seen(Logger):
    """A logger that keeps the last value it was given of each metric."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: dict[str, float] = {}

    @property
    def name(self) -> str:
        return "seen"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.metrics.update(metrics)

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


class Recorder(Callback):
    """Records, in order, the calls of one fit's optimizer steps, with their arguments and results: the strategy's
    and the module's methods replaced on the instances (as ``MicroBatches.install`` replaces them, from
    ``on_train_start``), the callback hooks, and the optimizer's step (a post-step hook). Each validation batch is
    split in two parts as the adapter splits it, each part logged as its own samples, and their outputs joined into a
    new dict."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []  # (call, batch_idx)
        self.calls: dict[str, list[Any]] = {"training_step": [], "backward": [], "optimizer_zero_grad": []}
        self.batch_ends: list[Any] = []  # on_train_batch_end's outputs
        self.validation: list[tuple[Any, Any]] = []  # (the batch, the joined output) of each validation_step
        self.validation_ends: list[tuple[Any, Any]] = []  # on_validation_batch_end's (outputs, batch)
        self.found: dict[str, Any] = {}  # what privates' functions gave at train start
        self._batch_idx = -1
        self._stack = ExitStack()

    def _add(self, name: str) -> None:
        self.events.append((name, self._batch_idx))

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        combined = train_loader(trainer)
        self.found = {
            "passed_to_fit": loader_passed_to_fit(trainer),
            "train_loader": combined,
            "first_batch": as_training_step_gets_it(trainer, next(iter(combined.flattened[0]))),
        }
        strategy, optimizer = trainer.strategy, trainer.optimizers[0]
        step, backward = strategy.training_step, strategy.backward
        optimizer_step, validation_step = strategy.optimizer_step, strategy.validation_step
        zero_grad, module_optimizer_step = pl_module.optimizer_zero_grad, pl_module.optimizer_step

        def record_step(*args, **kwargs):
            self._add("training_step")
            output = step(*args, **kwargs)
            self.calls["training_step"].append((args, kwargs, output))
            return output

        def record_backward(*args, **kwargs):
            self._add("backward")
            self.calls["backward"].append((args, kwargs))
            return backward(*args, **kwargs)

        def record_optimizer_step(*args, **kwargs):
            self._add("strategy.optimizer_step")
            return optimizer_step(*args, **kwargs)

        def split_validation_step(batch, *rest, **kwargs):
            x, y = batch
            outputs = []
            for part, samples in (((x[:3], y[:3]), 3), ((x[3:], y[3:]), 1)):
                with logged_as_batch(trainer, part, samples):
                    outputs.append(validation_step(part, *rest, **kwargs))
            joined = {"preds": torch.cat([o["preds"] for o in outputs])}
            self.validation.append((batch, joined))
            return joined

        def record_zero_grad(*args, **kwargs):
            self._add("optimizer_zero_grad")
            self.calls["optimizer_zero_grad"].append(args)
            return zero_grad(*args, **kwargs)

        def record_module_optimizer_step(*args, **kwargs):
            self._add("optimizer_step")
            return module_optimizer_step(*args, **kwargs)

        replaced = {
            "training_step": record_step,
            "backward": record_backward,
            "optimizer_step": record_optimizer_step,
            "validation_step": split_validation_step,
        }
        self._stack.enter_context(strategy_methods_replaced(strategy, replaced))
        pl_module.optimizer_zero_grad = record_zero_grad
        pl_module.optimizer_step = record_module_optimizer_step
        self._stack.callback(vars(pl_module).pop, "optimizer_zero_grad")
        self._stack.callback(vars(pl_module).pop, "optimizer_step")
        handle = optimizer.register_step_post_hook(lambda *args: self._add("weights stepped"))
        self._stack.callback(handle.remove)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._stack.close()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._batch_idx = batch_idx
        self._add("on_train_batch_start")

    def on_before_zero_grad(self, trainer, pl_module, optimizer) -> None:
        self._add("on_before_zero_grad")

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self._add("on_before_backward")

    def on_after_backward(self, trainer, pl_module) -> None:
        self._add("on_after_backward")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._add("on_before_optimizer_step")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._add("on_train_batch_end")
        self.batch_ends.append(outputs)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self.validation_ends.append((outputs, batch))


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> tuple[Trainer, Recorded, Recorder, Seen]:
    """One epoch of three batches of 4 with ``accumulate_grad_batches=2`` (two optimizer steps, the second on the
    epoch's last batch alone), then two validation batches of 4, every call recorded."""
    model, recorder, seen = Recorded(), Recorder(), Seen()
    kwargs = trainer_kwargs(
        tmp_path_factory.mktemp("recorded"), max_epochs=1, accumulate_grad_batches=ACCUMULATE, limit_val_batches=1.0
    )
    trainer = Trainer(**{**kwargs, "logger": seen}, callbacks=[recorder])
    trainer.fit(model)
    return trainer, model, recorder, seen


# ---------------------------------------------------------------- the adapter's step: order, loss, outputs


def test_one_optimizer_step_calls_training_step_zero_grad_and_backward_in_the_order_the_adapter_assumes(recorded):
    """``MicroBatches._step`` zeroes the gradients before the step's first forward and runs every backward inside
    the strategy's ``training_step``, then makes Lightning's ``optimizer_zero_grad`` and ``backward`` that follow it
    do nothing. That holds where Lightning calls them after ``training_step``, within the same batch, zeroes only at
    ``batch_idx % accumulate_grad_batches == 0``, and steps the optimizer after the last backward of the
    accumulation (inside ``optimizer_step``, which runs the training step as its closure)."""
    _, _, recorder, _ = recorded
    backward = ["backward", "on_before_backward", "on_after_backward"]  # the hooks run inside strategy.backward
    zero_grad = ["on_before_zero_grad", "optimizer_zero_grad"]
    stepped = ["on_before_optimizer_step", "weights stepped"]
    expected = [
        *[(name, 0) for name in ["on_train_batch_start", "training_step", *zero_grad, *backward, "on_train_batch_end"]],
        *[
            (name, 1)
            for name in [
                "on_train_batch_start",
                "optimizer_step",
                "strategy.optimizer_step",
                "training_step",
                *backward,
                *stepped,
                "on_train_batch_end",
            ]
        ],
        *[
            (name, 2)
            for name in [
                "on_train_batch_start",
                "optimizer_step",
                "strategy.optimizer_step",
                "training_step",
                *zero_grad,
                *backward,
                *stepped,
                "on_train_batch_end",
            ]
        ],
    ]
    assert recorder.events == expected, relies(
        "tuning/adapter.py:MicroBatches._step (and MicroBatches.install's owned_backward, owned_zero_grad)",
        f"3 batches with accumulate_grad_batches={ACCUMULATE} now call {recorder.events}, not {expected}",
    )


def test_the_replaced_methods_get_the_arguments_the_adapter_reads_and_passes(recorded):
    """``MicroBatches._step`` reads the batch and ``batch_idx`` as the strategy's ``training_step``'s first two
    positional arguments (the batch as transferred to the device), and calls the module's ``optimizer_zero_grad``
    with ``(current_epoch, batch_idx, trainer.optimizers[0])`` and the strategy's ``backward`` with ``(loss,
    trainer.optimizers[0])`` itself, as Lightning calls them."""
    trainer, model, recorder, _ = recorded
    optimizer = trainer.optimizers[0]
    calls = zip(recorder.calls["training_step"], model.seen, strict=True)
    steps = [(len(args), args[1], args[0] is seen, kwargs) for (args, kwargs, _), seen in calls]
    assert steps == [(2, i, True, {}) for i in range(3)], relies(
        "tuning/adapter.py:MicroBatches._step", f"the strategy's training_step is now called as {steps}"
    )
    zero_grads = [(epoch, batch_idx, o is optimizer) for epoch, batch_idx, o in recorder.calls["optimizer_zero_grad"]]
    assert zero_grads == [(0, 0, True), (0, 2, True)], relies(
        "tuning/adapter.py:MicroBatches._step (zero_grad(trainer.current_epoch, batch_idx, optimizer))",
        f"optimizer_zero_grad is now called as {zero_grads}",
    )
    backwards = [(len(args), args[1] is optimizer, kwargs) for args, kwargs in recorder.calls["backward"]]
    assert backwards == [(2, True, {})] * 3, relies(
        "tuning/adapter.py:MicroBatches._forward_backward (backward(loss, optimizer))",
        f"the strategy's backward is now called as {backwards}",
    )


def test_backward_gets_the_training_step_loss_divided_by_the_accumulation_and_the_hooks_get_it_too(recorded):
    """The adapter backpropagates ``loss / accumulate_grad_batches`` itself, as Lightning would, and returns the
    whole batch's loss times that for Lightning to divide again (``MicroBatches._forward_backward``): exact only
    where Lightning divides the training step's ``"loss"`` by ``accumulate_grad_batches``, and what reaches
    ``on_train_batch_end`` is that quotient, detached, beside the step's other outputs as returned."""
    _, _, recorder, _ = recorded
    for (_, _, output), (args, _), ends in zip(
        recorder.calls["training_step"], recorder.calls["backward"], recorder.batch_ends, strict=True
    ):
        assert torch.equal(args[0], output["loss"] / ACCUMULATE), relies(
            "tuning/adapter.py:MicroBatches._forward_backward (backward(loss / accumulate))",
            f"backward got {args[0].item()!r} for a training step's loss of {output['loss'].item()!r} with"
            f" accumulate_grad_batches={ACCUMULATE}",
        )
        assert ends.keys() == {"loss", "preds"} and ends["preds"] is output["preds"], relies(
            "tuning/adapter.py:_extras", f"on_train_batch_end got {sorted(ends)} for a step returning loss and preds"
        )
        assert torch.equal(ends["loss"], output["loss"].detach() / ACCUMULATE), relies(
            "tuning/adapter.py:MicroBatches._forward_backward (loss = total * accumulate)",
            f"on_train_batch_end got loss {ends['loss'].item()!r} for {output['loss'].item()!r}",
        )
        assert not ends["loss"].requires_grad


class LogsParts(LightningModule):
    """Each training batch logs its samples whole, then two parts of it, each inside ``logged_as_batch`` with its
    own samples (a value of 1.0 for all but the last sample, 0.0 for that one), as ``MicroBatches`` logs its
    micro-batches; what the result collection holds is recorded around the logs. Each part opens with a tensor
    shared by all its samples, by which Lightning would size it wrongly (7) were its samples not given."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.x = torch.randn(10, 4, generator=torch.Generator().manual_seed(0))
        self.found: list[dict[str, Any]] = []

    def training_step(self, batch, batch_idx):
        (x,) = batch
        results = self.trainer._results
        found = {"batch": results.batch is batch, "batch_size": results.batch_size}
        self.log("whole", float(len(x)), on_step=False, on_epoch=True)
        shared = torch.arange(7)
        parts = [((shared, x[:-1]), len(x) - 1, 1.0), ((shared, x[-1:]), 1, 0.0)]
        before = int(results["training_step.parts"].cumulated_batch_size) if batch_idx else 0
        for part, samples, value in parts:
            with logged_as_batch(self.trainer, part, samples):
                found.setdefault("inside", []).append((results.batch is part, results.batch_size))
                self.log("parts", value, on_step=False, on_epoch=True)
        found["after"] = (results.batch is batch, results.batch_size)
        found["counted"] = int(results["training_step.parts"].cumulated_batch_size) - before
        self.found.append(found)
        return self.net(x).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.x), batch_size=4)


def test_self_log_weighs_an_epoch_mean_by_the_result_collection_s_batch_and_batch_size(tmp_path):
    """``logged_as_batch`` (used by ``MicroBatches._forward_backward`` and its split ``validation_step``) sets the
    result collection's ``batch`` and ``batch_size`` to a micro-batch's, so that ``self.log``'s epoch mean weighs each
    micro-batch's value by its own samples and an epoch's figure is the whole batches'. That holds where
    ``trainer._results`` is the running loop's collection, holds the training step's batch, sizes a value by its
    ``batch_size`` when set (else by the batch's samples), and adds a key logged again within one step to its mean."""
    model, seen = LogsParts(), Seen()
    Trainer(**{**trainer_kwargs(tmp_path, max_epochs=1), "logger": seen}).fit(model)
    where = "_lightning/privates.py:logged_as_batch, used by tuning/adapter.py:MicroBatches._forward_backward"
    for found, samples in zip(model.found, (4, 4, 2), strict=True):
        assert found["batch"] and found["batch_size"] is None, relies(
            where, f"in training_step the result collection holds {found} before a log, not its batch and no size"
        )
        assert found["inside"] == [(True, samples - 1), (True, 1)], relies(
            where, f"the result collection's batch and batch_size did not take a part's: {found['inside']}"
        )
        assert found["after"] == (True, samples), relies(
            where, f"after a log the result collection holds {found['after']}, not the batch and its samples"
        )
        assert found["counted"] == samples, relies(
            where, f"two logs of a key in one step counted {found['counted']} samples, not {samples}"
        )
    # 4, 4 and 2 samples weighed by samples: (16 + 16 + 4) / 10; the parts (3 + 3 + 1) / 10 (unweighted: 0.5)
    assert seen.metrics["whole"] == pytest.approx(3.6) and seen.metrics["parts"] == pytest.approx(0.7), relies(
        where, f"the logger saw {seen.metrics} as the epoch's means, not whole 3.6 and parts 0.7"
    )


def test_validation_step_outputs_reach_the_hooks_as_the_strategy_s_replaced_method_returns_them(recorded):
    """``MicroBatches.install``'s ``split_validation_step``, set on the strategy, gets the validation batch as its
    first argument (as transferred, the batch ``on_validation_batch_end`` gets), runs the module's step on each part
    under ``logged_as_batch``, and returns the parts' outputs joined: Lightning must call it through the instance and
    hand what it returns to ``on_validation_batch_end``, and weigh each part's logged value by the part's samples."""
    _, _, recorder, seen = recorded
    where = "tuning/adapter.py:MicroBatches.install (split_validation_step)"
    assert len(recorder.validation) == 2, relies(
        where, f"the strategy's validation_step set on the instance ran {len(recorder.validation)} times, not 2"
    )
    for (batch, joined), (outputs, hook_batch) in zip(recorder.validation, recorder.validation_ends, strict=True):
        assert outputs is joined, relies(where, "on_validation_batch_end no longer gets what validation_step returned")
        assert hook_batch is batch, relies(where, "validation_step no longer gets the batch the hooks get")
    # parts of 3 and 1 samples logging 3.0 and 1.0: (3 * 3 + 1 * 1) / 4 (unweighted: 2.0)
    assert seen.metrics["val_samples"] == pytest.approx(2.5), relies(
        "_lightning/privates.py:logged_as_batch, in " + where,
        f"validation's epoch mean of parts of 3 and 1 samples is {seen.metrics['val_samples']}, not 2.5",
    )


def test_ddp_strategy_blocks_gradient_sync_through_a_context_manager():
    """``MicroBatches._forward_backward`` runs every micro-batch but the last under DDP's
    ``block_backward_sync()``, so gradients are all-reduced once, in the last backward."""
    with DDPStrategy().block_backward_sync():  # no model wrapped: nothing to block, and it enters
        pass


# ---------------------------------------------------------------- _lightning/privates.py, function by function


def test_rng_states_are_read_and_set_whole():
    """``rng_states``/``set_rng_states`` (``lightning.fabric.utilities.seed._collect_rng_states``): a trial and a
    loader built to be read leave every generator as it was (``tuning/trials.py``, ``_lightning/loaders.py``)."""
    states = rng_states()
    drawn = (random.random(), np.random.rand(), torch.rand(1).item())
    set_rng_states(states)
    again = (random.random(), np.random.rand(), torch.rand(1).item())
    assert {"torch", "python", "numpy"} <= states.keys() and again == drawn, relies(
        "_lightning/privates.py:rng_states, set_rng_states", f"the states hold {sorted(states)}; drawn again {again}"
    )


def test_the_train_loader_as_built_and_the_batch_as_training_step_gets_it(recorded):
    """``train_loader`` (``FitLoop._combined_loader``), ``loader_passed_to_fit`` (``FitLoop._data_source``) and
    ``as_training_step_gets_it`` (``LightningModule._on_before_batch_transfer``, then the strategy's
    ``batch_to_device``) at train start, from the module's own ``train_dataloader``."""
    _, model, recorder, _ = recorded
    found = recorder.found
    where = "_lightning/privates.py:{}, used by tuning/trainer_hands.py, tuning/trials.py and _lightning/loaders.py"
    assert isinstance(found["train_loader"], CombinedLoader), relies(
        where.format("train_loader"), f"FitLoop._combined_loader is {found['train_loader']!r} at train start"
    )
    assert found["train_loader"].flattened[0].batch_size == 4
    assert found["passed_to_fit"] is False, relies(
        where.format("loader_passed_to_fit"), "FitLoop._data_source says a module's train_dataloader was passed"
    )
    first, batch = found["first_batch"], model.seen[0]
    assert all(torch.equal(a, b) for a, b in zip(first, batch, strict=True)), relies(
        where.format("as_training_step_gets_it"), "the first batch transferred is not the one training_step got"
    )


class Probe(Callback):
    """At the end of the first batch: whether the loader came from ``fit``, and the checkpoint's contents."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == 0:
            self.passed = loader_passed_to_fit(trainer)
            self.contents = checkpoint_contents(trainer)


def test_a_loader_passed_to_fit_and_the_checkpoint_built_without_writing_it(tmp_path):
    """``loader_passed_to_fit`` (a tuner cannot resize a loader given to ``fit``: ``tuning/trials.py``) and
    ``checkpoint_contents`` (``Trainer._checkpoint_connector.dump_checkpoint``: the spill checkpoint,
    ``_lightning/spill_checkpoint.py:write_checkpoint``)."""
    model, probe = Recorded(), Probe()
    loader = DataLoader(TensorDataset(model.x, model.y), batch_size=4)
    Trainer(**trainer_kwargs(tmp_path, max_steps=2), callbacks=[probe]).fit(model, train_dataloaders=loader)
    assert probe.passed is True, relies(
        "_lightning/privates.py:loader_passed_to_fit", "FitLoop._data_source says a loader given to fit was not"
    )
    contents = probe.contents
    expected = {"state_dict", "optimizer_states", "lr_schedulers", "loops", "callbacks", "global_step", "epoch"}
    assert expected <= contents.keys() and contents["global_step"] == 1, relies(
        "_lightning/privates.py:checkpoint_contents", f"the checkpoint holds {sorted(contents)}"
    )
    assert contents["state_dict"].keys() == model.state_dict().keys()
    assert list(tmp_path.rglob("*.ckpt")) == [], "checkpoint_contents wrote a file"


def test_validation_by_time_reads_the_trainer_s_time_interval(tmp_path):
    """``validation_by_time`` (``Trainer._val_check_time_interval``): a tuner refuses a validation interval set in
    time (``tuning/trainer_hands.py``)."""
    by_time = Trainer(**trainer_kwargs(tmp_path, val_check_interval=timedelta(seconds=30)))
    by_batches = Trainer(**trainer_kwargs(tmp_path))
    where = "_lightning/privates.py:validation_by_time, used by tuning/trainer_hands.py"
    assert hasattr(by_batches, "_val_check_time_interval"), relies(where, "Trainer._val_check_time_interval is gone")
    assert validation_by_time(by_time) and not validation_by_time(by_batches), relies(
        where, "Trainer._val_check_time_interval does not tell a time from a number of batches"
    )


class Resizes(Callback):
    """At train start: the loaders dropped, the batch size set to 2, the train loader built again."""

    def on_train_start(self, trainer, pl_module) -> None:
        drop_loaders(trainer)
        self.dropped = (train_loader(trainer), trainer.fit_loop.epoch_loop.val_loop._combined_loader)
        pl_module.batch_size = 2
        setup_loaders(trainer)
        self.built = train_loader(trainer)


def test_loaders_dropped_are_built_again_at_the_batch_size_set(tmp_path):
    """``drop_loaders`` and ``setup_loaders`` (``FitLoop._combined_loader``, ``FitLoop.setup_data``): a tuner's size
    reaches the loader the run trains with (``_lightning/loaders.py:reload_train_dataloader``)."""
    model, resizes = Recorded(n=8), Resizes()
    Trainer(**trainer_kwargs(tmp_path, max_epochs=1), callbacks=[resizes]).fit(model)
    where = "_lightning/privates.py:drop_loaders, setup_loaders, used by _lightning/loaders.py:reload_train_dataloader"
    assert resizes.dropped == (None, None), relies(where, f"the loaders dropped are {resizes.dropped}")
    assert isinstance(resizes.built, CombinedLoader) and resizes.built.flattened[0].batch_size == 2, relies(
        where, "FitLoop.setup_data did not build the train loader again from train_dataloader()"
    )
    assert [len(x) for x, _ in model.seen] == [2, 2, 2, 2], relies(where, "the run did not train at the size set")


class Trials(Callback):
    """At train start, two trials run in the fit loop, as ``tuning/trials.py`` runs them: the first of 2 steps and
    one more (asked at its first batch), into the next epoch; the second of 2 steps from progress reset; then the
    run's limits, progress and loaders put back."""

    def __init__(self) -> None:
        self.found: dict[str, Any] = {}
        self.trialing = False
        self.extend = False

    def on_train_start(self, trainer, pl_module) -> None:
        if self.trialing:
            return
        self.trialing = True
        fit_loop = trainer.fit_loop
        limits, saved = loop_limits(trainer), deepcopy(loop_state(trainer))
        self.found["limits"] = limits
        set_loop_limits(trainer, {"max_steps": 2, "max_epochs": -1, "min_epochs": 0, "min_steps": None})
        reset_progress(trainer)
        self.extend = True
        run_fit_loop(trainer)
        self.found["first"] = (trainer.global_step, len(pl_module.seen), trainer.current_epoch)
        reset_progress(trainer)
        epoch_loop = fit_loop.epoch_loop
        progress = (fit_loop.epoch_progress.current.completed, epoch_loop.batch_progress.current.ready)
        self.found["reset"] = (trainer.global_step, *progress)
        set_loop_limits(trainer, {"max_steps": 2})
        run_fit_loop(trainer)
        self.found["second"] = (trainer.global_step, len(pl_module.seen))
        set_loop_limits(trainer, limits)
        load_loop_state(trainer, deepcopy(saved))
        drop_loaders(trainer)
        setup_loaders(trainer)
        reset_fit_loop(trainer)
        self.found["restored"] = (trainer.global_step, trainer.current_epoch, loop_limits(trainer))
        self.trialing = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.extend:
            self.extend = False
            one_more_step(trainer)


def test_trials_run_the_fit_loop_for_set_steps_and_put_it_back(tmp_path):
    """``loop_limits``, ``set_loop_limits``, ``one_more_step``, ``reset_progress``, ``run_fit_loop``, ``loop_state``,
    ``load_loop_state`` and ``reset_fit_loop`` (the loops' limits, progress and ``FitLoop.run``/``reset``), as the
    tuners' trials drive the fit loop inside ``on_train_start`` (``tuning/trials.py:TrialSession``)."""
    model, trials = Recorded(n=8), Trials()  # two batches an epoch
    trainer = Trainer(**trainer_kwargs(tmp_path, max_steps=4, max_epochs=3), callbacks=[trials])
    trainer.fit(model)
    found, where = trials.found, "_lightning/privates.py:{}, used by tuning/trials.py:TrialSession"
    limits = found["limits"]
    assert (limits["max_steps"], limits["max_epochs"], limits["min_steps"]) == (4, 3, None), relies(
        where.format("loop_limits"), f"the fit loop's limits read {limits} for Trainer(max_steps=4, max_epochs=3)"
    )
    # into the second epoch of two batches, ended there by max_steps (an epoch ended counts: current_epoch 2)
    assert found["first"] == (3, 3, 2), relies(
        where.format("set_loop_limits, one_more_step, run_fit_loop"),
        f"a trial of 2 steps and one more ran to (global_step, batches, epoch) {found['first']}, not (3, 3, 2)",
    )
    assert found["reset"] == (0, 0, 0), relies(
        where.format("reset_progress"), f"(global_step, epochs, batches) after a reset are {found['reset']}"
    )
    assert found["second"] == (2, 5), relies(
        where.format("reset_progress, run_fit_loop"), f"a second trial ran to {found['second']}, not (2, 5)"
    )
    assert found["restored"] == (0, 0, found["limits"]), relies(
        where.format("load_loop_state, set_loop_limits, reset_fit_loop"), f"put back: {found['restored']}"
    )
    assert (trainer.global_step, len(model.seen)) == (4, 9), relies(
        where.format("load_loop_state, reset_fit_loop"),
        f"the run after the trials ended at (global_step, batches) {(trainer.global_step, len(model.seen))}",
    )


def test_strategy_methods_replaced_on_the_instance_are_called_and_put_back(recorded):
    """``strategy_methods_replaced``: Lightning's loops call the strategy's ``training_step``, ``backward``,
    ``optimizer_step`` and ``validation_step`` through the instance (``trainer.strategy.training_step(...)``), so
    methods set there take effect (``tuning/adapter.py:MicroBatches.install``, ``tuning/trials.py``); after, the
    class's own again."""
    trainer, _, recorder, _ = recorded
    counts = {name: sum(event == name for event, _ in recorder.events) for name in ("training_step", "backward")}
    assert counts == {"training_step": 3, "backward": 3}, relies(
        "_lightning/privates.py:strategy_methods_replaced", f"the methods set on the strategy ran {counts} times"
    )
    assert not {"training_step", "backward", "optimizer_step", "validation_step"} & vars(trainer.strategy).keys()


class Wrapped(BeforeModelWrapped, SingleDeviceStrategy):
    def before_model_wrapped(self) -> None:
        self.found = (self.model is self.lightning_module, self.lightning_module.device.type)


def test_before_model_wrapped_runs_in_setup_before_the_strategy_wraps_the_model(tmp_path):
    """``BeforeModelWrapped`` (``Strategy._setup_model``): the checkpointing strategies checkpoint the model there,
    on its device, before DDP or FSDP wraps it (``strategies/checkpointing_strategies.py``)."""
    strategy = Wrapped(device=torch.device("cpu"))
    Trainer(**trainer_kwargs(tmp_path, max_steps=1), strategy=strategy).fit(Recorded())
    where = "_lightning/privates.py:BeforeModelWrapped, used by strategies/checkpointing_strategies.py"
    assert getattr(strategy, "found", None) == (True, "cpu"), relies(where, "Strategy.setup no longer calls it")
    for wrapping in (DDPStrategy, FSDPStrategy):  # each wraps the model in its own _setup_model, called in setup
        wraps = "_setup_model" in vars(wrapping) and "self._setup_model(" in inspect.getsource(wrapping)
        assert wraps, relies(where, f"{wrapping.__name__} no longer wraps the model through _setup_model")


def test_fsdp_checkpoints_itself_reads_fsdp_s_own_policy():
    """``fsdp_checkpoints_itself`` (``FSDPStrategy._activation_checkpointing_kwargs``): ActivationCheckpointing is
    refused beside FSDP's own (``callbacks/activation_checkpointing.py``)."""
    where = "_lightning/privates.py:fsdp_checkpoints_itself, used by callbacks/activation_checkpointing.py"
    plain, own = FSDPStrategy(), FSDPStrategy(activation_checkpointing_policy={torch.nn.Linear})
    assert hasattr(plain, "_activation_checkpointing_kwargs"), relies(where, "FSDPStrategy keeps no such attribute")
    assert fsdp_checkpoints_itself(own) and not fsdp_checkpoints_itself(plain), relies(
        where, "FSDPStrategy._activation_checkpointing_kwargs does not tell whether a policy was given"
    )


def test_lightning_sets_the_model_s_log_on_every_callback_and_it_can_be_dropped(recorded):
    """``model_logging_dropped`` (``_CallbackConnector._attach_model_logging_functions``): Lightning sets the
    module's bound ``log`` and ``log_dict`` on each callback; dropped, a callback kept after fit keeps no model
    (``callbacks/memguard.py``, ``callbacks/tuners.py``, ``callbacks/activation_checkpointing.py``, the emulator)."""
    _, model, recorder, _ = recorded
    kept = {name: getattr(vars(recorder).get(name), "__self__", None) is model for name in ("log", "log_dict")}
    assert kept == {"log": True, "log_dict": True}, relies(
        "_lightning/privates.py:model_logging_dropped", f"the module's log is set on a callback: {kept}"
    )
    model_logging_dropped(recorder)
    assert not {"log", "log_dict"} & vars(recorder).keys()


# ---------------------------------------------------------------- elsewhere in the package


def test_fit_keeps_the_compile_context_of_a_compiled_module(tmp_path):
    """``LightningModule._compiler_ctx``: ``fit`` unwraps a ``torch.compile`` result and keeps its context there,
    where ``_compiler/dynamo_state.py:lightning_dynamo_context`` finds that the module runs compiled."""
    model = Recorded()  # its training step calls self.net, not forward: nothing is compiled
    compiled = torch.compile(model, backend="eager")
    Trainer(**trainer_kwargs(tmp_path, max_steps=1)).fit(compiled)
    assert lightning_dynamo_context(model) is compiled.dynamo_ctx, relies(
        "_compiler/dynamo_state.py:lightning_dynamo_context", "fit keeps no LightningModule._compiler_ctx"
    )


def test_the_epoch_loop_counts_the_batches_done(recorded):
    """``fit_loop.epoch_loop.batch_progress.current.completed``: the steps ``memguard demo`` says an epoch ran
    (``commands/demo.py``)."""
    trainer, _, _, _ = recorded
    completed = trainer.fit_loop.epoch_loop.batch_progress.current.completed
    assert completed == 3, relies("commands/demo.py", f"an epoch of 3 batches counts {completed} batches completed")


CHECKED = {  # each of privates' names, and the test above that checks it
    "rng_states": test_rng_states_are_read_and_set_whole,
    "set_rng_states": test_rng_states_are_read_and_set_whole,
    "loader_passed_to_fit": test_a_loader_passed_to_fit_and_the_checkpoint_built_without_writing_it,
    "train_loader": test_the_train_loader_as_built_and_the_batch_as_training_step_gets_it,
    "validation_by_time": test_validation_by_time_reads_the_trainer_s_time_interval,
    "drop_loaders": test_loaders_dropped_are_built_again_at_the_batch_size_set,
    "setup_loaders": test_loaders_dropped_are_built_again_at_the_batch_size_set,
    "as_training_step_gets_it": test_the_train_loader_as_built_and_the_batch_as_training_step_gets_it,
    "loop_limits": test_trials_run_the_fit_loop_for_set_steps_and_put_it_back,
    "set_loop_limits": test_trials_run_the_fit_loop_for_set_steps_and_put_it_back,
    "one_more_step": test_trials_run_the_fit_loop_for_set_steps_and_put_it_back,
    "loop_state": test_trials_run_the_fit_loop_for_set_steps_and_put_it_back,
    "load_loop_state": test_trials_run_the_fit_loop_for_set_steps_and_put_it_back,
    "reset_progress": test_trials_run_the_fit_loop_for_set_steps_and_put_it_back,
    "run_fit_loop": test_trials_run_the_fit_loop_for_set_steps_and_put_it_back,
    "reset_fit_loop": test_trials_run_the_fit_loop_for_set_steps_and_put_it_back,
    "logged_as_batch": test_self_log_weighs_an_epoch_mean_by_the_result_collection_s_batch_and_batch_size,
    "strategy_methods_replaced": test_strategy_methods_replaced_on_the_instance_are_called_and_put_back,
    "BeforeModelWrapped": test_before_model_wrapped_runs_in_setup_before_the_strategy_wraps_the_model,
    "checkpoint_contents": test_a_loader_passed_to_fit_and_the_checkpoint_built_without_writing_it,
    "fsdp_checkpoints_itself": test_fsdp_checkpoints_itself_reads_fsdp_s_own_policy,
    "model_logging_dropped": test_lightning_sets_the_model_s_log_on_every_callback_and_it_can_be_dropped,
}


def test_every_function_and_class_of_privates_has_its_check_here():
    """A function added to ``_lightning/privates.py`` comes with a test here of the private it touches."""
    defined = {
        name
        for name, value in vars(privates).items()
        if (inspect.isfunction(value) or inspect.isclass(value))
        and value.__module__ == privates.__name__
        and not name.startswith("_")
    }
    assert defined == CHECKED.keys(), (
        f"_lightning/privates.py defines {sorted(defined - CHECKED.keys())} unchecked here, and no longer"
        f" {sorted(CHECKED.keys() - defined)}: add (or remove) its test and its CHECKED entry"
    )
