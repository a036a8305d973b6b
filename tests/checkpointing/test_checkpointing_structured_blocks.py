"""Blocks whose inputs and outputs are not one tensor train exactly as without checkpointing, and any timm model's
blocks come from its own declaration (``group_matcher``).

Each model here is small and of no known family, shaped after a real one: DenseNet's layers take the list of all
earlier features, which the block around them appends to afterwards; HRNet's stages take a list of branches and
replace its items; a Hugging Face layer takes tensors by keyword and in tuples; other blocks return several tensors
that later blocks use apart, or views of one tensor."""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn

from lightning_memguard.checkpointing import checkpoint_blocks
from lightning_memguard.checkpointing.families.timm_declared import declared_blocks


class DenseLayer(nn.Module):
    """Takes every earlier feature map (a list) and returns a new one."""

    def __init__(self, channels: int, count: int) -> None:
        super().__init__()
        self.norm = nn.BatchNorm2d(channels * count)
        self.conv = nn.Conv2d(channels * count, channels, 3, padding=1)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        return self.conv(torch.relu(self.norm(torch.cat(features, 1))))


class DenseNetLike(nn.Module):
    def __init__(self, channels: int = 4, layers: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.layers = nn.ModuleList(DenseLayer(channels, i + 1) for i in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [self.stem(x)]
        for layer in self.layers:
            features.append(layer(features))  # the list the layer was given grows after it ran
        return torch.cat(features, 1).mean((2, 3)).sum(1)


class Branches(nn.Module):
    """Takes a list of branches and replaces its items in place, then fuses them."""

    def __init__(self, channels: int = 4) -> None:
        super().__init__()
        self.branches = nn.ModuleList(
            nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels)) for _ in range(2)
        )
        self.fuse = nn.Conv2d(channels, channels, 1)

    def forward(self, x: list[torch.Tensor]) -> list[torch.Tensor]:
        for i, branch in enumerate(self.branches):
            x[i] = torch.relu(branch(x[i]))
        return [self.fuse(x[0] + x[1]), x[1]]


class HRNetLike(nn.Module):
    def __init__(self, channels: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.stages = nn.Sequential(Branches(channels), Branches(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        out = self.stages([y, y * 2])
        return (out[0] * out[1]).mean((1, 2, 3))


class KeywordLayer(nn.Module):
    """A transformer-style layer: tensors by keyword and in a tuple; returns a tuple whose parts are used apart."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.mix = nn.Linear(width, width)
        self.gate = nn.Linear(width, width)

    def forward(
        self, hidden: torch.Tensor, *, position: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = position
        mixed = torch.tanh(self.mix(hidden * cos + sin)) * mask
        return hidden + mixed, self.gate(mixed)


class KeywordModel(nn.Module):
    def __init__(self, width: int = 8, layers: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(4, width)
        self.layers = nn.ModuleList(KeywordLayer(width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.inp(x)
        position = (torch.cos(hidden.detach()), torch.sin(hidden))
        mask = (x[..., :1] > 0).float()
        gates = []
        for layer in self.layers:
            hidden, gate = layer(hidden, position=position, mask=mask)
            gates.append(gate)
        return hidden.sum(-1) + torch.stack(gates).sum((0, -1))


class ViewsBlock(nn.Module):
    """Returns two views of one tensor; the next block takes both."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(width, 2 * width)

    def forward(self, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(x, tuple):
            x = x[0] * torch.sigmoid(x[1])
        both = self.lin(x)
        return both[..., : both.shape[-1] // 2], both[..., both.shape[-1] // 2 :]


class ViewsModel(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ViewsBlock(width) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor | tuple[torch.Tensor, torch.Tensor] = x
        for block in self.blocks:
            y = block(y)
        assert isinstance(y, tuple)
        return (y[0] * y[1]).sum(-1)


def _train_step(model: nn.Module, x: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model.train()
    model.zero_grad(set_to_none=True)
    model(x).pow(2).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, {n: b.clone() for n, b in model.named_buffers()}


CASES = {
    "densenet_lists_grown_after": (DenseNetLike, lambda: torch.randn(2, 3, 8, 8), {DenseLayer}),
    "hrnet_lists_changed_inside": (HRNetLike, lambda: torch.randn(2, 3, 8, 8), {Branches}),
    "keywords_tuples_and_outputs_apart": (KeywordModel, lambda: torch.randn(3, 5, 4), {KeywordLayer}),
    "views_of_one_tensor": (ViewsModel, lambda: torch.randn(3, 8), {ViewsBlock}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_blocks_taking_and_giving_structures_train_exactly_as_the_plain_model(case: str) -> None:
    make, data, units = CASES[case]
    torch.manual_seed(0)
    plain = make()
    ours = copy.deepcopy(plain)
    plan = checkpoint_blocks(ours, units=units)
    assert len(plan.blocks) >= 2
    x = data()
    grads, buffers = _train_step(plain, x.clone())
    our_grads, our_buffers = _train_step(ours, x.clone())
    assert set(our_grads) == set(grads)
    for name, grad in grads.items():
        assert torch.equal(our_grads[name], grad), name
    for name, buffer in buffers.items():
        assert torch.equal(our_buffers[name], buffer), name


def test_a_block_changing_its_tensor_input_in_place_after_is_an_error_not_a_wrong_gradient() -> None:
    """A tensor a checkpointed block took, changed in place afterwards (here inside a tuple), would be recomputed
    from its new values: the backward refuses instead of computing other gradients."""

    class Changes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(KeywordLayer(8) for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            sin = torch.sin(x)
            position = (torch.cos(x), sin)
            mask = torch.ones_like(x)
            h, _ = self.blocks[0](x, position=position, mask=mask)
            sin.mul_(3.0)  # the block's input, changed after it ran
            h, _ = self.blocks[1](h, position=(position[0], sin * 1), mask=mask)
            return h.sum()

    model = Changes()
    checkpoint_blocks(model, units={KeywordLayer})
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        model(torch.randn(2, 8, requires_grad=True)).backward()


class _ChangesItsInput(nn.Module):
    """Changes the tensor it is given in place first: an in-place ReLU, or ``x += offset``."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.act = nn.ReLU(inplace=True)
        self.offset = nn.Parameter(torch.ones(8))
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "relu":
            x = self.act(x)
        elif self.how == "add":
            x += self.offset
        else:  # out of place: nothing changes what it was given
            x = torch.relu(x) + self.offset
        return self.lin(x)


_CHANGES_ITS_INPUT = (
    r"the checkpointed block '{}' \(_ChangesItsInput\) changes its input in place in its forward .*"
    r"Fix: make the block's first operation on its input out of place \(nn\.ReLU\(\), `x = x \+ \.\.\.`\), or leave"
    r" the block unchecked"
)


@pytest.mark.parametrize("how", ["relu", "add"])
def test_a_block_changing_its_own_input_in_place_is_named_with_the_fix(how: str) -> None:
    """``ReLU(inplace=True)`` first, or ``x += offset``: recomputed from its changed input, the block failed in
    backward with autograd's bare "modified by an inplace operation"; the forward now says which block and what to
    do, before any backward."""
    model = nn.Sequential(nn.Linear(4, 8), _ChangesItsInput(how), _ChangesItsInput(how), nn.Linear(8, 2))
    checkpoint_blocks(model, units={_ChangesItsInput})
    with pytest.raises(RuntimeError, match=_CHANGES_ITS_INPUT.format("1")):
        model(torch.randn(2, 4)).sum().backward()
    with torch.no_grad():  # nothing recomputes without gradients: it runs as written
        assert model(torch.randn(2, 4)).shape == (2, 2)


def test_a_block_changing_its_input_in_place_is_named_as_the_lightning_module_names_it(tmp_path) -> None:
    from conftest import TinyModel, trainer_kwargs
    from lightning.pytorch import Trainer

    from lightning_memguard import ActivationCheckpointing

    module = TinyModel()
    module.net = nn.Sequential(nn.Linear(16, 8), _ChangesItsInput("relu"), nn.Linear(8, 2))
    trainer = Trainer(**trainer_kwargs(tmp_path, callbacks=[ActivationCheckpointing(units=["net.1"])], max_steps=1))
    with pytest.raises(RuntimeError, match=_CHANGES_ITS_INPUT.format("net.1")):
        trainer.fit(module)


@pytest.mark.parametrize("budget", [0.9, 0.2])
def test_a_budget_leaves_a_block_changing_its_input_in_place_unchecked_and_says_so(budget: float) -> None:
    """A budget never checkpoints such a block, not even to measure a set (a tight budget applied every block and
    failed); the plan's line names it."""
    model = nn.Sequential(nn.Linear(4, 8), *(_ChangesItsInput(h) for h in ["relu", "plain", "add", "plain"]))
    x = torch.randn(64, 4)
    plan = checkpoint_blocks(model, units=["1", "2", "3", "4"], memory_budget=budget, example_input=x)
    assert plan.blocks and set(plan.blocks) <= {"2", "4"}
    assert (
        "left unchecked: 1, 3 (a checkpoint may not recompute them: each changes its input in place" in plan.summary()
    )
    model(x).sum().backward()  # trains


class _Position(NamedTuple):
    cos: torch.Tensor
    sin: torch.Tensor


class _TakesStructures(nn.Module):
    """Reads its tensor from a named tuple or an ``OrderedDict`` and saves only what it computes from it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, given: _Position | OrderedDict[str, torch.Tensor]) -> torch.Tensor:
        sin = given.sin if isinstance(given, _Position) else given["sin"]
        return self.lin(sin + 1)


@pytest.mark.parametrize("kind", [_Position, OrderedDict])
def test_a_tensor_in_a_named_tuple_or_ordered_dict_changed_in_place_after_is_an_error(kind: type) -> None:
    """The plain model computes its gradients from what the block saved; a recomputation would read the changed
    tensor (other gradients, no error), so the backward refuses, as for a tensor in a list."""

    class Changes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = _TakesStructures()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            sin = torch.sin(x)
            given = _Position(torch.cos(x), sin) if kind is _Position else OrderedDict(cos=torch.cos(x), sin=sin)
            out = self.block(given)
            sin.mul_(3.0)  # the block's input, changed after it ran
            return out.sum()

    model = Changes()
    checkpoint_blocks(model, units={_TakesStructures})
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        model(torch.randn(2, 8, requires_grad=True)).backward()


class _Grouped(nn.Module):
    """A model declaring its groups as timm does: a stem, stages whose downsampling shares the first block's group,
    a list of branches, a final norm."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
        self.stages = nn.Sequential(
            *(
                nn.ModuleDict(
                    {
                        "downsample": nn.Sequential(nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)),
                        "blocks": nn.Sequential(*(nn.Sequential(nn.Conv2d(4, 4, 3), nn.ReLU()) for _ in range(2))),
                    }
                )
                for _ in range(2)
            )
        )
        self.branches = nn.ModuleList(nn.Sequential(nn.Conv2d(4, 4, 1), nn.ReLU()) for _ in range(2))
        self.norm = nn.LayerNorm(4)

    def group_matcher(self, coarse: bool = False) -> dict[str, object]:
        return {
            "stem": r"^stem",
            "blocks": [
                (r"^stages\.(\d+)\.downsample", (0,)),
                (r"^stages\.(\d+)\.blocks\.(\d+)", None),
                (r"^branches", (99,)),
                (r"^norm", (99999,)),
            ],
        }


def test_declared_groups_give_the_blocks_that_hold_them() -> None:
    timm_models = pytest.importorskip("timm.models")
    model = _Grouped()
    names = [name for name, _ in declared_blocks(model, timm_models.group_modules)]
    assert names == [
        "stages.0.downsample",
        "stages.0.blocks.0",
        "stages.0.blocks.1",
        "stages.1.downsample",
        "stages.1.blocks.0",
        "stages.1.blocks.1",
        "branches.0",
        "branches.1",
    ]


@pytest.mark.parametrize(
    ("name", "first_blocks"),
    [("regnetx_002", ["s1.b1", "s2.b1", "s3.b1"]), ("dla34", ["level0", "level1", "level2"])],
)
def test_timm_models_without_an_adapter_get_their_declared_blocks(name: str, first_blocks: list[str]) -> None:
    timm = pytest.importorskip("timm")
    from lightning_memguard.checkpointing.families import find_units

    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=4)
    assert [n for n, _ in find_units(model)][:3] == first_blocks


def test_a_hugging_face_wrapper_of_a_timm_model_checkpoints_the_timm_blocks_inside_it() -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("timm")
    if not hasattr(transformers, "TimmWrapperForImageClassification"):
        pytest.skip("this transformers has no TimmWrapper")
    torch.manual_seed(0)
    config = transformers.TimmWrapperConfig(architecture="regnetx_002", num_labels=3)
    plain = transformers.TimmWrapperForImageClassification(config)
    ours = copy.deepcopy(plain)
    plan = checkpoint_blocks(ours)
    assert plan.blocks[:2] == ["timm_model.s1.b1", "timm_model.s2.b1"]
    x = torch.randn(2, 3, 32, 32)

    def step(model: nn.Module) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model.train()
        model(pixel_values=x).logits.pow(2).mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    grads, our_grads = step(plain), step(ours)
    assert grads.keys() == our_grads.keys() and all(torch.equal(grads[k], our_grads[k]) for k in grads)


def test_a_vision_language_model_keeps_no_more_than_its_own_switch() -> None:
    """Llava's language model reads ``use_cache`` from its own configuration where Llava passes none: checkpointed
    without telling it, its layers built a key/value cache that the checkpoints held until backward (1.9x the
    switch's bytes). Every model inside that takes ``use_cache`` gets ``False`` while it trains checkpointed."""
    pytest.importorskip("transformers")
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "coverage.py"
    spec = importlib.util.spec_from_file_location("benchmark_coverage_vl", path)
    assert spec is not None and spec.loader is not None
    coverage = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(coverage)
    row = coverage.examine("hf", "llava", seconds=0)
    assert row["covered"], row["reason"]
    assert row["kept_bytes"]["ours"] <= row["kept_bytes"]["switch"]


class _Pair(nn.Module):
    """A cheap block whose output is large beside what it saves: a budget joins such blocks into runs."""

    def __init__(self, lists: bool) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(64))
        self.lists = lists

    def forward(self, x: Any) -> Any:
        if self.lists:
            a, b = x
            return [torch.tanh(a * self.w) + b, b]
        return torch.tanh(x * self.w) + x


class _PairChain(nn.Module):
    def __init__(self, lists: bool) -> None:
        super().__init__()
        self.lists = lists
        self.blocks = nn.Sequential(*(_Pair(lists) for _ in range(6)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.blocks([x, x * 1] if self.lists else x)
        return (y[0] if self.lists else y).sum()


def test_a_budget_joins_blocks_into_runs_only_where_they_pass_one_tensor() -> None:
    """The same chain joined into runs where its blocks pass a tensor is checkpointed block by block where they pass
    lists (a run hands on one tensor), and trains as the plain model does, rather than failing in the plan."""
    runs = {}
    for lists in (False, True):
        torch.manual_seed(0)
        plain = _PairChain(lists)
        ours = copy.deepcopy(plain)
        x = torch.randn(512, 64)
        plan = checkpoint_blocks(ours, units={_Pair}, memory_budget=0.3, example_input=x, loss_fn=lambda out: out)
        runs[lists] = plan.runs
        for model in (plain, ours):
            model(x).backward()
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), ours.parameters(), strict=True))
    assert any(len(run) > 1 for run in runs[False])
    assert all(len(run) == 1 for run in runs[True])


class _Dense(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class _CalledDirectly(nn.Module):
    """A model calling some of its blocks' ``forward`` directly, as HRNet's head does (``down.forward(y)``): module
    hooks do not see those calls."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Dense() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block.forward(x) if i % 2 else block(x)
        return x.sum()


def test_a_budget_plans_a_model_calling_its_blocks_forward_directly() -> None:
    """A block whose forward is called directly cannot be measured; the budget is still planned (it counts on
    nothing from that block), and the model trains as the plain one does."""
    torch.manual_seed(0)
    plain = _CalledDirectly()
    ours = copy.deepcopy(plain)
    x = torch.randn(64, 32)
    plan = checkpoint_blocks(ours, units={_Dense}, memory_budget=0.8, example_input=x, loss_fn=lambda out: out)
    assert plan.candidates == 4
    for model in (plain, ours):
        model(x).backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), ours.parameters(), strict=True))


class _Reused(nn.Module):
    """A chain whose first block is used again after it, outside its ``nn.Sequential`` (weights shared)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(_Pair(False) for _ in range(6)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.blocks(x)
        return (y + self.blocks[0](y[:4]).sum()).sum()


def test_a_budget_begins_no_run_at_a_block_used_again_elsewhere() -> None:
    """A run's first block runs the rest of its run whenever it is called: called again on its own, it would give
    the run's output. Such a block is checkpointed alone, and the model computes what the plain one does."""
    torch.manual_seed(0)
    plain = _Reused()
    x = torch.randn(512, 64)
    for budget in (0.3, 0.4):
        ours = copy.deepcopy(plain)
        plan = checkpoint_blocks(ours, units={_Pair}, memory_budget=budget, example_input=x, loss_fn=lambda out: out)
        assert ["blocks.0"] in plan.runs
        assert any(len(run) > 1 for run in plan.runs)
        assert torch.equal(ours(x), plain(x))


def test_a_hugging_face_wrapper_of_a_timm_model_without_timm_s_switch_checkpoints_it_too() -> None:
    """TimmWrapperModel declares ``supports_gradient_checkpointing = False`` where timm's own switch is missing (DLA,
    HRNet); the timm model inside is checkpointed by its declared blocks, as it is unwrapped, and trains exactly."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("timm")
    if not hasattr(transformers, "TimmWrapperForImageClassification"):
        pytest.skip("this transformers has no TimmWrapper")
    torch.manual_seed(0)
    plain = transformers.TimmWrapperForImageClassification(
        transformers.TimmWrapperConfig(architecture="dla34", num_labels=3)
    )
    assert plain.supports_gradient_checkpointing is False
    ours = copy.deepcopy(plain)
    plan = checkpoint_blocks(ours)
    assert plan.blocks[:2] == ["timm_model.level0", "timm_model.level1"]
    x = torch.randn(2, 3, 32, 32)
    grads, buffers = _train_step(_Logits(plain), x)
    our_grads, our_buffers = _train_step(_Logits(ours), x)
    assert grads.keys() == our_grads.keys() and all(torch.equal(grads[k], our_grads[k]) for k in grads)
    assert all(torch.equal(buffers[k], our_buffers[k]) for k in buffers)


class _Logits(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=x).logits


def test_a_model_declaring_whole_classes_it_does_not_hold_is_found_by_structure() -> None:
    """A wrapper's ``_no_split_modules`` may name classes of another model than the one it holds (Gemma3n's vision
    tower: a timm encoder with no declaration of its own inside a Hugging Face wrapper): the blocks are then its
    repeating modules, not none."""

    class Wrapper(nn.Module):
        _no_split_modules = ["LayerOfAnotherModel"]

        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(KeywordLayer(8) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            ones = torch.ones_like(x)
            for layer in self.layers:
                x, _ = layer(x, position=(ones, x * 0), mask=ones)
            return x.sum()

    plan = checkpoint_blocks(Wrapper())
    assert plan.blocks == ["layers.0", "layers.1", "layers.2"]


def test_a_hybrid_vits_convolutional_stem_is_checkpointed_where_timms_switch_does_it() -> None:
    """VitaMin's patch embedding is a convolutional network with a switch of its own (its ``MbConvStages``
    checkpoints its stages under timm's ``set_grad_checkpointing``): its stages are blocks too (without them ours kept
    5.7x the switch's bytes)."""
    timm = pytest.importorskip("timm")
    from lightning_memguard.checkpointing.families import find_units

    model = timm.create_model("vitamin_small_224", pretrained=False, num_classes=4)
    names = [name for name, _ in find_units(model)]
    assert names[:2] == ["patch_embed.backbone.stages.0", "patch_embed.backbone.stages.1"]
    assert names[2:] == [f"blocks.{i}" for i in range(len(model.blocks))]
