"""A memory budget for a model that trains under torch.compile: measured compiled, held compiled, with compile's own
``activation_memory_budget`` as one more lever. CPU: the ``aot_eager`` backend, whose compiled graphs save their
tensors through the saved-tensor hooks, so saved bytes are counted as in eager mode."""

from __future__ import annotations

import pytest
import torch
import torchvision
from conftest import planner_step_times, trainer_kwargs
from lightning.pytorch import Callback, LightningModule, Trainer
from models import small_resnet

from lightning_memguard import ActivationCheckpointing
from lightning_memguard.checkpointing import checkpoint_resnet, remove_checkpointing
from lightning_memguard.checkpointing.budget import BudgetSearch, CompileBudgetSearch, fastest_within


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _resnet(seed=0):
    torch.manual_seed(seed)
    return torchvision.models.resnet18(num_classes=10)


def saved_bytes(run, model, x):
    """Bytes of the tensors one forward and backward saves, besides parameters, buffers and the input."""
    held = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers(), x]}
    seen, total = set(), 0

    def pack(t):
        nonlocal total
        ptr = t.untyped_storage().data_ptr()
        if ptr not in held and ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run(x).sum().backward()
    model.zero_grad(set_to_none=True)
    return total


def test_budget_search_without_give_back_stops_at_the_first_fit():
    peaks = {(): 100, (0,): 80, (0, 1): 60}
    search = BudgetSearch({0}, values=[3.0, 2.0], budget=70, give_back=False)
    while (links := search.propose()) is not None:
        search.observe(peaks[tuple(sorted(links))])
    assert search.tried == [((0,), 80), ((0, 1), 60)] and search.result == ({0, 1}, 60)


def test_fastest_within_the_budget_else_the_lowest_peak():
    assert fastest_within([(90, 1.0), (60, 1.4), (55, 1.2)], budget=60) == 2
    assert fastest_within([(90, 1.0), (80, 1.4)], budget=60) == 1
    with pytest.raises(ValueError, match="no candidates"):
        fastest_within([], budget=1)


def _searched(measurements, budget, levels=(1.0, 0.8, 0.5), first=frozenset({0})):
    """Run a CompileBudgetSearch on a table ``{(setting, links): (peak, seconds)}``: what it measured, and its pick."""
    search = CompileBudgetSearch(levels, lambda peak, budget: set(first), [3.0, 2.0, 1.0], [30, 20, 10], budget)
    while (step := search.propose()) is not None:
        search.observe(*measurements[(step[0], tuple(sorted(step[1])))])
    tried = [(c.setting, tuple(sorted(c.links))) for c in search.tried]
    return tried, tried[search.result]


ALONE = {(0, ()): (100, 1.0), (1, ()): (70, 1.2), (2, ()): (60, 1.5)}


def test_the_compiled_search_measures_each_setting_alone_then_adds_links_to_the_fastest_first():
    table = {**ALONE, (0, (0, 1)): (55, 1.25), (1, (0, 1)): (50, 1.3)}
    tried, pick = _searched(table, budget=65, first={0, 1})
    # compile's default fits with two links (1.25 s); 0.8 alone is faster than that, but it needs links to fit, and
    # the same links under a lower setting cannot be faster than the fit: not measured
    assert tried == [(0, ()), (1, ()), (2, ()), (0, (0, 1))]
    assert pick == (0, (0, 1))
    table[(0, (0,))] = (72, 1.1)  # one link predicted: the default needs two after all, and 0.8 with one is tried
    tried, pick = _searched({**table, (1, (0,)): (60, 1.22)}, budget=65)
    assert tried == [(0, ()), (1, ()), (2, ()), (0, (0,)), (0, (0, 1)), (1, (0,))]
    assert pick == (1, (0,))


def test_the_compiled_search_leaves_a_setting_no_faster_alone_than_a_fit():
    table = {**ALONE, (1, ()): (70, 1.6), (0, (0,)): (80, 1.55)}
    tried, pick = _searched(table, budget=65)
    # 0.5 fits alone at 1.5 s; the default (1.0 s alone) is tried with a link and left at 1.55 s; 0.8 alone already
    # takes 1.6 s: links would only slow it down, so it gets none
    assert tried == [(0, ()), (1, ()), (2, ()), (0, (0,))]
    assert pick == (2, ())


def test_the_compiled_search_tries_the_setting_fastest_alone_first_and_its_budget_is_of_the_defaults_peak():
    levels = (1.0, 0.5, 0.8)  # setting 2 (0.8) is faster alone than setting 1 (0.5)
    table = {(0, ()): (100, 1.0), (1, ()): (60, 1.5), (2, ()): (70, 1.2), (0, (0,)): (35, 1.1), (2, (0,)): (38, 1.3)}
    tried, pick = _searched(table, budget=lambda peak: peak * 2 // 5, levels=levels)  # 40 % of 100
    assert tried == [(0, ()), (1, ()), (2, ()), (0, (0,))]  # 0.8 then 0.5 would come next: both slower alone
    assert pick == (0, (0,))
    table[(0, (0,))] = (45, 1.1)  # the default does not fit with its link (and has no more): 0.8, then 0.5
    table.update({(0, (0, 1)): (42, 1.2), (0, (0, 1, 2)): (41, 1.25)})
    tried, pick = _searched(table, budget=lambda peak: peak * 2 // 5, levels=levels)
    # 0.8 fits with one link at 1.3 s; 0.5, at 1.5 s alone, is left
    assert tried == [(0, ()), (1, ()), (2, ()), (0, (0,)), (0, (0, 1)), (0, (0, 1, 2)), (2, (0,))]
    assert pick == (2, (0,))


def test_the_compiled_search_takes_a_budget_in_any_whole_form_and_adds_links_where_none_was_predicted():
    table = {**ALONE, (0, (0, 1)): (60, 1.3), (1, (0,)): (62, 1.35)}
    tried, pick = _searched(table, budget=65.0, first=frozenset())  # none predicted: each gap decides (35, 5)
    assert tried == [(0, ()), (1, ()), (2, ()), (0, (0, 1)), (1, (0,))] and pick == (0, (0, 1))


def test_the_compiled_search_stops_adding_links_once_a_setting_is_slower_than_a_fit():
    table = {**ALONE, (0, (0,)): (80, 1.6), (1, (0,)): (62, 1.3)}
    tried, pick = _searched(table, budget=65)
    # 0.5 alone fits at 1.5 s; default + link 0 does not fit and is already slower: no second link for it
    assert tried == [(0, ()), (1, ()), (2, ()), (0, (0,)), (1, (0,))]
    assert pick == (1, (0,))


def test_the_compiled_search_keeps_the_lowest_peak_when_nothing_fits_and_measures_no_set_twice():
    table = {**ALONE, (2, ()): (65, 1.5), (0, (0,)): (90, 1.1), (0, (0, 1)): (85, 1.2), (0, (0, 1, 2)): (80, 1.3)}
    table.update({(1, (0,)): (66, 1.3), (1, (0, 1)): (64, 1.4), (1, (0, 1, 2)): (63, 1.5)})
    table.update({(2, (0,)): (62, 1.6), (2, (0, 1)): (61, 1.7), (2, (0, 1, 2)): (61, 1.8)})
    search = CompileBudgetSearch([1.0, 0.8, 0.5], lambda p, b: {0}, [3.0, 2.0, 1.0], [1, 1, 1], budget=lambda b: 40)
    while (step := search.propose()) is not None:
        search.observe(*table[(step[0], tuple(sorted(step[1])))])
    tried = [(c.setting, tuple(sorted(c.links))) for c in search.tried]
    # each setting gets links while none fits, as many at once as the gap needs; no set is measured twice (at the
    # end the search would propose a setting's lowest set again)
    assert search.budget == 40
    assert tried == [(0, ()), (1, ()), (2, ()), *[(s, links) for s in range(3) for links in ((0,), (0, 1, 2))]]
    assert tried[search.result] == (2, (0, 1, 2))  # the lowest peak
    with pytest.raises(RuntimeError, match="after the search ended"):
        search.observe(1, 1.0)


@pytest.fixture(scope="module")
def compiled_plain():
    """The bytes the plain model saves compiled, for a batch of 4 64x64 images (the same for each case below)."""
    torch._dynamo.reset()
    twin = small_resnet()
    saved = saved_bytes(torch.compile(twin, backend="aot_eager"), twin, torch.randn(4, 3, 64, 64))
    torch._dynamo.reset()
    return saved


@pytest.mark.parametrize(("form", "budget"), [("compiled model", 0.6), ("compile=True", 0.6), ("compile=True", 0.3)])
def test_a_budget_is_measured_and_held_under_compile(form, budget, compiled_plain):
    model = small_resnet()
    x = torch.randn(4, 3, 64, 64)
    buffers = {k: v.clone() for k, v in model.state_dict().items()}
    setting_before = torch._functorch.config.activation_memory_budget
    if form == "compiled model":
        plan = checkpoint_resnet(torch.compile(model, backend="aot_eager"), memory_budget=budget, example_input=x)
    else:
        plan = checkpoint_resnet(model, memory_budget=budget, example_input=x, compile={"backend": "aot_eager"})
    assert plan.compiled and plan.baseline_bytes == compiled_plain  # the budget is of the compiled model's peak
    assert plan.budget_bytes == int(budget * compiled_plain) and plan.held
    # each setting measured alone first; compile's own settings save about half here: 0.6 is met by them alone,
    # 0.3 needs blocks
    candidates = plan.compile_candidates
    assert [(c["activation_memory_budget"], c["runs"]) for c in candidates[:3]] == [(None, []), (0.8, []), (0.5, [])]
    fit = [c for c in candidates if c["peak_bytes"] <= plan.budget_bytes]
    assert [c["activation_memory_budget"] for c in fit if not c["runs"]] == ([0.8, 0.5] if budget == 0.6 else [])
    assert fit and plan.measured_bytes in [c["peak_bytes"] for c in fit]
    fastest = min(c["step_ms"] for c in fit)  # the pick: the fastest that fits (or its twin in one graph)
    assert any(
        (c["step_ms"], c["activation_memory_budget"], c["runs"]) == (fastest, plan.activation_memory_budget, plan.runs)
        for c in fit
    )
    assert torch._functorch.config.activation_memory_budget == setting_before  # restored after planning
    assert all(torch.equal(v, buffers[k]) for k, v in model.state_dict().items())  # planning changed no state
    # trained the way the plan says, compiled afresh: the budget holds
    torch._dynamo.reset()
    with plan.compiling():
        assert saved_bytes(torch.compile(model, backend="aot_eager"), model, x) <= plan.budget_bytes
    # the plan names what it checkpointed, run by run; 0.3 is met only with blocks
    assert plan.blocks == [name for run in plan.runs for name in run]
    assert plan.blocks or budget == 0.6
    assert remove_checkpointing(model) == len(plan.runs)  # one checkpoint per run, as planned


def test_a_setting_equal_to_compiles_default_in_force_is_measured_once():
    model = small_resnet()
    x = torch.randn(4, 3, 64, 64)
    with torch._functorch.config.patch(activation_memory_budget=0.8):  # the user's own setting, in force
        plan = checkpoint_resnet(
            model, memory_budget=0.6, example_input=x, compile={"backend": "aot_eager"}, compile_settings=(0.8, 0.5)
        )
    assert [c["activation_memory_budget"] for c in plan.compile_candidates if not c["runs"]] == [None, 0.5]


def test_with_no_compile_settings_only_compiles_default_is_tried_and_none_is_chosen():
    # what MemGuard's adapt asks for a compiled model mid-run: it holds no setting for the rest of the run
    model = small_resnet()
    x = torch.randn(4, 3, 64, 64)
    plan = checkpoint_resnet(
        model, memory_budget=0.6, example_input=x, compile={"backend": "aot_eager"}, compile_settings=()
    )
    assert plan.compiled and plan.activation_memory_budget is None
    assert {c["activation_memory_budget"] for c in plan.compile_candidates} == {None}


def test_an_eager_plan_is_still_made_in_eager_mode():
    model = _resnet()
    x = torch.randn(4, 3, 64, 64)
    plan = checkpoint_resnet(model, memory_budget=0.6, example_input=x)
    assert not plan.compiled and plan.activation_memory_budget is None and plan.compile_candidates == []


def test_compile_arguments_are_checked():
    x = torch.randn(2, 3, 32, 32)
    with pytest.raises(TypeError, match="`compile` must be"):
        checkpoint_resnet(_resnet(), memory_budget=0.6, example_input=x, compile="yes")


class Net(LightningModule):
    def __init__(self):
        super().__init__()
        self.net = small_resnet()
        self.example_input_array = torch.randn(4, 3, 64, 64)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return self(batch[0]).float().sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 3, 64, 64)), batch_size=4)


class _Saved(Callback):
    """Counts the bytes one training step saves for backward (parameters, buffers and the batch aside)."""

    def __init__(self):
        self.steps = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        held = {t.untyped_storage().data_ptr() for t in [*pl_module.parameters(), *pl_module.buffers(), *batch]}
        seen, self.total = set(), 0

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in held and ptr not in seen:
                seen.add(ptr)
                self.total += t.untyped_storage().nbytes()
            return t

        self.hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self.hooks.__enter__()
        self.setting = torch._functorch.config.activation_memory_budget

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.hooks.__exit__(None, None, None)
        self.steps.append((self.total, self.setting))


def _choose_compiles_half_setting(monkeypatch):
    """Timing on this CPU decides nothing: compile's setting 0.5 is the fastest, alone and with blocks."""
    planner_step_times(monkeypatch, lambda setting, blocks, split: (0.05 if setting == 0.5 else 0.2) + blocks * 1e-3)


def test_the_callback_holds_its_budget_on_a_compiled_module(tmp_path, monkeypatch):
    _choose_compiles_half_setting(monkeypatch)
    saved = _Saved()
    checkpointing = ActivationCheckpointing(memory_budget=0.3)
    before = torch._functorch.config.activation_memory_budget
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[checkpointing, saved]))
    trainer.fit(torch.compile(Net(), backend="aot_eager"))
    plan = checkpointing.plan
    assert plan.compiled and plan.held and plan.blocks
    setting = plan.activation_memory_budget
    assert setting == 0.5 and [s for _, s in saved.steps] == [0.5, 0.5]  # set for the fit
    assert all(total <= plan.budget_bytes for total, _ in saved.steps)  # held in training, compiled
    assert torch._functorch.config.activation_memory_budget == before  # and restored after it
    assert checkpointing.state_dict()["compile_setting"] == setting


def test_the_strategy_sets_compiles_setting_for_the_fit(tmp_path, monkeypatch):
    _choose_compiles_half_setting(monkeypatch)
    from lightning_memguard.strategies import CheckpointingSingleDeviceStrategy

    saved = _Saved()
    strategy = CheckpointingSingleDeviceStrategy("cpu", memory_budget=0.3)
    before = torch._functorch.config.activation_memory_budget
    kwargs = {k: v for k, v in trainer_kwargs(tmp_path, max_epochs=1).items() if k not in ("accelerator", "devices")}
    trainer = Trainer(strategy=strategy, callbacks=[saved], **kwargs)
    trainer.fit(torch.compile(Net(), backend="aot_eager"))
    plan = strategy.checkpointing.plan
    assert plan.compiled and plan.held
    setting = strategy.checkpointing.compile_setting
    assert setting == plan.activation_memory_budget == 0.5
    assert [s for _, s in saved.steps] == [0.5, 0.5]
    assert all(total <= plan.budget_bytes for total, _ in saved.steps)
    assert torch._functorch.config.activation_memory_budget == before


def test_budget_search_with_savings_adds_what_the_gap_needs_scaled_by_what_was_freed():
    # each link is predicted to free 10; the first added set freed half of its prediction
    values, savings = [5.0, 4.0, 3.0, 2.0, 1.0, 0.5], [10] * 6
    search = BudgetSearch(set(), values, budget=80, give_back=False, savings=savings)
    assert search.propose() == set()
    search.observe(100)  # 20 over, 10 predicted per link, nothing measured to scale by yet: two links at once
    assert search.propose() == {0, 1}
    search.observe(90)  # they freed 10 of the 20 predicted: scale 0.5, 10 over: two more (20 * 0.5 = 10)
    assert search.propose() == {0, 1, 2, 3}
    search.observe(80)
    assert search.propose() is None and search.result == ({0, 1, 2, 3}, 80)
    assert [len(s) for s, _ in search.tried] == [0, 2, 4]  # three measurements where one at a time took five


def test_a_resumed_compiled_run_reapplies_the_runs_and_compiles_setting_without_measuring(tmp_path, monkeypatch):
    _choose_compiles_half_setting(monkeypatch)
    first = ActivationCheckpointing(memory_budget=0.3)
    kwargs = trainer_kwargs(tmp_path, max_epochs=1, enable_checkpointing=True)
    trainer = Trainer(**{**kwargs, "callbacks": [first]})
    trainer.fit(torch.compile(Net(), backend="aot_eager"))
    ckpt = trainer.checkpoint_callback.best_model_path
    assert first.policy.compile_setting == 0.5 and first.runs

    torch._dynamo.reset()
    measured = []
    from lightning_memguard.checkpointing import entrances as plan_module

    monkeypatch.setattr(plan_module, "plan_compiled", lambda *a, **k: measured.append(1))
    resumed, saved = ActivationCheckpointing(memory_budget=0.3), _Saved()
    trainer = Trainer(**{**trainer_kwargs(tmp_path, max_epochs=2), "callbacks": [resumed, saved]})
    trainer.fit(torch.compile(Net(), backend="aot_eager"), ckpt_path=ckpt)
    assert measured == [] and resumed.runs == first.runs  # re-applied from the checkpoint, nothing measured
    assert [s for _, s in saved.steps] == [0.5, 0.5]  # and compile's setting set again for the resumed fit


def test_the_same_callback_in_a_second_fit_under_compile_reapplies_its_plan_without_measuring(tmp_path, monkeypatch):
    """A reused callback on a fresh compiled module: its runs and compile's setting again, held in every step of the
    second fit too, and nothing measured."""
    _choose_compiles_half_setting(monkeypatch)
    checkpointing = ActivationCheckpointing(memory_budget=0.3)
    before = torch._functorch.config.activation_memory_budget
    Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[checkpointing])).fit(
        torch.compile(Net(), backend="aot_eager")
    )
    runs, budget_bytes = checkpointing.runs, checkpointing.plan.budget_bytes

    torch._dynamo.reset()
    measured = []
    from lightning_memguard.checkpointing import entrances as plan_module

    monkeypatch.setattr(plan_module, "plan_compiled", lambda *a, **k: measured.append(1))
    saved, second = _Saved(), Net()
    Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[checkpointing, saved])).fit(
        torch.compile(second, backend="aot_eager")
    )
    assert measured == [] and checkpointing.runs == runs
    assert [s for _, s in saved.steps] == [0.5, 0.5]
    assert all(total <= budget_bytes for total, _ in saved.steps)  # the fresh module is checkpointed as the first
    assert torch._functorch.config.activation_memory_budget == before
