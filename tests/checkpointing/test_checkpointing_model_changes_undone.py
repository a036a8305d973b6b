"""The one entrance that changes a model (checkpointing/surgery.py): removing leaves nothing behind, a failure
part-way leaves the model as it was, and configuration travels with the modules, not in module-level knobs."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torchvision
from torch import nn
from torchvision.models.resnet import BasicBlock

from lightning_memguard.checkpointing import (
    RebuildConfig,
    apply_plan,
    checkpoint_blocks,
    find_units,
    is_checkpointed,
    rebuild_bn_relu,
    remove_checkpointing,
    remove_rebuild,
    surgery,
)
from lightning_memguard.checkpointing.model_map import map_model, model_chain
from lightning_memguard.checkpointing.rebuild import RebuiltBatchNormReLU, TakesRecipes
from lightning_memguard.checkpointing.wrap import CheckpointedUnit, Swap, preserved_state


class _Stack(nn.Module):
    """Transformer layers with dropout: no BatchNorm, no torchvision block."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            *[nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True) for _ in range(3)]
        )
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(x))


def _model(name: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    if name == "resnet18":
        return torchvision.models.resnet18(num_classes=10), torch.randn(2, 3, 32, 32)
    if name == "blocks":  # torchvision blocks in a plain Sequential: rebuilt and joined, but no ResNet around them
        blocks = [BasicBlock(8, 8) for _ in range(3)]
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), *blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        return model, torch.randn(2, 3, 16, 16)
    if name in ("mobilenet_v2", "efficientnet_b0"):  # Conv2dNormActivation units, with and without a residual
        return torchvision.models.get_model(name, num_classes=10), torch.randn(2, 3, 64, 64)
    return _Stack(), torch.randn(2, 6, 16)


RUNS = {
    "resnet18": [["stem"], ["layer1.0", "layer1.1"]],
    "blocks": [["1", "2"]],
    "transformer": [["layers.0", "layers.1"]],
    "mobilenet_v2": [["features.2", "features.3"]],
    "efficientnet_b0": [["features.2.0", "features.2.1"]],
}


def _apply(model: nn.Module, x: torch.Tensor, name: str, how: str) -> None:
    rebuild = how.endswith("+rebuild")
    if how.startswith("every"):
        checkpoint_blocks(model, rebuild_bn_relu=rebuild)
    elif how.startswith("budget"):
        checkpoint_blocks(model, memory_budget=0.6, example_input=x, rebuild_bn_relu=rebuild)
    else:  # runs of a plan made before
        apply_plan(model, RUNS[name], rebuild_bn_relu=rebuild, rebuild_config=RebuildConfig(chain_kept=1))


def _ours(module: nn.Module) -> dict[str, object]:
    """What this library may have put on a module: any key of its __dict__ named like ours, declared or not."""
    return {k: v for k, v in vars(module).items() if k.startswith(("memguard", "_memguard"))}


def _state(model: nn.Module) -> list[tuple[type, dict[str, object]]]:
    return [(type(m), _ours(m)) for m in model.modules()]


def _settings(model: nn.Module) -> list[dict[str, object]]:
    """Each module's own plain settings (``inplace``, ``training``, ``eps``, ...), not ours."""
    return [
        {k: v for k, v in vars(m).items() if isinstance(v, bool | int | float | str) and k not in _ours(m)}
        for m in model.modules()
    ]


CASES = [
    (name, how)
    for name in ("resnet18", "blocks", "transformer", "mobilenet_v2", "efficientnet_b0")
    for how in ("every", "every+rebuild", "budget", "budget+rebuild", "runs", "runs+rebuild")
    if name != "transformer" or not how.endswith("+rebuild")
]


@pytest.mark.parametrize(("name", "how"), CASES, ids=[f"{n}-{h}" for n, h in CASES])
def test_removing_leaves_every_module_as_it_was(name, how):
    model, x = _model(name)
    classes = [type(m) for m in model.modules()]
    settings = _settings(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    _apply(model, x, name, how)
    assert any(hasattr(type(m), "_memguard_original") for m in model.modules())  # something was changed
    with preserved_state(model):  # a step (BatchNorm statistics given back): runs record outputs, blocks recipes
        model(x).sum().backward()
    assert _settings(model) == settings  # a unit's in-place activation ran out of place for the call only
    if name in ("mobilenet_v2", "efficientnet_b0") and how.endswith("+rebuild"):
        assert any(isinstance(m, TakesRecipes) for m in model.modules())  # linked: a convolution, a SqueezeExcitation
    put = {key for m in model.modules() for key in _ours(m)}
    assert put and put <= set(surgery.ATTRIBUTES)  # everything it puts on modules is declared
    remove_checkpointing(model)
    remove_rebuild(model)
    assert [type(m) for m in model.modules()] == classes
    assert all(_ours(m) == {} for m in model.modules())
    assert _settings(model) == settings
    after = model.state_dict()
    assert list(after) == list(state) and all(torch.equal(after[k], state[k]) for k in state)


def _failing_on_the_third_swap(monkeypatch) -> None:
    made = []
    real = surgery.swapped_class

    def swapped_class(cls, mixin):
        made.append(cls)
        if len(made) == 3:
            raise RuntimeError("injected failure")
        return real(cls, mixin)

    monkeypatch.setattr(surgery, "swapped_class", swapped_class)


@pytest.mark.parametrize("name", ["resnet18", "transformer"])
def test_a_failure_part_way_leaves_the_model_exactly_as_before(monkeypatch, name):
    model, _ = _model(name)
    before = _state(model)
    _failing_on_the_third_swap(monkeypatch)
    with pytest.raises(RuntimeError, match="injected failure"):
        checkpoint_blocks(model)  # two modules changed before the third fails
    assert _state(model) == before


def test_a_failure_while_linking_outputs_leaves_the_model_exactly_as_before(monkeypatch):
    """The modules after rebuilt units get their mixin from link_outputs, after every unit's swap: a failure there
    undoes the units too."""
    model, _ = _model("mobilenet_v2")
    before = _state(model)
    real = surgery.swapped_class

    def swapped_class(cls, mixin):
        if mixin is TakesRecipes:
            raise RuntimeError("injected failure")
        return real(cls, mixin)

    monkeypatch.setattr(surgery, "swapped_class", swapped_class)
    with pytest.raises(RuntimeError, match="injected failure"):
        rebuild_bn_relu(model)
    assert _state(model) == before


def test_a_failure_while_replacing_an_earlier_change_restores_that_change(monkeypatch):
    model, _ = _model("resnet18")
    links, _ = model_chain(model, find_units(model))
    rebuilt = surgery.apply(map_model(model), rebuilt=links)  # what a budget's first measurement sees
    before = _state(model)
    assert any(isinstance(m, RebuiltBatchNormReLU) for m in model.modules())
    _failing_on_the_third_swap(monkeypatch)
    with pytest.raises(RuntimeError, match="injected failure"):
        surgery.apply(map_model(model), [[link] for link in links[:3]], links, replacing=rebuilt)  # undoes, then fails
    assert _state(model) == before
    for (_, old), (_, now) in zip(before, _state(model), strict=True):  # the very same objects, not copies
        assert all(now[k] is v for k, v in old.items())


def test_a_planning_pass_that_fails_leaves_the_model_as_it_was(monkeypatch):
    from lightning_memguard.checkpointing.measure import StepMeter

    model, x = _model("resnet18")
    before = _state(model)
    peak = StepMeter.peak
    calls = []

    def failing_peak(self):
        calls.append(1)
        if len(calls) == 2:  # the first measurement with blocks checkpointed
            raise torch.OutOfMemoryError("injected")
        return peak(self)

    monkeypatch.setattr(StepMeter, "peak", failing_peak)
    with pytest.raises(torch.OutOfMemoryError):
        checkpoint_blocks(model, memory_budget=0.6, example_input=x, rebuild_bn_relu=True)
    assert _state(model) == before


def test_each_mixin_comes_off_on_its_own_in_any_order():
    model, x = _model("resnet18")
    rebuild_bn_relu(model)
    apply_plan(model, [["layer1.0"]])  # rebuilt first, checkpointed after: both mixins on one block
    block = model.layer1[0]
    assert is_checkpointed(block) and isinstance(block, RebuiltBatchNormReLU)
    assert remove_rebuild(model) == 9  # eight blocks and the stem
    assert is_checkpointed(block) and not isinstance(block, RebuiltBatchNormReLU)
    assert "memguard_bns" not in vars(block) and "memguard_bn_correct" in vars(block)
    model(x).sum().backward()  # still a working checkpoint
    apply_plan(model, [["stem"]])  # a run of four modules sharing what the head last made
    out = model(x)  # its graph keeps the stem's output alive, and the run's record of it
    assert model.conv1.memguard_output.ref() is not None
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert twin.conv1.memguard_output is twin.bn1.memguard_output is twin.maxpool.memguard_output
        assert twin.conv1.memguard_output.ref is None  # not state: copies start empty
    del out
    remove_checkpointing(model)
    assert type(block) is BasicBlock and _ours(block) == {} and _ours(model.conv1) == {}


def test_an_attribute_not_declared_is_refused():
    block = BasicBlock(4, 4)
    with pytest.raises(RuntimeError, match="'memguard_cache' is not declared for CheckpointedUnit"):
        surgery._give(Swap(block, CheckpointedUnit, {"memguard_cache": 1}), [])
    assert type(block) is BasicBlock


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2"])
def test_the_rebuild_configuration_travels_with_the_modules(monkeypatch, name):
    from lightning_memguard.checkpointing import _fused

    calls = []
    real = _fused.fused

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(_fused, "fused", counted)
    seen = {}
    for fused in (True, False):
        model, x = _model(name)
        rebuild_bn_relu(model, fused=fused, chain_kept=1)
        configs = {m.__dict__["memguard_rebuild"] for m in model.modules() if "memguard_rebuild" in vars(m)}
        assert configs == {RebuildConfig(fused=fused, chain_kept=1)}
        calls.clear()
        copy.deepcopy(model)(x).sum().backward()  # a copy carries its configuration too
        seen[fused] = len(calls)
    assert seen[True] > 0 and seen[False] == 0  # False: PyTorch's own kernels, the one-pass kernel never asked


def test_configuration_is_checked():
    with pytest.raises(ValueError, match="`chain_kept` must be at least 0, got -1"):
        RebuildConfig(chain_kept=-1)
    with pytest.raises(TypeError, match="`fused` must be a bool, got 'no'"):
        RebuildConfig(fused="no")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`rebuild_config` must be a RebuildConfig or None, got 2"):
        checkpoint_blocks(torchvision.models.resnet18(), rebuild_bn_relu=True, rebuild_config=2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`chain_kept` must be an int, got 1.5"):
        rebuild_bn_relu(torchvision.models.resnet18(), chain_kept=1.5)  # type: ignore[arg-type]


def test_the_callback_and_the_strategy_pass_their_rebuild_configuration_on(tmp_path):
    from conftest import trainer_kwargs
    from lightning.pytorch import Trainer

    from lightning_memguard import ActivationCheckpointing
    from lightning_memguard.strategies import CheckpointingSingleDeviceStrategy
    from lightning_memguard.testing import ImageClassifier

    config = RebuildConfig(fused=False, chain_kept=1)
    for form in ("callback", "strategy"):
        model = ImageClassifier("resnet18", image_size=32, batch_size=4, steps_per_epoch=2)
        kwargs = trainer_kwargs(tmp_path, max_epochs=1)
        if form == "callback":
            kwargs["callbacks"] = [ActivationCheckpointing(rebuild_bn_relu=True, rebuild_config=config)]
        else:
            kwargs.pop("accelerator"), kwargs.pop("devices")
            kwargs["strategy"] = CheckpointingSingleDeviceStrategy("cpu", rebuild_bn_relu=True, rebuild_config=config)
        Trainer(**kwargs).fit(model)
        configs = {m.__dict__["memguard_rebuild"] for m in model.modules() if "memguard_rebuild" in vars(m)}
        assert configs == {config}, form
    with pytest.raises(TypeError, match="`rebuild_config` must be a RebuildConfig or None, got 'fast'"):
        ActivationCheckpointing(rebuild_config="fast")
