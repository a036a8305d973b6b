"""The levers' planner inside a Trainer: ``ActivationCheckpointing(memory_budget=..., levers=True)`` and the
strategies' ``levers=``, on the CPU with real tiny Trainers. A tiny Hugging Face GPT-2 held by a LightningModule
gets the fused loss and a recomputation and trains as the plain one; a resumed run and a second fit re-apply the
record without measuring (the planner is replaced by one that fails); a model of no known family plans without the
fused loss; the combinations the planner cannot serve are refused, naming why."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch
from conftest import ddp_scenario_results, ddp_scenarios, trainer_kwargs
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader

from lightning_memguard import ActivationCheckpointing
from lightning_memguard.checkpointing import is_checkpointed
from lightning_memguard.levers import lever_policy
from lightning_memguard.levers.huggingface_loss import is_fused
from lightning_memguard.levers.pointwise import PointwiseRecomputed
from lightning_memguard.strategies import CheckpointingSingleDeviceStrategy

transformers = pytest.importorskip("transformers")
from language_model import LanguageModel, Tokens  # noqa: E402


def _fit(module: LightningModule, tmp_path, callbacks=(), **kwargs) -> Trainer:
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=list(callbacks), **kwargs))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module)
    return trainer


def _levers_on(module: nn.Module) -> dict[str, list[str]]:
    return {
        "fused": [n for n, m in module.named_modules() if is_fused(m)],
        "checkpointed": [n for n, m in module.named_modules() if is_checkpointed(m)],
        "pointwise": [n for n, m in module.named_modules() if isinstance(m, PointwiseRecomputed)],
    }


def _no_planning(monkeypatch) -> None:
    def fails(*args, **kwargs):
        raise AssertionError("the levers were measured again")

    monkeypatch.setattr(lever_policy, "plan_levers", fails)


BUDGET = 0.4


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """One fit with the levers (a checkpoint kept) and one plain, from the same weights and batches."""
    tmp = tmp_path_factory.mktemp("levers")
    cb = ActivationCheckpointing(memory_budget=BUDGET, levers=True)
    module = LanguageModel()
    trainer = _fit(module, tmp, [cb], enable_checkpointing=True)
    plain = LanguageModel()
    _fit(plain, tmp / "plain")
    return cb, module, plain, trainer.checkpoint_callback.best_model_path


def test_the_fused_loss_and_a_recomputation_are_applied_and_train_as_the_plain_model(fitted):
    cb, module, plain, _ = fitted
    plan = cb.lever_plan
    assert plan is not None and plan.held and plan.loss and plan.loss_module == "model"
    applied = _levers_on(module)
    assert applied["fused"] == ["model"] and (applied["checkpointed"] or applied["pointwise"])
    assert cb.lever_record == plan.record() and cb.plan is None
    assert cb.runs == [[name] for name in plan.checkpointed]
    for (name, got), want in zip(module.state_dict().items(), plain.state_dict().values(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=name)  # the same keys, the same training
    batch = Tokens()[0:4]
    losses, grads = [], []
    for m in (module, plain):
        m.zero_grad(set_to_none=True)
        loss = m.training_step(batch, 0)
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad for p in m.parameters()])
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-5)
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_a_resumed_run_re_applies_the_levers_without_measuring(fitted, tmp_path, monkeypatch):
    cb, module, _, ckpt = fitted
    _no_planning(monkeypatch)
    resumed = ActivationCheckpointing(memory_budget=BUDGET, levers=True)
    again = LanguageModel()
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=2, callbacks=[resumed]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(again, ckpt_path=ckpt)
    assert trainer.global_step == 4 and resumed.lever_plan is None  # trained on, nothing measured
    assert resumed.lever_record == cb.lever_record and _levers_on(again) == _levers_on(module)


def test_the_same_callback_in_a_second_fit_re_applies_its_levers(fitted, tmp_path, monkeypatch):
    cb, module, _, _ = fitted
    _no_planning(monkeypatch)
    second = LanguageModel(seed=1)
    _fit(second, tmp_path, [cb])
    assert _levers_on(second) == _levers_on(module)


def test_the_same_model_fitted_again_by_the_same_callback_keeps_its_levers_once(tmp_path, monkeypatch):
    # the model carries the first fit's levers: they are taken off and applied again, never refused or stacked
    cb, module = ActivationCheckpointing(memory_budget=BUDGET, levers=True), LanguageModel()
    _fit(module, tmp_path / "first", [cb])
    first = _levers_on(module)
    _no_planning(monkeypatch)
    trainer = _fit(module, tmp_path / "second", [cb])
    assert trainer.global_step >= 1 and _levers_on(module) == first and first["fused"] == ["model"]


@pytest.mark.parametrize("run", ["fast_dev_run", "loader passed to fit"])
def test_the_levers_in_the_runs_users_make(tmp_path, run):
    cb = ActivationCheckpointing(memory_budget=BUDGET, levers=True)
    module = LanguageModel()
    trainer = Trainer(
        **trainer_kwargs(
            tmp_path, callbacks=[cb], **({"fast_dev_run": True} if run == "fast_dev_run" else {"max_epochs": 1})
        )
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if run == "loader passed to fit":
            trainer.fit(module, train_dataloaders=module.train_dataloader())
        else:
            trainer.fit(module)
    assert cb.lever_plan is not None and cb.lever_plan.held and trainer.global_step >= 1
    assert _levers_on(module)["fused"] == ["model"]


def test_a_checkpoint_without_the_levers_loads_and_the_levers_are_planned_anew():
    cb = ActivationCheckpointing(memory_budget=BUDGET, levers=True)
    cb.load_state_dict({"runs": [["model.transformer.h.0"]], "compile_setting": None, "split_graphs": False})
    assert cb.lever_record is None and not cb.policy.decided  # an old checkpoint, or one made with levers=False
    plain = ActivationCheckpointing(memory_budget=BUDGET)
    plain.load_state_dict({"runs": [["a"]], "levers": {"version": 1}})  # levers=False reads its runs alone
    assert plain.runs == [["a"]] and plain.lever_record is None


def test_the_single_device_strategy_takes_the_levers(tmp_path):
    strategy = CheckpointingSingleDeviceStrategy("cpu", memory_budget=BUDGET, levers=True)
    module = LanguageModel()
    _fit(module, tmp_path, strategy=strategy)
    record = strategy.checkpointing.lever_record
    assert record is not None and record["fused_loss"] and _levers_on(module)["fused"] == ["model"]
    assert "levers: the fused loss" in strategy.checkpointing.summary()


class ReadsItsLogits(LanguageModel):
    """A step that reads the logits (an accuracy), as many users' do."""

    def training_step(self, batch, batch_idx):
        output = self.model(input_ids=batch["input_ids"], labels=batch["labels"])
        self.accuracy = (output.logits[:, :-1].argmax(-1) == batch["labels"][:, 1:]).float().mean()
        return output.loss


@pytest.mark.parametrize("where", ["callback", "strategy"])
def test_fused_loss_false_plans_the_other_levers_and_keeps_the_logits(tmp_path, where):
    module = ReadsItsLogits()
    if where == "callback":
        cb = ActivationCheckpointing(memory_budget=BUDGET, levers=True, fused_loss=False)
        _fit(module, tmp_path, [cb])
        record, summary = cb.lever_record, cb.lever_plan.summary()
    else:
        strategy = CheckpointingSingleDeviceStrategy("cpu", memory_budget=BUDGET, levers=True, fused_loss=False)
        _fit(module, tmp_path, strategy=strategy)
        record, summary = strategy.checkpointing.lever_record, strategy.checkpointing.summary()
    assert record is not None and not record["fused_loss"] and "not offered (fused_loss=False)" in summary
    applied = _levers_on(module)
    assert applied["fused"] == [] and (applied["checkpointed"] or applied["pointwise"])
    assert 0.0 <= float(module.accuracy) <= 1.0  # the logits were there at every step
    with pytest.raises(TypeError, match="`fused_loss` must be a bool"):
        ActivationCheckpointing(memory_budget=BUDGET, levers=True, fused_loss="no")


def test_fused_loss_false_holds_on_resume_and_in_a_second_fit(tmp_path, monkeypatch):
    """The record says the fused loss was not taken: a resumed run and the same callback's second fit re-apply the
    other levers without measuring, and the step still reads its logits."""
    cb, module = ActivationCheckpointing(memory_budget=BUDGET, levers=True, fused_loss=False), ReadsItsLogits()
    ckpt = _fit(module, tmp_path / "first", [cb], enable_checkpointing=True).checkpoint_callback.best_model_path
    applied = _levers_on(module)
    _no_planning(monkeypatch)
    resumed = ActivationCheckpointing(memory_budget=BUDGET, levers=True, fused_loss=False)
    again = ReadsItsLogits()
    trainer = Trainer(**trainer_kwargs(tmp_path / "resumed", max_epochs=2, callbacks=[resumed]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(again, ckpt_path=ckpt)
    second = ReadsItsLogits(seed=1)
    _fit(second, tmp_path / "second", [cb])
    for fitted in (again, second):
        assert _levers_on(fitted) == applied and applied["fused"] == []
        assert 0.0 <= float(fitted.accuracy) <= 1.0
    assert trainer.global_step == 4 and resumed.lever_record == cb.lever_record


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.linear(x)) + x


class Blocks(LightningModule):
    """A model of no known family: a plain chain of residual blocks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(*(Block(64) for _ in range(4)), nn.Linear(64, 1))
        self.example_input_array = torch.randn(128, 64)
        self.data = torch.randn(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return self(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(torch.utils.data.TensorDataset(self.data), batch_size=128)


def test_a_model_of_no_known_family_plans_without_the_fused_loss(tmp_path):
    cb = ActivationCheckpointing(units={Block}, memory_budget=0.6, levers=True)
    module = Blocks()
    plain = copy.deepcopy(module)
    _fit(module, tmp_path, [cb])
    _fit(plain, tmp_path / "plain")
    plan = cb.lever_plan
    assert plan is not None and plan.held and not plan.loss and "not a Hugging Face model" in plan.loss_refused
    applied = _levers_on(module)
    assert not applied["fused"] and (applied["checkpointed"] or applied["pointwise"])
    for got, want in zip(module.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(got, want)


class Sized(Blocks):
    """:class:`Blocks` with its batch size on ``batch_size``, where Lightning's ``BatchSizeFinder`` sets it, and no
    ``example_input_array``: the budget is measured on the first training batch. Each training step records its
    batch's size and whether the levers were on the model."""

    def __init__(self) -> None:
        super().__init__()
        self.example_input_array = None
        self.batch_size = 4
        self.steps: list[tuple[int, bool]] = []

    def training_step(self, batch, batch_idx):
        levers = _levers_on(self)
        self.steps.append((len(batch[0]), bool(levers["checkpointed"] or levers["pointwise"])))
        return super().training_step(batch, batch_idx)

    def train_dataloader(self):
        return DataLoader(torch.utils.data.TensorDataset(self.data), batch_size=self.batch_size)


def test_beside_the_batch_size_finder_the_levers_are_planned_for_the_size_it_settled_on(tmp_path, monkeypatch):
    """Lightning runs its BatchSizeFinder first, at fit start: its trials (4, 8) run on the model as it is, and
    the levers are then measured on a first batch of the size it chose, whatever the order in ``callbacks``."""
    from lightning.pytorch.callbacks import BatchSizeFinder

    measured: list[int] = []
    plan = lever_policy.plan_levers

    def counted(model, example, *args, **kwargs):
        measured.append(len(example))
        return plan(model, example, *args, **kwargs)

    monkeypatch.setattr(lever_policy, "plan_levers", counted)
    cb = ActivationCheckpointing(units={Block}, memory_budget=0.6, levers=True)
    finder = BatchSizeFinder(mode="power", init_val=4, max_trials=2, steps_per_trial=1)
    module = Sized()
    trainer = _fit(module, tmp_path, [cb, finder], limit_train_batches=2)
    assert finder.optimal_batch_size == module.batch_size == 8 and measured == [8]
    assert module.steps == [(4, False), (8, False), (8, True), (8, True)] and trainer.global_step == 2
    assert cb.lever_plan is not None and cb.lever_plan.held and cb.lever_record["checkpointed"]


def test_bad_settings_are_refused_naming_the_fix():
    with pytest.raises(ValueError, match=r"`levers=True` chooses among the levers for a budget.*give one"):
        ActivationCheckpointing(levers=True)
    with pytest.raises(TypeError, match="`levers` must be a bool, got 'yes'"):
        ActivationCheckpointing(memory_budget=0.5, levers="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`levers=True` with `rebuild_bn_relu=True`"):
        ActivationCheckpointing(memory_budget=0.5, levers=True, rebuild_bn_relu=True)
    with pytest.raises(ValueError, match="`levers=True` with `bn_correct=False`"):
        CheckpointingSingleDeviceStrategy("cpu", memory_budget=0.5, levers=True, bn_correct=False)


def test_a_compiled_module_is_refused_in_setup(tmp_path):
    module = Blocks()
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=1))
    cb = ActivationCheckpointing(units={Block}, memory_budget=0.6, levers=True)
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[cb]))
    with pytest.raises(ValueError, match=r"levers=True\) on a compiled module: the levers' planner measures"):
        trainer.fit(torch.compile(module, backend="aot_eager"))  # type: ignore[arg-type]
    assert not _levers_on(module)["checkpointed"]


def test_a_sharded_model_on_several_devices_is_refused_in_setup():
    """ModelParallelStrategy's several ranks are not started on the CPU here: the callback's setup is called as the
    Trainer calls it."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    trainer = SimpleNamespace(strategy=ModelParallelStrategy(), world_size=2)
    with pytest.raises(ValueError, match="under ModelParallelStrategy on several devices: a sharded forward"):
        ActivationCheckpointing(memory_budget=0.5, levers=True).setup(trainer, Blocks(), "fit")  # type: ignore[arg-type]
    ActivationCheckpointing(memory_budget=0.5).setup(trainer, Blocks(), "fit")  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def levers_launch(tmp_path_factory):
    """One two-rank launch of tests/levers_ddp_run.py's scenarios (its own, apart from the suite's ``ddp_launch``)."""
    return ddp_scenarios(tmp_path_factory, "levers", ["levers_ddp_run:callback", "levers_ddp_run:strategy"], 600)


@pytest.mark.parametrize("scenario", ["callback", "strategy"])
def test_under_ddp_rank_zero_measures_and_every_rank_applies_its_record(levers_launch, scenario):
    results = ddp_scenario_results(levers_launch, f"levers_ddp_run:{scenario}", "levers{rank}.json")
    zero, one = results[0], results[1]
    assert zero["measured"] and not one["measured"]  # rank one measured nothing
    assert zero["record"] == one["record"] and zero["record"]["fused_loss"]
    for key in ("fused", "checkpointed", "pointwise"):
        assert zero[key] == one[key]
    assert zero["fused"] == ["model"] and (zero["checkpointed"] or zero["pointwise"])
    assert zero["step"] == one["step"] == 2 and zero["checksum"] == one["checksum"]
    assert zero["close_to_plain"] and one["close_to_plain"]


def test_under_ddp_spawn_rank_zero_measures_and_every_rank_applies_its_record(tmp_path):
    """tests/ddp_spawn_run.py ``levers``: each child gets the callback by pickling and plans at its fit start, rank
    zero measuring and rank 1 applying rank zero's record; the launching process gets rank zero's weights back, but
    not the record (Lightning brings back weights and metrics only: the same callback in a second fit measures
    again)."""
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["PYTHONWARNINGS"] = "ignore"
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ddp_spawn_run.py")
    try:
        done = subprocess.run(
            [sys.executable, script, str(tmp_path), "levers"], capture_output=True, text=True, timeout=240, env=env,
            cwd=tmp_path,
        )  # fmt: skip
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"the ddp_spawn run did not end within {err.timeout} s: a rank was left waiting")
    assert done.returncode == 0, done.stderr[-3000:]
    zero, one, launcher = (
        json.loads((tmp_path / f"{name}.json").read_text(encoding="utf-8"))
        for name in ("levers0", "levers1", "launcher")
    )
    assert zero["measured"] and not one["measured"]  # rank one measured nothing
    assert zero["record"] == one["record"] and zero["record"]["fused_loss"]
    for key in ("fused", "checkpointed", "pointwise"):
        assert zero[key] == one[key]
    assert zero["fused"] == ["model"] and (zero["checkpointed"] or zero["pointwise"])
    assert zero["step"] == one["step"] == 2 and zero["checksum"] == one["checksum"] == launcher["checksum"]
    assert launcher["record"] is None


@pytest.mark.parametrize("levers", [False, True], ids=["checkpointing", "levers"])
def test_rank_zero_failing_while_it_plans_raises_on_every_rank_instead_of_leaving_them_waiting(levers):
    # two ranks' calls, the broadcast between them kept by hand: rank zero's measurement fails (a batch the model
    # cannot take); it raises its own error, the other rank learns it from the broadcast it waits in
    from lightning_memguard.checkpointing.checkpointing_settings import CheckpointingSettings
    from lightning_memguard.checkpointing.policy import PlanningFailed

    sent = []

    def from_zero(obj):
        sent.append(obj)
        return obj

    def to_one(obj):
        assert obj is None  # rank one plans nothing
        return sent[0]

    def model():
        return nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(3)))

    settings = CheckpointingSettings([nn.Sequential], memory_budget=0.5, levers=levers)
    zero, one = lever_policy.make_policy(settings), lever_policy.make_policy(settings)
    models = model(), model()
    bad = torch.randn(4, 7)  # the first Linear takes 16 features
    with pytest.raises(Exception) as raised:  # noqa: PT011 (whatever the measurement raised)
        zero.apply(models[0], bad, is_rank_zero=True, broadcast=from_zero)
    said = f"{type(raised.value).__name__}: {raised.value}"
    with pytest.raises(PlanningFailed, match="rank zero failed planning what to checkpoint: ") as other:
        one.apply(models[1], bad, is_rank_zero=False, broadcast=to_one)
    assert str(other.value).endswith(said) and len(sent) == 1
    assert not zero.decided and not one.decided
    assert not any(is_checkpointed(m) for pair in models for m in pair.modules())  # both left as they were
