"""Planning a budget leaves no trace but the plan: random number generators, warnings and ``plan.blocks``."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from lightning_memguard.checkpointing import checkpoint_blocks


class _Stack(nn.Module):
    """Transformer layers with dropout: each step draws random numbers."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.layers = nn.Sequential(
            *[nn.TransformerEncoderLayer(32, 4, 64, dropout=0.2, batch_first=True) for _ in range(4)]
        )
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(x)).mean()


def _grads_after_one_step(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model(x).backward()
    return [p.grad.clone() for p in model.parameters()]


def test_budget_planning_leaves_the_random_number_generator_as_it_found_it():
    x = torch.randn(8, 16, 32)
    plain, planned = _Stack(), _Stack()
    torch.manual_seed(0)
    expected = _grads_after_one_step(plain, x)
    torch.manual_seed(0)
    plan = checkpoint_blocks(planned, "auto", memory_budget=0.6, example_input=x, loss_fn=lambda out: out)
    assert plan.blocks or plan.parts  # something was checkpointed (blocks, or parts of blocks: which depends on the
    # measured forward times), and measured with dropout on
    got = _grads_after_one_step(planned, x)
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)


def test_warnings_from_applying_a_plan_pass_through_once_and_plan_blocks_says_what_changed():
    x = torch.randn(8, 16, 32)
    model = _Stack()
    wrapped = model.layers[1]
    wrapped.forward = wrapped.forward  # an instance-level forward: someone else's wrapper, to be left alone
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = checkpoint_blocks(model, "auto", memory_budget=0.05, example_input=x, loss_fn=lambda out: out)
    left_alone = [w for w in caught if "wrapped by other code" in str(w.message)]
    assert len(left_alone) == 1
    assert "layers.1" not in plan.blocks
    assert not hasattr(type(wrapped), "_memguard_original")  # really left alone
    assert plan.blocks and all(hasattr(type(model.get_submodule(n)), "_memguard_original") for n in plan.blocks)


@pytest.mark.parametrize("budget", [0.6, "1MB"])
def test_the_plan_runs_the_same_model_after_planning(budget):
    x = torch.randn(8, 16, 32)
    model = _Stack().eval()
    with torch.no_grad():
        before = model(x)
    checkpoint_blocks(model.train(), "auto", memory_budget=budget, example_input=x, loss_fn=lambda out: out)
    with torch.no_grad():
        assert torch.equal(model.eval()(x), before)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


class _Summing(nn.Sequential):
    """A Sequential whose forward is its own: every child sees the input, and the outputs are summed."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(child(x) for child in self)


def test_blocks_of_a_sequential_with_its_own_forward_never_share_a_run():
    from lightning_memguard.checkpointing import apply_plan

    torch.manual_seed(0)
    model = nn.Sequential(_Summing(_Block(), _Block(), _Block()), nn.Linear(8, 1))
    x = torch.randn(4, 8)
    with torch.no_grad():
        before = model(x)
    with pytest.raises(ValueError, match="'0.0' and '0.1' cannot share a run"):
        apply_plan(copy.deepcopy(model), [["0.0", "0.1"]])
    plan = checkpoint_blocks(model, "auto", memory_budget=0.05, example_input=x, loss_fn=lambda out: out.sum())
    assert all(len(run) == 1 for run in plan.runs)
    with torch.no_grad():
        assert torch.equal(model(x), before)
