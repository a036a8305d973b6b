"""Finer links: parts of blocks (a layer's attention and MLP, a ResNet block's downsampling) checkpointed on their own,
or inside their checkpointed block, train exactly as the plain model does, and a budget uses them."""

from __future__ import annotations

import contextlib
import copy

import pytest
import timm
import torch
import torchvision
from conftest import ticking_planner_clocks
from torch import nn

from lightning_memguard.checkpointing import apply_plan, checkpoint_blocks
from lightning_memguard.checkpointing.families import find_units
from lightning_memguard.checkpointing.model_map import link_parts, model_chain


def _step(model: nn.Module, x: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One training step's gradients and the buffers after it, the same seed before it."""
    torch.manual_seed(7)
    model.train()
    model.zero_grad(set_to_none=True)
    model(x).float().pow(2).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, {n: b.clone() for n, b in model.named_buffers()}


def _same(a: nn.Module, b: nn.Module, x: torch.Tensor) -> None:
    (grads_a, buffers_a), (grads_b, buffers_b) = _step(a, x), _step(b, x)
    assert grads_a.keys() == grads_b.keys() and buffers_a.keys() == buffers_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=0, atol=0, msg=name)
    for name in buffers_a:
        torch.testing.assert_close(buffers_a[name], buffers_b[name], rtol=0, atol=0, msg=name)


def _vit() -> nn.Module:
    torch.manual_seed(0)  # dropout everywhere and stochastic depth: recomputation must draw the same numbers
    return timm.create_model(
        "vit_tiny_patch16_224", img_size=32, depth=3, num_classes=5, drop_rate=0.1, proj_drop_rate=0.1,
        attn_drop_rate=0.1, drop_path_rate=0.2,
    )  # fmt: skip


def test_a_transformer_blocks_parts_are_its_attention_and_mlp():
    model = _vit()
    links, _ = model_chain(model, find_units(model))
    parts = link_parts(links)
    assert [(links[i].name, part.name) for i, part in parts[:2]] == [
        ("blocks.0", "blocks.0.attn"),
        ("blocks.0", "blocks.0.mlp"),
    ]
    assert len(parts) == 2 * len(links)


@pytest.mark.parametrize(
    "runs",
    [
        [["blocks.0.mlp"], ["blocks.1.attn"], ["blocks.2.attn"], ["blocks.2.mlp"]],  # parts of unchecked blocks
        [["blocks.0"], ["blocks.0.attn"], ["blocks.0.mlp"], ["blocks.1"], ["blocks.1.mlp"]],  # nested in their block
    ],
    ids=["alone", "nested"],
)
def test_parts_alone_or_nested_train_exactly_as_the_plain_model(runs):
    plain = _vit()
    ours = copy.deepcopy(plain)
    assert apply_plan(ours, runs) == [name for run in runs for name in run]
    assert list(ours.state_dict()) == list(plain.state_dict())
    _same(plain, ours, torch.randn(2, 3, 32, 32))


def test_a_part_holding_batchnorm_nested_in_its_block_updates_the_statistics_once():
    torch.manual_seed(0)
    plain = torchvision.models.resnet18(num_classes=10)
    ours = copy.deepcopy(plain)
    runs = [["layer2.0"], ["layer2.0.downsample"], ["layer3.0.downsample"]]
    assert apply_plan(ours, runs) == ["layer2.0", "layer2.0.downsample", "layer3.0.downsample"]
    _same(plain, ours, torch.randn(4, 3, 32, 32))


def test_a_part_that_is_not_in_the_model_is_refused_by_name():
    with pytest.raises(ValueError, match="no block named 'blocks.0.norm1'"):
        apply_plan(_vit(), [["blocks.0.norm1"]])  # a leaf module is no part


def test_a_budget_between_every_block_and_none_checkpoints_parts_and_trains_exactly(monkeypatch):
    """A budget a few blocks' worth under the plain peak: the planner takes the parts that free the most per
    millisecond of recomputation, and the plan, applied again by its runs on a fresh copy, is the same model.

    The forward times come from a clock that ticks once a reading, not from this machine's speed (under load, a
    block timed faster than its parts made the plan take the block whole): a part's forward is one tick, a block's
    the ticks of its parts' readings inside it, as in a real forward a block takes longer than each of its parts."""
    ticking_planner_clocks(monkeypatch)
    plain = _vit()
    x = torch.randn(4, 3, 32, 32)
    ours = copy.deepcopy(plain)
    plan = checkpoint_blocks(ours, memory_budget=0.7, example_input=x, loss_fn=lambda out: out.float().pow(2).mean())
    assert plan.held, plan.summary()
    assert plan.parts and all(name.rpartition(".")[0] in {f"blocks.{i}" for i in range(3)} for name in plan.parts)
    assert "part(s) of blocks" in plan.summary()
    assert plan.measured_bytes is not None and plan.measured_bytes <= plan.budget_bytes
    _same(plain, ours, x)
    again = copy.deepcopy(plain)
    assert apply_plan(again, plan.runs) == [name for run in plan.runs for name in run]
    _same(plain, again, x)


@pytest.mark.parametrize(("gain", "nested"), [(10, 6), (1, 0)])
def test_parts_nested_in_their_blocks_are_kept_only_where_they_lower_the_floor(monkeypatch, gain, nested):
    """Where every block is not enough, parts nested in the blocks (their recomputation holds less at once, for a
    third forward) are kept if they lower the floor by at least 1 %, else the whole blocks alone are the plan."""
    from lightning_memguard.checkpointing.measure import StepMeter
    from lightning_memguard.checkpointing.wrap import is_checkpointed

    measured = []

    def peak(self):  # the measured peak as a function of what is checkpointed: 100 a block, ``gain`` a nested part
        blocks = list(self.model.blocks)
        whole = sum(is_checkpointed(b) for b in blocks)
        inside = sum(is_checkpointed(p) for b in blocks if is_checkpointed(b) for p in (b.attn, b.mlp))
        measured.append(inside)
        alone = sum(is_checkpointed(p) for b in blocks if not is_checkpointed(b) for p in (b.attn, b.mlp))
        return 1000 - 100 * whole - 30 * alone - gain * inside

    monkeypatch.setattr(StepMeter, "peak", peak)
    model = _vit()
    with pytest.warns(UserWarning, match="budget not met"):
        plan = checkpoint_blocks(model, memory_budget=0.5, example_input=torch.randn(2, 3, 32, 32))
    assert plan.blocks == ["blocks.0", "blocks.1", "blocks.2"]
    assert len(plan.parts) == nested and plan.measured_bytes == 700 - gain * nested
    assert sum(is_checkpointed(m) for m in model.modules()) == 3 + nested  # the model is as the plan says
    if not nested:  # every part nested at once is measured first: no better, so no search of them
        assert [m for m in measured if m] == [6], measured


def test_a_block_that_is_a_whole_stage_has_its_blocks_as_parts_and_trains_exactly():
    """timm's switch checkpoints RepViT's stages whole, and so are its blocks here: each block of a stage is a finer
    link, alone or nested in its checkpointed stage (BatchNorm updated once)."""
    torch.manual_seed(0)
    plain = timm.create_model("repvit_m1", num_classes=10)
    links, _ = model_chain(plain, find_units(plain))
    assert [link.name for link in links][:2] == ["stages.0", "stages.1"]
    names = [part.name for _, part in link_parts(links)]
    assert names[:4] == ["stages.0.blocks.0", "stages.0.blocks.1", "stages.1.downsample", "stages.1.blocks.0"]
    ours = copy.deepcopy(plain)
    runs = [["stages.0.blocks.1"], ["stages.1"], ["stages.1.blocks.0"], ["stages.1.blocks.1"]]
    assert apply_plan(ours, runs) == [name for run in runs for name in run]
    _same(plain, ours, torch.randn(2, 3, 64, 64))


class _ScalesItsInput(nn.Module):
    """A part that scales what its block hands it in place before its MLP: fine unchecked (nothing saved the input
    before), but a checkpoint's recomputation would see the input scaled twice."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(8, 256), nn.GELU(), nn.Linear(256, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return self.fc2(self.act(self.fc1(x)))


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre, self.part, self.post = nn.Linear(8, 8), _ScalesItsInput(), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.post(self.part(self.pre(x)))


@pytest.mark.parametrize("nested", [False, True], ids=["alone", "nested"])
def test_a_part_that_changes_its_input_in_place_is_left_to_its_block(monkeypatch, nested):
    """Checkpointed alone, such a part fails in backward; nested in its checkpointed layer, its recomputation runs on
    the scaled input and the gradients are wrong. The budget leaves it out and checkpoints whole layers instead."""
    from lightning_memguard.checkpointing.measure import StepMeter
    from lightning_memguard.checkpointing.wrap import is_checkpointed

    torch.manual_seed(0)
    plain = nn.Sequential(_Layer(), _Layer())
    ours, x = copy.deepcopy(plain), torch.randn(4, 8)
    links, _ = model_chain(plain, find_units(plain))
    assert [part.name for _, part in link_parts(links)] == ["0.part", "1.part"]
    budget, warns = 0.9, contextlib.nullcontext()
    if nested:  # a peak that every layer does not bring under the budget, and that parts nested in them lower
        monkeypatch.setattr(
            StepMeter,
            "peak",
            lambda self: 1000 - sum(100 + 50 * is_checkpointed(m.part) for m in self.model if is_checkpointed(m)),
        )
        budget, warns = 0.5, pytest.warns(UserWarning, match="budget not met")
    with warns:
        plan = checkpoint_blocks(ours, memory_budget=budget, example_input=x, loss_fn=lambda o: o.pow(2).mean())
    assert plan.blocks and not plan.parts, plan.summary()
    _same(plain, ours, x)


def test_a_parts_block_is_no_container_of_blocks_for_compiled_graph_splits():
    """With ``split_graphs`` (under compile, a graph per container of checkpointed blocks), parts do not make their
    blocks containers: the blocks of one ``nn.Sequential`` stay one graph."""
    from lightning_memguard.checkpointing.wrap import GraphSplit

    model = _vit()
    runs = [["blocks.0"], ["blocks.1.mlp"], ["blocks.2.attn"]]
    assert apply_plan(model, runs, split_graphs=True) == ["blocks.0", "blocks.1.mlp", "blocks.2.attn"]
    assert not [name for name, module in model.named_modules() if isinstance(module, GraphSplit)]
