"""A timm model's blocks are what timm's own switch checkpoints (``set_grad_checkpointing``), read from the forward
of each module that carries it, so every block checkpointed keeps no more for backward than the switch: whole stages
where the model's forward checkpoints its stages (StarNet, RepViT, LeViT, DaViT, ...), the stem where it
checkpoints every element of its features (DPN), the blocks of a method the forward calls (VOLO's class-attention
blocks), and not a head that pools first, which the switch leaves (checkpointed, it keeps the feature map it pools)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_memguard.checkpointing.families.timm_switch import switch_units

ROOT = Path(__file__).resolve().parents[2]


class _Stage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.grad_checkpointing = False
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(2)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = checkpoint(blk, x, use_reentrant=False) if self.grad_checkpointing else blk(x)
        return x


def checkpoint_seq(functions: nn.Module, x: torch.Tensor, flatten: bool = False) -> torch.Tensor:
    """timm's helper, as far as this test needs it: one checkpoint per element (per element's element: flatten)."""
    for function in [g for f in functions for g in f] if flatten else functions:
        x = checkpoint(function, x, use_reentrant=False)
    return x


class _Model(nn.Module):
    """Checkpoints its stages whole, the tail's blocks one by one in a method of its own, and a head it never
    checkpoints."""

    def __init__(self) -> None:
        super().__init__()
        self.grad_checkpointing = False
        self.stem = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.stages = nn.Sequential(_Stage(), _Stage())
        self.tail = nn.ModuleList(nn.Sequential(nn.Linear(4, 4)) for _ in range(2))
        self.head = nn.Sequential(nn.Linear(4, 2))

    def forward_tail(self, x: torch.Tensor) -> torch.Tensor:
        for _, block in enumerate(self.tail):  # as timm writes it
            x = checkpoint(block, x, use_reentrant=False) if self.grad_checkpointing else block(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = checkpoint_seq(self.stages, x) if self.grad_checkpointing else self.stages(x)
        return self.head(self.forward_tail(x))


class _Flat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.grad_checkpointing = False
        self.stages = nn.Sequential(*(nn.Sequential(*(nn.Sequential(nn.Linear(4, 4)) for _ in range(2))) for _ in "ab"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint_seq(self.stages[1:], x, flatten=True) if self.grad_checkpointing else self.stages(x)


def test_the_switchs_units_are_read_from_the_forward_outermost_first() -> None:
    names = [name for name, _ in switch_units(_Model())]
    assert names == ["stages.0", "stages.1", "tail.0", "tail.1"]  # the stages' own blocks lie inside their unit
    assert [name for name, _ in switch_units(_Flat())] == ["stages.1.0", "stages.1.1"]  # a slice, flattened


def _coverage():
    spec = importlib.util.spec_from_file_location("benchmark_coverage_switch", ROOT / "benchmarks" / "coverage.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "name",
    [
        "starnet_s050",  # the forward checkpoints whole stages: the declared blocks lie inside them (1.09x before)
        "dpn48b",  # checkpoint_seq over every element of ``features``, the stem's too (1.11x)
        "samvit_base_patch16_224",  # the same blocks; the head is left (1.31x)
    ],
)
def test_every_block_checkpointed_keeps_no_more_than_timms_own_switch(name: str) -> None:
    pytest.importorskip("timm")
    row = _coverage().examine("timm", name, seconds=0)
    assert row["covered"], row["reason"]
    assert row["kept_bytes"]["ours"] <= row["kept_bytes"]["switch"]


def test_a_head_that_pools_first_is_no_block() -> None:
    layers = pytest.importorskip("timm.layers")
    from lightning_memguard.checkpointing.families.timm_declared import pools_first

    assert pools_first(layers.ClassifierHead(8, 10))  # checkpointed, it would keep the feature map it pools
    assert pools_first(nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10)))
    assert not pools_first(layers.ClassifierHead(8, 10, pool_type=""))  # no pooling: a head like any block
    assert not pools_first(nn.Sequential(nn.Linear(8, 8), nn.AdaptiveAvgPool1d(1)))
