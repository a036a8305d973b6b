"""A plan reads the model's map once: the families' registry is asked about each module once per plan, however many
times the plan changes the model (checkpointing/model_map.py)."""

from __future__ import annotations

import collections
from collections.abc import Callable

import pytest
import torch
import torchvision

from lightning_memguard.checkpointing import apply_plan, checkpoint_blocks
from lightning_memguard.checkpointing.families import Layout

ASKED_OF_A_MODULE = ("norm_activations", "tail", "unit", "wrapped_by_someone_else", "stem_of")


def _counting(monkeypatch: pytest.MonkeyPatch) -> collections.Counter[tuple[str, int]]:
    """Counts each question the registry's ``Layout`` is asked about one module, by question and module."""
    asked: collections.Counter[tuple[str, int]] = collections.Counter()

    def counted(name: str) -> Callable[..., object]:
        real = getattr(Layout, name)

        def ask(self: Layout, module: torch.nn.Module) -> object:
            asked[(name, id(module))] += 1
            return real(self, module)

        return ask

    for name in ASKED_OF_A_MODULE:
        monkeypatch.setattr(Layout, name, counted(name))
    return asked


def _budget_with_rebuild(model: torch.nn.Module) -> None:
    """The rebuild, then each measured set of blocks applied in turn, replacing the set before."""
    checkpoint_blocks(model, memory_budget=0.6, example_input=torch.randn(2, 3, 32, 32), rebuild_bn_relu=True)


def _plan_applied_again(model: torch.nn.Module) -> None:
    apply_plan(model, [["stem"], ["layer1.0", "layer1.1"], ["layer4.1"]], rebuild_bn_relu=True)


@pytest.mark.parametrize("plan", [_budget_with_rebuild, _plan_applied_again])
def test_the_registry_is_asked_about_each_module_once_per_plan(monkeypatch, plan):
    model = torchvision.models.resnet18(num_classes=10)
    asked = _counting(monkeypatch)
    plan(model)
    # once, however often the plan changed the model
    assert max(asked.values()) == 1, [question for question, times in asked.items() if times > 1][:3]
