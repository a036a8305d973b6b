"""Offload in the levers' planner, on the CPU with copy streams injected (each copy made at once, into plain host
memory): a block checkpointed whole with its input offloaded frees that input too, below the floor recomputation
reaches (every block's input), and the plan holds a budget recomputation cannot; the planner's measurement counts
what an offload keeps on the device and not what it moves; the gradients are the plain model's, bit for bit. The
same plan on a CUDA card, with its side streams: tests/gpu/test_gpu_offload.py."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from conftest import ticking_planner_clocks
from torch import nn

from lightning_memguard.checkpointing import apply_plan, is_checkpointed
from lightning_memguard.checkpointing.measure import StepMeter
from lightning_memguard.checkpointing.model_map import map_model
from lightning_memguard.levers.choose import LeverPlan, LinkOption, choose_levers
from lightning_memguard.levers.offload import ActivationOffload, HostCopies
from lightning_memguard.levers.plan_levers import block_input_bytes, plan_levers

WIDTH, ROWS = 512, 1024  # each block's input: 2 MiB of float32, above the offload's 1 MiB floor
MIB = 2**20


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(Block() for _ in range(4)))


def _example() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(ROWS, WIDTH, requires_grad=True)


def _gradients(model: nn.Module, x: torch.Tensor, offload: ActivationOffload | None = None) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    x.grad = None
    if offload is None:
        model(x).square().mean().backward()
    else:
        with offload:
            model(x).square().mean().backward()
    return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]


def _loss(output: torch.Tensor) -> torch.Tensor:
    return output.square().mean()


def _plan(model: nn.Module, budget: float, **kwargs) -> LeverPlan:
    return plan_levers(model, _example(), budget, units=[Block], loss_fn=_loss, pointwise=False, **kwargs)


def test_a_block_with_its_input_offloaded_holds_a_budget_below_the_floor_of_recomputation_with_the_same_gradients(
    monkeypatch,
):
    ticking_planner_clocks(monkeypatch)  # each link's time from the step's structure, not this machine's load
    plain = _model()
    x = _example()
    expected = _gradients(plain, x)
    # recomputation alone: every block checkpointed, the floor is the inputs the checkpoints keep (blocks 1-3's; the
    # batch existed before) and the loss's (the last block's output, which `square` saves)
    recomputed = plan_levers(_model(), x, 0.12, units=[Block], loss_fn=_loss, pointwise=False)
    assert not recomputed.held and sorted(recomputed.kinds()) == ["block"]
    assert recomputed.measured_bytes == 4 * ROWS * WIDTH * 4
    # with offload, at a slow link (its copies of whole blocks show; an input's copies cost less than recomputing)
    model = _model()
    copies = HostCopies()
    plan = _plan(model, 0.12, offload=True, offload_streams=copies, bandwidth_gb_s=0.05, max_host_bytes="1GB")
    assert plan.held and plan.measured_bytes < recomputed.measured_bytes
    offloaded = plan.kinds()["block_offload"]
    assert offloaded and set(offloaded) <= set(plan.checkpointed)  # checkpointed whole, and offloaded
    assert all(is_checkpointed(model[int(name)]) for name in plan.checkpointed)
    assert plan.offload is not None and plan.offload.offloaded == [int(name) for name in offloaded]
    assert plan.measured_bytes == plan.predicted_bytes  # the input it moves is the one the prediction freed
    assert "block recomputed, its input offloaded in" in plan.summary()
    assert plan.offloaded == offloaded  # the modules, by name: here the links' own
    with pytest.raises(ValueError, match="offload is a context around the training steps"):
        plan.record()
    # the plan's calls, run on a fresh copy (its ActivationOffload with the test's copies): the same levers
    fresh = _model()
    calls = {"model": fresh, "apply_plan": apply_plan,
             "ActivationOffload": functools.partial(ActivationOffload, streams=HostCopies())}  # fmt: skip
    for line in plan.calls():
        exec(line, calls)  # noqa: S102 - the plan's own advice, as a user would paste it
    again = calls["offload"]
    assert [name for name in plan.checkpointed if is_checkpointed(fresh.get_submodule(name))] == plan.checkpointed
    assert again.blocks == [fresh.get_submodule(name) for name in offloaded]
    assert all(torch.equal(a, b) for a, b in zip(_gradients(fresh, x, again), expected, strict=True))
    assert again.moved_bytes == len(offloaded) * ROWS * WIDTH * 4
    # the gradients through the plan's levers, its offload entered: the plain model's, bit for bit
    copies.to_host_calls = 0
    got = _gradients(model, x, plan.offload)
    assert plan.offload.max_host_bytes == 10**9  # the planner's host bound is the offload's own
    assert copies.to_host_calls == len(offloaded)  # one tensor each: the block's input, what its checkpoint saves
    assert plan.offload.block_bytes == {int(name): ROWS * WIDTH * 4 for name in offloaded}
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_the_planners_measurement_counts_what_an_offload_keeps_on_the_device_and_not_what_it_moves():
    x = _example()
    model = _model()
    plain = StepMeter(model, x, _loss).peak()
    # every tensor under the offload's floor: all kept on the device, all counted as without it
    keeping = ActivationOffload(list(model), min_bytes=64 * MIB, streams=HostCopies())
    with keeping:
        assert StepMeter(model, x, _loss).peak() == plain
    assert keeping.moved_bytes == 0
    # block 0 offloaded: what it moved is off the device, what it kept (nothing here) is counted
    moving = ActivationOffload(list(model), offloaded=[0], streams=HostCopies())
    with moving:
        offloaded = StepMeter(model, x, _loss).peak()
    assert moving.moved_bytes > 0 and offloaded == plain - moving.moved_bytes
    # a checkpointed block's input moved by an offload is not counted either; without the offload it is
    apply_plan(model, [["1"], ["2"], ["3"]], units=[Block])
    checkpointed = StepMeter(model, x, _loss).peak()
    inputs = ActivationOffload(list(model), offloaded=[1, 2, 3], streams=HostCopies())
    with inputs:
        assert StepMeter(model, x, _loss).peak() == checkpointed - inputs.moved_bytes
    assert inputs.block_bytes == {i: ROWS * WIDTH * 4 for i in (1, 2, 3)}


def test_the_chooser_takes_a_block_with_its_input_offloaded_only_below_what_recomputation_frees():
    links = {
        f"h.{i}": [LinkOption("block", 100, 5.0), LinkOption("block_offload", 120, 5.5, host_bytes=32)]
        for i in range(3)
    }
    assert {o.kind for o in choose_levers(links, need=300).links.values()} == {"block"}  # recomputation does it
    below = choose_levers(links, need=330)  # beyond the floor of recomputation (300): inputs offloaded
    assert sorted(o.kind for o in below.links.values()) == ["block", "block_offload", "block_offload"]
    assert (below.freed_bytes, below.host_bytes) == (340, 64)
    assert choose_levers(links, need=330, host_limit=0).freed_bytes == 300  # no host memory: the floor


def test_a_plan_measured_at_zero_bytes_is_held():
    plan = LeverPlan(False, {"h.0": LinkOption("offload", 10, 1.0)}, 100, 50, measured_bytes=0)
    assert plan.held and plan.peak_bytes == 0
    assert "measured 0 B" in plan.summary() and "not met" not in plan.summary()


def test_offload_is_not_offered_on_the_cpu_where_it_would_move_nothing(monkeypatch):
    ticking_planner_clocks(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not even ActivationOffload's "does nothing on the CPU"
        plan = _plan(_model(), 0.12, offload=True)
    assert sorted(plan.kinds()) == ["block"] and plan.offload is None and not plan.held


def test_the_offload_of_a_plan_holds_the_blocks_of_the_chain_it_names_past_a_stem_of_several_modules(monkeypatch):
    ticking_planner_clocks(monkeypatch)
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    images = torch.randn(16, 3, 64, 64)
    # the stem (conv1, bn1, relu, maxpool) is a link, but not one of the offload's chain: its indices skip it
    plan = plan_levers(model, images, 0.5, pointwise=False, offload=True, offload_streams=HostCopies())
    offloaded = plan.kinds().get("offload", [])
    assert offloaded and "stem" not in offloaded and plan.offloaded == offloaded
    assert [plan.offload.blocks[i] for i in plan.offload.offloaded] == [model.get_submodule(n) for n in offloaded]
    # a ResNet block's input is the block before's ReLU output: offloading it frees nothing unless that block is
    # checkpointed too, so no block is offered with its input offloaded
    assert "block_offload" not in plan.kinds()


class Decoder(nn.Module):
    """A decoder layer: its own input, and the encoder's output it is given as every decoder layer is."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.own = nn.Linear(WIDTH, WIDTH)
        self.cross = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        return x + self.own(self.norm(x)) + self.cross(memory)


class EncoderDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(WIDTH, WIDTH)
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.layers = nn.ModuleList(Decoder() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        memory, h = torch.tanh(self.encoder(x)), self.embed(x)
        for layer in self.layers:
            h = layer(h, memory)
        return h


def test_an_input_other_links_are_given_too_is_not_counted_as_freed_by_offloading_one_links():
    torch.manual_seed(0)
    model = EncoderDecoder()
    links = map_model(model, [Decoder]).links
    profiles = StepMeter(model, _example(), _loss).profile(links)
    tensor = ROWS * WIDTH * 4
    # layer 0 is charged its own input and the encoder's output (it saved it first); layer 1 its own input only
    assert [p.input_bytes for p in profiles] == [2 * tensor, tensor]
    assert profiles[0].input_storages == ((tensor, False), (tensor, True)) or profiles[0].input_storages == (
        (tensor, True),
        (tensor, False),
    )
    # offloading layer 0's input frees its own: the encoder's output stays, layer 1 keeps it
    assert [block_input_bytes(profiles, i) for i in range(2)] == [tensor, tensor]
    assert block_input_bytes(profiles, 0, min_bytes=tensor + 1) == 0  # under the offload's floor: kept, not freed
