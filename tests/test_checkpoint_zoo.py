"""Blocks found by structure across torchvision's classification models: every model is found, trains, and keeps
its gradients and BatchNorm buffers bit-identical to the plain model's, with a memory budget and without."""

from __future__ import annotations

import copy

import pytest
import torch
import torchvision
from torch import nn

from lightning_memguard.checkpointing import checkpoint_blocks, find_units

# (builder, keyword arguments for a small model, input size, the class the blocks must be)
ZOO = [
    ("resnet18", {}, 32, "BasicBlock"),
    ("resnext50_32x4d", {}, 32, "Bottleneck"),
    ("wide_resnet50_2", {}, 32, "Bottleneck"),
    ("mobilenet_v2", {}, 32, "InvertedResidual"),
    ("mobilenet_v3_small", {}, 32, "InvertedResidual"),
    ("efficientnet_b0", {}, 32, "MBConv"),
    ("mnasnet0_5", {}, 32, "_InvertedResidual"),
    ("shufflenet_v2_x0_5", {}, 32, "InvertedResidual"),
    ("convnext_tiny", {}, 32, "CNBlock"),
    ("regnet_y_400mf", {}, 32, "ResBottleneckBlock"),
    ("densenet121", {}, 32, None),  # dense layers and transitions
    ("vit_b_16", {"image_size": 32}, 32, "EncoderBlock"),
    ("swin_t", {}, 32, None),  # Swin blocks and patch merging
    ("maxvit_t", {}, 224, "MaxVitBlock"),  # its partitions need 224 px
]


def _build(name: str, kwargs: dict) -> nn.Module:
    torch.manual_seed(0)
    return torchvision.models.get_model(name, weights=None, num_classes=10, **kwargs)


def _step(model: nn.Module, x: torch.Tensor) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    torch.manual_seed(1)  # dropout and stochastic depth draw the same numbers in every run
    model.train()
    model(x).square().mean().backward()
    grads = [p.grad.clone() if p.grad is not None else None for p in model.parameters()]
    return grads, {k: v.clone() for k, v in model.state_dict().items() if "running" in k or "num_batches" in k}


def _same(a, b) -> None:
    (grads_a, bufs_a), (grads_b, bufs_b) = a, b
    assert len(grads_a) == len(grads_b)
    for g, h in zip(grads_a, grads_b, strict=True):
        assert (g is None and h is None) or torch.equal(g, h)
    assert bufs_a.keys() == bufs_b.keys()
    for key in bufs_a:
        assert torch.equal(bufs_a[key], bufs_b[key]), key


@pytest.mark.slow
@pytest.mark.parametrize(("name", "kwargs", "size", "block"), ZOO, ids=[z[0] for z in ZOO])
def test_every_torchvision_model_is_found_trains_and_stays_bit_identical(name, kwargs, size, block):
    plain = _build(name, kwargs)
    x = torch.randn(2, 3, size, size)
    found = find_units(plain)
    assert len(found) >= 2
    if block is not None:
        assert {type(m).__name__ for _, m in found} == {block}
    expected = _step(copy.deepcopy(plain), x)

    every = copy.deepcopy(plain)
    plan = checkpoint_blocks(every)
    assert set(plan.blocks) >= {n for n, _ in found}  # and a ResNet's stem
    _same(expected, _step(every, x))

    budgeted = copy.deepcopy(plain)
    torch.manual_seed(1)
    plan = checkpoint_blocks(budgeted, memory_budget=0.6, example_input=x)
    assert plan.blocks
    _same(expected, _step(budgeted, x))


def test_hugging_face_declared_units_come_first():
    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x)

    class Embeddings(Layer):
        pass

    class PreTrained(nn.Module):
        _no_split_modules = ["Embeddings", "Layer"]

        def __init__(self) -> None:
            super().__init__()
            self.embeddings = Embeddings()
            self.layer = nn.ModuleList([Layer(), Layer(), Layer()])

    names = [n for n, _ in find_units(PreTrained())]
    assert names == ["embeddings", "layer.0", "layer.1", "layer.2"]


def test_a_model_with_no_repeating_structure_is_a_clear_error():
    with pytest.raises(ValueError, match="no blocks to checkpoint found in Sequential with units='auto'"):
        find_units(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)))
