"""Activation checkpointing: exact gradients and BatchNorm buffers, unchanged state_dict keys, budgets."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torchvision
from conftest import fused_calls, trainer_kwargs
from lightning.pytorch import Trainer
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

from lightning_memguard import ActivationCheckpointing, checkpoint_resnet
from lightning_memguard.checkpointing import (
    apply_plan,
    checkpoint_blocks,
    find_units,
    is_checkpointed,
    rebuild_bn_relu,
    remove_checkpointing,
    remove_rebuild,
)
from lightning_memguard.checkpointing.model_map import model_chain
from lightning_memguard.checkpointing.rebuild import RebuiltBatchNormReLU, RebuiltStemReLU
from lightning_memguard.checkpointing.surgery import link_outputs
from lightning_memguard.checkpointing.wrap import preserved_state
from lightning_memguard.testing import ImageClassifier


def _train(model: nn.Module, steps: int = 3, forward=None) -> dict[str, torch.Tensor]:
    """A few SGD steps on fixed random batches; returns gradients of the last step and all buffers."""
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batches = [(torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))) for _ in range(steps)]
    model.train()
    for x, y in batches:
        opt.zero_grad()
        out = forward(x) if forward is not None else model(x)
        nn.functional.cross_entropy(out, y).backward()
        opt.step()
    state = {f"grad:{n}": p.grad.clone() for n, p in model.named_parameters()}
    state.update({f"buf:{n}": b.clone() for n, b in model.named_buffers()})
    return state


def _rebuilt_links(model: nn.Module) -> list[str]:
    """Blocks and stems (named as the planner names them) that rebuild BatchNorm + ReLU outputs."""
    names = [n for n, m in model.named_modules() if isinstance(m, RebuiltBatchNormReLU)]
    names += [n.removesuffix("relu") + "stem" for n, m in model.named_modules() if isinstance(m, RebuiltStemReLU)]
    return sorted(names)


def _identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("arch", ["resnet18", "resnext50_32x4d"])
def test_gradients_and_batchnorm_buffers_are_bit_identical(arch):
    torch.manual_seed(1)
    plain = torchvision.models.get_model(arch, num_classes=10)
    ours = copy.deepcopy(plain)
    plan = checkpoint_resnet(ours)
    assert len(plan.blocks) == plan.candidates > 0
    assert _identical(_train(plain), _train(ours))


def test_plain_checkpoint_sequential_fails_the_same_test():
    torch.manual_seed(1)
    plain = torchvision.models.resnet18(num_classes=10)
    theirs = copy.deepcopy(plain)
    body = nn.Sequential(theirs.layer1, theirs.layer2, theirs.layer3, theirs.layer4)

    def forward(x):
        x = theirs.maxpool(theirs.relu(theirs.bn1(theirs.conv1(x))))
        x = checkpoint_sequential(body, 4, x, use_reentrant=False)
        return theirs.fc(torch.flatten(theirs.avgpool(x), 1))

    a, b = _train(plain), _train(theirs, forward=forward)
    assert not _identical(a, b)
    # the recomputed forward counts every batch twice
    assert int(b["buf:layer1.0.bn1.num_batches_tracked"]) == 2 * int(a["buf:layer1.0.bn1.num_batches_tracked"])


def test_without_bn_correction_buffers_drift():
    torch.manual_seed(1)
    plain = torchvision.models.resnet18(num_classes=10)
    ours = copy.deepcopy(plain)
    checkpoint_resnet(ours, bn_correct=False)
    assert not _identical(_train(plain), _train(ours))


def test_blocks_without_batchnorm_are_checkpointed_as_plainly_as_the_familys_own_switch(monkeypatch):
    """BatchNorm-correctness costs a model without BatchNorm nothing: no context around the recomputation, the same
    call a family's own switch makes (non-reentrant, RNG state preserved); a block with BatchNorm gets the freeze."""
    from lightning_memguard.checkpointing import wrap

    calls = []

    def spy(function, *args, **kwargs):
        calls.append(sorted(kwargs))
        return torch.utils.checkpoint.checkpoint(function, *args, **kwargs)

    monkeypatch.setattr(wrap, "checkpoint", spy)

    class Block(nn.Module):
        def __init__(self, norm: nn.Module) -> None:
            super().__init__()
            self.conv, self.norm = nn.Conv2d(4, 4, 3, padding=1), norm

        def forward(self, x):
            return x + self.norm(self.conv(x)).relu()

    for norm, expected in [
        (nn.GroupNorm(1, 4), ["use_reentrant"]),
        (nn.BatchNorm2d(4), ["context_fn", "use_reentrant"]),
    ]:
        torch.manual_seed(0)
        plain = nn.Sequential(Block(norm), Block(copy.deepcopy(norm)))
        ours = copy.deepcopy(plain)
        checkpoint_blocks(ours, {Block})
        calls.clear()
        x = torch.randn(2, 4, 8, 8, requires_grad=True)
        ours(x).sum().backward()
        plain(x).sum().backward()
        assert calls == [expected, expected]
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), ours.parameters(), strict=True))
        assert all(torch.equal(a, b) for a, b in zip(plain.buffers(), ours.buffers(), strict=True))


def test_state_dict_keys_unchanged_and_round_trip():
    plain = torchvision.models.resnet18(num_classes=10)
    ours = torchvision.models.resnet18(num_classes=10)
    checkpoint_resnet(ours)
    assert list(ours.state_dict()) == list(plain.state_dict())
    plain.load_state_dict(ours.state_dict())
    ours.load_state_dict(plain.state_dict())
    x = torch.randn(2, 3, 32, 32)
    plain.eval(), ours.eval()
    torch.testing.assert_close(plain(x), ours(x), rtol=0, atol=0)


def test_deepcopy_and_removal():
    model = torchvision.models.resnet18(num_classes=10)
    checkpoint_resnet(model)
    twin = copy.deepcopy(model)
    assert all(is_checkpointed(m) for _, m in find_units(twin))
    assert remove_checkpointing(twin) == 9  # the stem and eight blocks
    assert not any(is_checkpointed(m) for m in twin.modules())
    assert type(twin.layer1[0]) is torchvision.models.resnet.BasicBlock


def test_applying_twice_warns_and_changes_nothing():
    model = torchvision.models.resnet18(num_classes=10)
    checkpoint_resnet(model)
    with pytest.warns(UserWarning, match="already checkpointed.*applying twice changes nothing"):
        plan = checkpoint_resnet(model)
    assert plan.blocks == []
    assert type(model.layer1[0]).__mro__.count(type(model.layer1[0]).__mro__[1]) == 1  # not wrapped twice


def test_someone_elses_wrapper_is_left_alone():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = torchvision.models.resnet18(num_classes=10)
    model.layer1[0] = checkpoint_wrapper(model.layer1[0])
    with pytest.warns(UserWarning, match="already wrapped by other code \\(layer1.0"):
        plan = checkpoint_blocks(model)
    assert "layer1.0" not in plan.blocks and len(plan.blocks) == 8
    assert not any(is_checkpointed(m) for m in model.layer1[0].modules())


def test_errors():
    with pytest.raises(ValueError, match="no blocks to checkpoint found in Sequential"):
        checkpoint_blocks(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    with pytest.raises(TypeError, match="checkpoint_resnet needs a torchvision ResNet, got Sequential"):
        checkpoint_resnet(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(ValueError, match="`memory_budget` needs `example_input`"):
        checkpoint_resnet(torchvision.models.resnet18(), memory_budget=0.5)
    with pytest.raises(ValueError, match="`memory_budget` as a fraction must be in \\(0, 1\\], got 1.5"):
        checkpoint_resnet(torchvision.models.resnet18(), memory_budget=1.5, example_input=torch.randn(1, 3, 32, 32))
    with pytest.raises(TypeError, match="`units` must be 'auto', module classes or names, or a callable .*, got 42"):
        checkpoint_blocks(torchvision.models.resnet18(), units=42)
    with pytest.raises(TypeError, match="`units` must be 'auto', module classes or names, or a callable .*, got None"):
        checkpoint_blocks(torchvision.models.resnet18(), units=None)
    with pytest.raises(ValueError, match="`units` must name at least one module class or module name, got set\\(\\)"):
        checkpoint_blocks(torchvision.models.resnet18(), units=set())
    with pytest.raises(TypeError, match=r"`units` must hold nn.Module subclasses or module names .*, got \[3\]"):
        checkpoint_blocks(torchvision.models.resnet18(), units=[3])
    with pytest.raises(ValueError, match="`units` must be 'auto'.*'everything'"):
        checkpoint_blocks(torchvision.models.resnet18(), units="everything")


def test_units_by_class_and_by_name():
    model = torchvision.models.resnet18(num_classes=10)
    plan = checkpoint_blocks(model, units=lambda name, m: name in ("layer3", "layer4"))
    assert plan.blocks == ["layer3", "layer4"]
    model = torchvision.models.resnet18(num_classes=10)
    assert checkpoint_blocks(model, units={torchvision.models.resnet.BasicBlock}).candidates == 9  # and the stem
    for units in (torchvision.models.resnet.BasicBlock, [torchvision.models.resnet.BasicBlock]):  # a class, a list
        model = torchvision.models.resnet18(num_classes=10)
        assert checkpoint_blocks(model, units=units).candidates == 9


@pytest.mark.parametrize("budget", [0.8, 0.7, 0.6])
def test_budget_holds_and_uses_fewer_blocks_when_it_can(budget):
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    before = {n: b.clone() for n, b in model.named_buffers()}
    plan = checkpoint_resnet(model, memory_budget=budget, example_input=torch.randn(8, 3, 64, 64))
    assert plan.held, plan.summary()
    assert plan.measured_bytes <= plan.budget_bytes == int(plan.baseline_bytes * budget)
    assert 0 < len(plan.blocks) <= plan.candidates
    assert len(plan.profiles) == 9 and all(p.saved_bytes > 0 for p in plan.profiles)
    # profiling left no trace on BatchNorm statistics or gradients
    assert all(torch.equal(before[n], b) for n, b in model.named_buffers())
    assert all(p.grad is None for p in model.parameters())


def test_loose_budget_checkpoints_less_than_tight_budget():
    x = torch.randn(8, 3, 64, 64)
    loose = checkpoint_resnet(torchvision.models.resnet18(num_classes=10), memory_budget=0.9, example_input=x)
    tight = checkpoint_resnet(torchvision.models.resnet18(num_classes=10), memory_budget=0.5, example_input=x)
    assert len(loose.blocks) < len(tight.blocks)


def test_budget_in_bytes_that_cannot_be_met_warns():
    with pytest.warns(UserWarning, match="memory budget not met"):
        plan = checkpoint_resnet(
            torchvision.models.resnet18(), memory_budget="1MB", example_input=torch.randn(16, 3, 64, 64)
        )
    assert plan.held is False and len(plan.blocks) == 9


class ExampleClassifier(ImageClassifier):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.example_input_array = torch.randn(4, 3, 32, 32)


def test_callback_checkpoints_before_training_and_resumes_the_same_blocks(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cb = ActivationCheckpointing(memory_budget=0.6)
        model = ExampleClassifier(image_size=32, batch_size=4, steps_per_epoch=3)
        trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=1, enable_checkpointing=True, callbacks=[cb]))
        trainer.fit(model)
    assert cb.plan is not None and cb.plan.held and cb.blocks
    checkpointed = sorted(n for n, m in model.named_modules() if is_checkpointed(m))
    assert checkpointed
    ckpt = trainer.checkpoint_callback.best_model_path

    resumed_cb = ActivationCheckpointing(memory_budget=0.6)
    model2 = ExampleClassifier(image_size=32, batch_size=4, steps_per_epoch=3)
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=2, callbacks=[resumed_cb]))
    trainer.fit(model2, ckpt_path=ckpt)
    assert resumed_cb.plan is None  # nothing measured again
    assert resumed_cb.runs == cb.runs
    assert sorted(n for n, m in model2.named_modules() if is_checkpointed(m)) == checkpointed


@pytest.mark.parametrize("run", ["second fit", "fast_dev_run", "loader passed to fit"])
def test_callback_with_a_budget_in_the_runs_users_make(tmp_path, run):
    """The same callback in a second fit re-applies its runs to the fresh model without measuring; under
    fast_dev_run and with a loader passed to fit the plan is measured on the example input as ever."""
    cb = ActivationCheckpointing(memory_budget=0.6)
    model = ExampleClassifier(image_size=32, batch_size=4, steps_per_epoch=3)
    kwargs = {"fast_dev_run": True} if run == "fast_dev_run" else {"max_epochs": 1}
    trainer = Trainer(**trainer_kwargs(tmp_path, callbacks=[cb], **kwargs))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if run == "loader passed to fit":
            trainer.fit(model, train_dataloaders=model.train_dataloader())
        else:
            trainer.fit(model)
    assert cb.plan is not None and cb.plan.held and cb.runs and trainer.global_step >= 1
    checkpointed = sorted(n for n, m in model.named_modules() if is_checkpointed(m))
    assert checkpointed
    if run != "second fit":
        return
    first_plan = cb.plan
    second = ExampleClassifier(image_size=32, batch_size=4, steps_per_epoch=3)
    Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[cb])).fit(second)
    assert cb.plan is first_plan  # not planned again
    assert sorted(n for n, m in second.named_modules() if is_checkpointed(m)) == checkpointed


def test_callback_without_budget_checkpoints_every_block(tmp_path):
    cb = ActivationCheckpointing()
    model = ImageClassifier(image_size=32, batch_size=4, steps_per_epoch=2)
    Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[cb])).fit(model)
    assert len(cb.blocks) == 9 and cb.blocks[0] == "net.stem"


class BuiltInConfigureModel(ImageClassifier):
    """A module whose layers exist only once Lightning has called ``configure_model`` (as large models do)."""

    def __init__(self) -> None:
        super().__init__(image_size=32, batch_size=4, steps_per_epoch=2)
        self.__dict__["later"] = self.net  # not a submodule: nothing to find before configure_model
        self.net = None
        self.configured = 0

    def configure_model(self) -> None:
        self.configured += 1
        if self.net is None:
            self.net = self.__dict__.pop("later")


def test_callback_without_budget_checkpoints_what_configure_model_builds(tmp_path):
    cb = ActivationCheckpointing()
    model = BuiltInConfigureModel()
    Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[cb])).fit(model)
    assert model.configured == 1 and len(cb.blocks) == 9 and cb.blocks[0] == "net.stem"
    assert is_checkpointed(model.net.layer1[0]) and "configure_model" not in vars(model)  # the hook given back
    Trainer(**trainer_kwargs(tmp_path, max_epochs=2, callbacks=[cb])).fit(model)  # a second fit: applied once
    assert model.configured == 2 and len(cb.blocks) == 9 and "configure_model" not in vars(model)


def test_callback_beside_fsdps_own_checkpointing_is_refused_with_the_choice():
    """FSDPStrategy needs a GPU in Lightning, so the callback's setup is called as the Trainer calls it."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import FSDPStrategy

    model = ImageClassifier(image_size=32, batch_size=4, steps_per_epoch=2)
    trainer = SimpleNamespace(
        strategy=FSDPStrategy(activation_checkpointing_policy={torchvision.models.resnet.BasicBlock})
    )
    with pytest.raises(ValueError, match="would checkpoint the same blocks twice; use one"):
        ActivationCheckpointing().setup(trainer, model, "fit")
    assert not any(is_checkpointed(m) for m in model.modules())
    cb = ActivationCheckpointing()
    cb.setup(SimpleNamespace(strategy=FSDPStrategy()), model, "fit")  # FSDP without its own policy: ours applies
    assert len(cb.blocks) == 9


def test_callback_errors(tmp_path):
    with pytest.raises(ValueError, match="`memory_budget` as a fraction must be in \\(0, 1\\], got 0.0"):
        ActivationCheckpointing(memory_budget=0.0)
    with pytest.raises(ValueError, match="`memory_budget` must be .*'lots'"):
        ActivationCheckpointing(memory_budget="lots")
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[ActivationCheckpointing(memory_budget=0.5)]))
    with pytest.raises(ValueError, match="measures the blocks on the module's `example_input_array`"):
        trainer.fit(ImageClassifier(image_size=32, batch_size=4, steps_per_epoch=2))


def test_budget_mode_on_a_checkpointed_model_is_a_noop_with_warning():
    model = torchvision.models.resnet18(num_classes=10)
    checkpoint_resnet(model)
    with pytest.warns(UserWarning, match="already checkpointed; applying twice changes nothing"):
        plan = checkpoint_resnet(model, memory_budget=0.7, example_input=torch.randn(2, 3, 32, 32))
    assert plan.blocks == [] and sum(is_checkpointed(m) for m in model.modules()) == 8 + 4  # blocks, stem modules


def test_blocks_are_given_back_while_the_measured_peak_still_fits(monkeypatch):
    """A cautious prediction must not cost throughput: the plan keeps only blocks the budget needs."""
    import lightning_memguard.checkpointing.plan_eager as plan_mod

    # the most cautious planner possible: it picks every block
    def every_link(profiles, baseline, budget, joinable, gradients, parts=()):
        return set(range(len(profiles))), [], baseline

    monkeypatch.setattr(plan_mod, "choose_blocks", every_link)
    x = torch.randn(8, 3, 64, 64)
    plan = checkpoint_resnet(torchvision.models.resnet18(num_classes=10), memory_budget=0.9, example_input=x)
    assert plan.held and 0 < len(plan.blocks) < 9


RUNS = [["stem"], ["layer1.0", "layer1.1"], ["layer3.0", "layer3.1"], ["layer4.1"]]


@pytest.mark.parametrize("arch", ["resnet18", "resnext50_32x4d"])
def test_runs_of_blocks_are_bit_identical_too(arch):
    torch.manual_seed(1)
    plain = torchvision.models.get_model(arch, num_classes=10)
    ours = copy.deepcopy(plain)
    runs = RUNS if arch == "resnet18" else [["stem"], ["layer1.0", "layer1.1", "layer1.2"], ["layer4.1", "layer4.2"]]
    assert apply_plan(ours, runs, units={torchvision.models.resnet.BasicBlock, torchvision.models.resnet.Bottleneck})
    assert type(ours.bn1).__name__ == "RunMemberBatchNorm2d"  # done by the run's head, conv1
    assert _identical(_train(plain), _train(ours))
    assert list(ours.state_dict()) == list(plain.state_dict())
    plain.eval(), ours.eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(plain(x), ours(x), rtol=0, atol=0)


def test_a_copied_run_points_at_the_copys_modules():
    import io

    model = torchvision.models.resnet18(num_classes=10)
    apply_plan(model, RUNS)
    model(torch.randn(2, 3, 32, 32))  # runs remember their last output: copies and pickles must not carry it
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded.conv1.memguard_run[0] is loaded.bn1
    twin = copy.deepcopy(model)
    assert twin.conv1.memguard_run[0] is twin.bn1 and twin.layer3[0].memguard_run[0] is twin.layer3[1]
    x = torch.randn(2, 3, 32, 32)
    model.eval(), twin.eval(), loaded.eval()
    torch.testing.assert_close(model(x), twin(x), rtol=0, atol=0)
    torch.testing.assert_close(model(x), loaded(x), rtol=0, atol=0)
    assert remove_checkpointing(twin) == 4  # one checkpoint per run
    assert not any(is_checkpointed(m) for m in twin.modules()) and "memguard_run" not in vars(twin.conv1)


def test_which_blocks_may_share_a_run():
    model = torchvision.models.resnet18(num_classes=10)
    links, joinable = model_chain(model, find_units(model))
    assert [link.name for link in links][:3] == ["stem", "layer1.0", "layer1.1"]
    # blocks of one stage may join: a stage's output, which feature extractors read, stays its own
    assert joinable == [False, True, False, True, False, True, False, True]

    class OwnForward(torchvision.models.ResNet):  # a forward of its own: only siblings in a Sequential may join
        def forward(self, x):
            return super().forward(x)

    own = OwnForward(torchvision.models.resnet.BasicBlock, [2, 2, 2, 2], num_classes=10)
    links, joinable = model_chain(own, find_units(own))
    assert links[0].name == "layer1.0" and joinable == [True, False, True, False, True, False, True]  # no stem
    with pytest.raises(ValueError, match="'layer1.1' and 'layer2.0' cannot share a run"):
        apply_plan(torchvision.models.resnet18(), [["layer1.1", "layer2.0"]])
    with pytest.raises(ValueError, match="no block named 'layer9.0'"):
        apply_plan(torchvision.models.resnet18(), [["layer9.0"]])


def test_stage_outputs_and_blocks_called_alone_are_unchanged_by_runs():
    torch.manual_seed(0)
    plain = torchvision.models.resnet18(num_classes=10).eval()
    ours = copy.deepcopy(plain)
    apply_plan(ours, [["stem"], ["layer1.0", "layer1.1"], ["layer2.0", "layer2.1"]])
    seen = {}
    for name, model in (("plain", plain), ("ours", ours)):
        model.layer1.register_forward_hook(lambda m, i, o, name=name: seen.__setitem__(name, o))
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(plain(x), ours(x), rtol=0, atol=0)
        torch.testing.assert_close(seen["plain"], seen["ours"], rtol=0, atol=0)  # what an FPN would read
        h = torch.randn(2, 64, 16, 16)
        torch.testing.assert_close(plain.layer1[1](h), ours.layer1[1](h), rtol=0, atol=0)  # a run member alone


def test_a_tight_budget_joins_blocks_into_runs(monkeypatch):
    from dataclasses import replace

    from lightning_memguard.checkpointing.measure import StepMeter

    profile = StepMeter.profile  # every link as fast as the next: joining is about memory, not this CPU's timings
    monkeypatch.setattr(
        StepMeter,
        "profile",
        lambda self, links, parts=(): [replace(p, forward_ms=1.0) for p in profile(self, links, parts)],
    )
    x = torch.randn(8, 3, 64, 64)
    model = torchvision.models.resnet18(num_classes=10)
    plan = checkpoint_resnet(model, memory_budget=0.45, example_input=x)
    assert plan.held, plan.summary()
    assert any(len(run) > 1 for run in plan.runs)
    assert all(len({name.rpartition(".")[0] for name in run}) == 1 for run in plan.runs)  # within a stage
    assert [name for run in plan.runs for name in run] == plan.blocks
    assert plan.predicted_bytes is not None and plan.profiles[0].name == "stem"


def test_torch_compile_keeps_gradients_and_batchnorm_buffers():
    torch.manual_seed(1)
    plain = torchvision.models.resnet18(num_classes=10)
    ours = copy.deepcopy(plain)
    apply_plan(ours, [["stem"], ["layer1.0", "layer1.1"], ["layer4.0"]])
    compiled = torch.compile(ours, backend="aot_eager")
    torch.use_deterministic_algorithms(False)  # the compiler's own kernels need not be deterministic here
    a = _train(plain, steps=2)
    b = _train(ours, steps=2, forward=compiled)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=key)
    assert int(b["buf:layer1.0.bn1.num_batches_tracked"]) == 2  # once per step, not again when recomputed


@pytest.mark.parametrize("arch", ["resnet18", "resnext50_32x4d"])
def test_rebuilt_batchnorm_relu_frees_relu_outputs_and_keeps_training_the_same(arch):
    """The cheap mode: ReLU outputs after bn1 (and bn2) are rebuilt in backward, not kept."""
    import weakref

    torch.manual_seed(1)
    plain = torchvision.models.get_model(arch, num_classes=10)
    ours = copy.deepcopy(plain)
    assert rebuild_bn_relu(ours) == (8 if arch == "resnet18" else 16) + 1  # the blocks and the stem
    kept = {}
    x = torch.randn(2, 3, 32, 32)
    for name, model in (("plain", plain), ("ours", ours)):
        refs = []
        handle = model.layer2[1].bn1.register_forward_hook(lambda m, i, o, refs=refs: refs.append(weakref.ref(o)))
        out = model(x)
        kept[name] = refs[0]() is not None  # still held for backward after the forward pass?
        out.sum().backward()
        handle.remove()
        model.zero_grad()
    assert kept == {"plain": True, "ours": False}
    a, b = _train(plain, steps=1), _train(ours, steps=1)  # one step: later steps amplify the rounding
    for key in a:
        if key.startswith("buf:"):
            assert torch.equal(a[key], b[key]), key  # BatchNorm ran once per step, in both
        else:
            scale = a[key].abs().max().item()
            assert (a[key] - b[key]).abs().max().item() <= 1e-5 * scale, key  # only the rebuild's rounding


def _kept_after_forward(model: nn.Module, modules: list[str], x: torch.Tensor) -> dict[str, bool]:
    """Whether each module's output is still held (for backward) once the forward pass is over."""
    import weakref

    refs: dict[str, weakref.ref] = {}
    handles = [
        model.get_submodule(name).register_forward_hook(lambda m, i, o, name=name: refs.update({name: weakref.ref(o)}))
        for name in modules
    ]
    with preserved_state(model):  # BatchNorm statistics and gradients as they were
        out = model(x)
        kept = {name: ref() is not None for name, ref in refs.items()}
        out.sum().backward()
    for handle in handles:
        handle.remove()
    return kept


def test_block_outputs_are_rebuilt_too_except_where_they_leave_the_rebuilt_blocks():
    torch.manual_seed(0)
    plain = torchvision.models.resnet50(num_classes=10)
    ours = copy.deepcopy(plain)
    rebuild_bn_relu(ours)
    assert link_outputs(ours) == 16  # every block: the last one's output goes to a pooling that keeps nothing
    x = torch.randn(2, 3, 64, 64)
    blocks = ["layer1.0", "layer1.2", "layer2.0", "layer3.5", "layer4.1"]
    assert all(_kept_after_forward(plain, blocks, x).values())
    assert not any(_kept_after_forward(ours, blocks, x).values())
    # a checkpoint keeps its input: the block before a checkpointed one keeps its output, the rest still rebuild
    apply_plan(ours, [["layer2.1"]])
    assert "memguard_tail" not in ours.layer2[0].__dict__ and link_outputs(ours) == 14
    assert _kept_after_forward(ours, blocks, x) == {b: b == "layer2.0" for b in blocks}
    a, b = _train(plain, steps=1), _train(ours, steps=1)
    assert all(torch.equal(a[k], b[k]) for k in a if k.startswith("buf:"))
    assert all((a[k] - b[k]).abs().max() <= 1e-5 * a[k].abs().max() for k in a if k.startswith("grad:"))
    remove_rebuild(ours)
    assert link_outputs(ours) == 0 and not any("memguard_tail" in m.__dict__ for m in ours.modules())


def test_a_stage_rebuilds_its_outputs_with_few_kept_at_once(monkeypatch):
    from lightning_memguard.checkpointing import recipes as rb

    made, builds, most = [], [0], [0]
    init, build = rb.Recipe.__init__, rb.Recipe._build

    def recorded_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    def counted_build(self, depth):
        builds[0] += 1
        most[0] = max(most[0], sum(r.rebuilt is not None for r in made))
        return build(self, depth)

    monkeypatch.setattr(rb.Recipe, "__init__", recorded_init)
    monkeypatch.setattr(rb.Recipe, "_build", counted_build)
    torch.manual_seed(0)
    model = torchvision.models.resnet50(num_classes=10)
    x = torch.randn(2, 3, 64, 64)
    seen = {}
    for kept in (100, 2, 0):
        remove_rebuild(model)
        rebuild_bn_relu(model, chain_kept=kept)  # configuration passed in, carried by the rebuilt modules
        made.clear()
        builds[0] = most[0] = 0
        model.zero_grad()
        with preserved_state(model):
            model(x).sum().backward()
            seen[kept] = (builds[0], most[0], [p.grad.clone() for p in model.parameters()])
    # everything kept: each recipe built once (33 ReLU outputs, 16 block outputs, 4 shortcuts); fewer kept: more
    # passes, fewer tensors held at once, and the same gradients bit for bit
    assert seen[100][0] == 33 + 16 + 4 < seen[2][0] < seen[0][0]
    assert seen[100][1] > seen[2][1] > seen[0][1]
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(*(seen[k][2] for k in seen), strict=True))


def test_a_block_with_its_own_forward_keeps_its_output():
    class Scaled(torchvision.models.resnet.BasicBlock):
        def forward(self, x):
            return super().forward(x) * 0.5

    model = nn.Sequential(Scaled(8, 8), torchvision.models.resnet.BasicBlock(8, 8), nn.Flatten())
    assert rebuild_bn_relu(model) == 2 and link_outputs(model) == 0  # the output is not what the rebuild would make
    plain = nn.Sequential(torchvision.models.resnet.BasicBlock(8, 8), torchvision.models.resnet.BasicBlock(8, 8))
    ours = copy.deepcopy(plain)
    rebuild_bn_relu(ours)
    assert link_outputs(ours) == 1  # the first feeds the second; the second's output leaves the model
    x = torch.randn(2, 8, 6, 6, requires_grad=True)
    plain(x).square().sum().backward()
    grad, x.grad = x.grad, None
    ours(x).square().sum().backward()
    torch.testing.assert_close(x.grad, grad, rtol=1e-5, atol=1e-6)


def test_the_one_pass_rebuild_kernel_trains_like_the_plain_model(monkeypatch):
    """CPU twin of the fused kernel's GPU test, in Triton's interpreter: the same kernel, run by NumPy."""
    pytest.importorskip("triton")
    from lightning_memguard.checkpointing import _fused

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _fused._kernel.cache_clear()  # built again, for the interpreter
    ran = fused_calls(monkeypatch)
    try:
        torch.manual_seed(1)
        plain = torchvision.models.resnet18(num_classes=10)
        ours = copy.deepcopy(plain)
        rebuild_bn_relu(ours)
        a, b = _train(plain, steps=1), _train(ours, steps=1)
    finally:
        _fused._kernel.cache_clear()
    # the stem and 8 blocks' bn1 + ReLU; 8 block outputs, the 3 after a shortcut's BatchNorm in the same pass
    assert len(ran) == 1 + 8 + 8 and all(ran)
    assert all(torch.equal(a[k], b[k]) for k in a if k.startswith("buf:"))
    assert all((a[k] - b[k]).abs().max() <= 1e-5 * a[k].abs().max() for k in a if k.startswith("grad:"))


class _BrokenKernel:
    """A Triton kernel that cannot run here: launching it on any grid fails."""

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            raise RuntimeError("no kernel for this GPU")

        return launch


def test_a_kernel_that_fails_warns_once_and_the_rebuild_goes_on_eagerly(monkeypatch):
    pytest.importorskip("triton")
    from lightning_memguard.checkpointing import _fused

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # lets the CPU take the kernel's path
    monkeypatch.setattr(_fused, "_kernel", _BrokenKernel)
    monkeypatch.setattr(_fused, "_failed", [])
    torch.manual_seed(1)
    plain = torchvision.models.resnet18(num_classes=10)
    ours = copy.deepcopy(plain)
    rebuild_bn_relu(ours)
    with pytest.warns(RuntimeWarning, match="no kernel for this GPU.*PyTorch's own kernels") as caught:
        a, b = _train(plain, steps=1), _train(ours, steps=1)
    assert len([w for w in caught if "rebuild kernel" in str(w.message)]) == 1  # once, not per tensor
    assert not _fused.available(torch.zeros(1))
    assert all((a[k] - b[k]).abs().max() <= 1e-5 * a[k].abs().max() for k in a if k.startswith("grad:"))


def test_the_kernel_declines_what_it_cannot_run_and_the_rebuild_goes_eager(monkeypatch):
    """Whether or not Triton is installed: where the kernel cannot run (a CPU tensor outside Triton's interpreter, a
    layout it does not handle, an identity of another shape) ``fused`` returns None without launching it."""
    from lightning_memguard.checkpointing import _fused

    class _Launches(list):
        """Stands in for the kernel: ``kernel[grid](...)`` records the launch and runs nothing."""

        def __getitem__(self, grid):
            return lambda *args, **kwargs: self.append(grid)

    launched = _Launches()
    monkeypatch.setattr(_fused, "_kernel", lambda: launched)
    monkeypatch.setattr(_fused, "_failed", [])
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    bn = nn.BatchNorm2d(4)
    x = torch.randn(2, 4, 3, 3)
    stats = (x, torch.zeros(4), torch.ones(4), bn.weight.detach(), bn.bias.detach())
    assert not _fused.available(x) and _fused.fused(stats) is None  # a CPU tensor: only Triton's interpreter runs it
    monkeypatch.setattr(_fused, "available", lambda t: True)  # where it could run: the layouts and shapes decide
    assert _fused.fused((x.transpose(2, 3), *stats[1:])) is None  # neither dense layout
    assert _fused.fused(stats, torch.randn(2, 4, 3, 1)) is None  # an identity of another shape
    assert launched == []
    assert _fused._inner(x) == 9 and _fused._inner(x.contiguous(memory_format=torch.channels_last)) == 1
    assert _fused._inner(x.transpose(2, 3)) is None  # neither dense layout


def test_rebuilt_batchnorm_relu_leaves_checkpointed_blocks_to_their_checkpoint():

    torch.manual_seed(1)
    plain = torchvision.models.resnet18(num_classes=10)
    ours = copy.deepcopy(plain)
    apply_plan(ours, [["stem"], ["layer1.0", "layer1.1"], ["layer3.0"]])
    assert rebuild_bn_relu(ours) == 5  # the other five blocks
    a, b = _train(plain, steps=1), _train(ours, steps=1)
    assert all(torch.equal(a[k], b[k]) for k in a if k.startswith("buf:"))
    assert all((a[k] - b[k]).abs().max() <= 1e-5 * a[k].abs().max() for k in a if k.startswith("grad:"))


def test_a_block_rebuilt_first_and_checkpointed_after_trains_like_the_plain_model():
    torch.manual_seed(1)
    plain = torchvision.models.resnet18(num_classes=10)
    ours = copy.deepcopy(plain)
    rebuild_bn_relu(ours)
    apply_plan(ours, [["stem"], ["layer1.0", "layer1.1"], ["layer3.0"]])  # inside a checkpoint the rebuild stands aside
    a, b = _train(plain, steps=1), _train(ours, steps=1)  # one step: later steps amplify the rounding
    assert all(torch.equal(a[k], b[k]) for k in a if k.startswith("buf:"))  # BatchNorm ran once per step
    assert all((a[k] - b[k]).abs().max() <= 1e-5 * a[k].abs().max() for k in a if k.startswith("grad:"))
    remove_checkpointing(ours)
    assert remove_rebuild(ours) == 9 and type(ours.layer1[0]) is torchvision.models.resnet.BasicBlock
    assert type(ours.relu) is nn.ReLU and type(ours.maxpool) is nn.MaxPool2d


def test_rebuild_mode_without_a_budget_checkpoints_nothing_and_keeps_state_dict_keys():
    model = torchvision.models.resnet50(num_classes=10)
    keys = list(model.state_dict())
    plan = checkpoint_resnet(model, rebuild_bn_relu=True)
    assert plan.blocks == [] and plan.runs == []
    assert len(plan.rebuilt) == 17 and plan.rebuilt[:2] == ["stem", "layer1.0"]
    assert "BatchNorm + ReLU rebuilt in 17" in plan.summary()
    assert list(model.state_dict()) == keys
    assert not any(is_checkpointed(m) for m in model.modules())
    model.load_state_dict(torchvision.models.resnet50(num_classes=10).state_dict())  # and back


def test_saved_tensor_hooks_around_a_rebuilt_block_still_see_what_it_keeps():
    counted = {}

    def saved_bytes(model):
        total = 0

        def pack(t):
            nonlocal total
            total += t.untyped_storage().nbytes() if t.grad_fn is not None or not t.is_leaf else 0
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(torch.randn(2, 3, 32, 32)).sum().backward()
        return total

    for name in ("plain", "rebuilt"):
        torch.manual_seed(0)
        model = torchvision.models.resnet18(num_classes=10)
        if name == "rebuilt":
            rebuild_bn_relu(model)
        counted[name] = saved_bytes(model)
    assert 0.2 * counted["plain"] < counted["rebuilt"] < 0.6 * counted["plain"]


@pytest.mark.parametrize("budget", [0.9, 0.6])  # the rebuild alone fits 0.9 here
def test_budget_with_the_rebuild_checkpoints_fewer_blocks(budget):
    x = torch.randn(8, 3, 64, 64)
    plans = {}
    for rebuild in (False, True):
        model = torchvision.models.resnet18(num_classes=10)
        before = {n: b.clone() for n, b in model.named_buffers()}
        plans[rebuild] = checkpoint_resnet(model, memory_budget=budget, example_input=x, rebuild_bn_relu=rebuild)
        assert plans[rebuild].held, plans[rebuild].summary()
        assert all(torch.equal(before[n], b) for n, b in model.named_buffers())
        rebuilt = _rebuilt_links(model)
        assert rebuilt == sorted(plans[rebuild].rebuilt)  # every link not checkpointed, and only those
        assert not set(rebuilt) & set(plans[rebuild].blocks)
    # which links are chosen depends on their measured forward times on this machine, but never more with the rebuild
    assert len(plans[True].blocks) <= len(plans[False].blocks)
    if budget == 0.9:  # the rebuild alone fits; checkpointing alone needs at least one link
        assert plans[True].blocks == [] and plans[False].blocks
    assert plans[True].rebuilt and not plans[False].rebuilt


def test_a_plan_with_the_rebuild_is_applied_again_the_same_way():
    x = torch.randn(8, 3, 64, 64)
    model = torchvision.models.resnet18(num_classes=10)
    plan = checkpoint_resnet(model, memory_budget=0.6, example_input=x, rebuild_bn_relu=True)
    again = torchvision.models.resnet18(num_classes=10)
    assert apply_plan(again, plan.runs, rebuild_bn_relu=True) == plan.blocks
    for name, module in model.named_modules():
        twin = again.get_submodule(name)
        assert type(twin) is type(module), name


def test_the_stems_relu_output_is_rebuilt_too_and_the_model_still_copies_and_pickles():
    import pickle
    import weakref

    torch.manual_seed(0)
    plain = torchvision.models.resnet18(num_classes=10)
    ours = copy.deepcopy(plain)
    rebuild_bn_relu(ours)
    kept = {}
    x = torch.randn(2, 3, 64, 64)
    for name, model in (("plain", plain), ("ours", ours)):
        refs = []
        handle = model.bn1.register_forward_hook(lambda m, i, o, refs=refs: refs.append(weakref.ref(o)))
        out = model(x)
        kept[name] = refs[0]() is not None  # the stem's ReLU output, held for backward?
        out.sum().backward()
        handle.remove()
    assert kept == {"plain": True, "ours": False}
    for model, indices in ((plain, torch.int64), (ours, torch.int16)):  # the pooling's indices: a quarter of the bytes
        dtypes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, d=dtypes: d.append(t.dtype) or t, lambda t: t):
            model(x).sum().backward()
        assert {torch.int16, torch.int64} & set(dtypes) == {indices}
    again = pickle.loads(pickle.dumps(ours))
    copied = copy.deepcopy(ours)
    for clone in (again, copied):
        assert clone.relu.memguard_bn is clone.bn1
        clone(torch.randn(2, 3, 64, 64)).sum().backward()
    with torch.no_grad():
        ours.eval(), plain.eval()
        assert torch.equal(ours(x), plain(x))  # the same running statistics; in evaluation the rebuild does nothing


def test_a_recipe_rebuilds_what_batchnorm_and_relu_made():
    from lightning_memguard.checkpointing import recipes as rb

    torch.manual_seed(0)
    bn = nn.BatchNorm2d(8)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 2), bn.bias.uniform_(-1, 1)
    x = torch.randn(4, 8, 6, 6, requires_grad=True)
    out = bn(x)
    y = torch.relu(out)
    recipe = rb.Recipe(x.detach(), bn, *rb.batch_stats(out))  # type: ignore[misc]
    recipe.packed = 2
    first, second = recipe.rebuild(), recipe.rebuild()
    assert first is second and recipe.rebuilt is None  # built once, let go after its last use
    torch.testing.assert_close(first, y.detach(), rtol=1e-5, atol=1e-6)


def test_rebuild_needs_torchvision_blocks():
    class MyBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x)

    with pytest.raises(ValueError, match="`rebuild_bn_relu` needs torchvision BasicBlock or Bottleneck"):
        checkpoint_blocks(nn.Sequential(MyBlock(), MyBlock()), rebuild_bn_relu=True)


def test_callback_with_the_rebuild(tmp_path):
    with pytest.raises(TypeError, match="`rebuild_bn_relu` must be a bool, got 'yes'"):
        ActivationCheckpointing(rebuild_bn_relu="yes")
    cb = ActivationCheckpointing(rebuild_bn_relu=True)
    model = ImageClassifier(image_size=32, batch_size=4, steps_per_epoch=2)
    Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[cb])).fit(model)
    assert cb.blocks == [] and len(cb.plan.rebuilt) == 9
    assert _rebuilt_links(model) == sorted(cb.plan.rebuilt)


def test_callback_with_the_rebuild_and_a_budget(tmp_path):
    cb = ActivationCheckpointing(memory_budget=0.85, rebuild_bn_relu=True)
    model = ExampleClassifier(image_size=32, batch_size=4, steps_per_epoch=2)
    Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[cb])).fit(model)
    assert cb.plan is not None and cb.plan.held, cb.plan
    assert cb.plan.rebuilt and len(cb.plan.blocks) < 9
    assert _rebuilt_links(model) == sorted(cb.plan.rebuilt)


def test_a_run_of_blocks_that_pass_tuples_is_refused():
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            x = x[0] if isinstance(x, tuple) else x
            return self.lin(x), x

    class PairBlock(Pair):
        pass

    model = nn.Sequential(PairBlock(), PairBlock())
    apply_plan(model, [["0", "1"]])
    with pytest.raises(TypeError, match="must pass one tensor from block to block, got tuple"):
        model(torch.randn(2, 4, requires_grad=True))
