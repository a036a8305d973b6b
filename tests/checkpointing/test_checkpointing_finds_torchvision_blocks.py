"""Blocks found by structure across torchvision's classification models: every model is found, trains, and keeps
its gradients and BatchNorm buffers bit-identical to the plain model's, with a memory budget and without."""

from __future__ import annotations

import copy

import pytest
import torch
import torchvision
from torch import nn

from lightning_memguard.checkpointing import checkpoint_blocks, find_units


def _small(name: str):
    """Each family at a small size: the same block classes and structure, a fraction of the compute."""
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt
    from torchvision.models.maxvit import MaxVit
    from torchvision.models.resnet import Bottleneck, ResNet
    from torchvision.models.swin_transformer import SwinTransformer

    small = {
        "resnext": lambda: ResNet(Bottleneck, [2, 1, 1, 1], groups=8, width_per_group=4, num_classes=10),
        "wide_resnet": lambda: ResNet(Bottleneck, [2, 1, 1, 1], width_per_group=128, num_classes=10),
        "convnext": lambda: ConvNeXt([CNBlockConfig(16, 32, 2), CNBlockConfig(32, None, 1)], num_classes=10),
        "densenet": lambda: torchvision.models.DenseNet(8, (2, 2, 2, 2), 16, num_classes=10),
        "vit": lambda: torchvision.models.VisionTransformer(32, 8, 3, 2, 32, 64, num_classes=10),
        "swin": lambda: SwinTransformer([4, 4], 24, [2, 2], [2, 2], [4, 4], stochastic_depth_prob=0.2, num_classes=10),
        "maxvit": lambda: MaxVit((32, 32), 16, 2, [16, 32], [1, 1], 8, stochastic_depth_prob=0.2, num_classes=10),
    }
    torch.manual_seed(0)
    if name in small:
        return small[name]()
    return torchvision.models.get_model(name, weights=None, num_classes=10)


# (model, input size, the class the blocks must be)
ZOO = [
    ("resnet18", 32, "BasicBlock"),
    ("resnext", 32, "Bottleneck"),
    ("wide_resnet", 32, "Bottleneck"),
    ("mobilenet_v2", 32, "InvertedResidual"),
    ("mobilenet_v3_small", 32, "InvertedResidual"),
    ("efficientnet_b0", 32, "MBConv"),
    ("mnasnet0_5", 32, "_InvertedResidual"),
    ("shufflenet_v2_x0_5", 32, "InvertedResidual"),
    ("convnext", 32, "CNBlock"),
    ("regnet_y_400mf", 32, "ResBottleneckBlock"),
    ("densenet", 32, None),  # dense layers and transitions
    ("vit", 32, "EncoderBlock"),
    ("swin", 32, None),  # Swin blocks and patch merging
    ("maxvit", 32, "MaxVitBlock"),
]


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


@pytest.mark.parametrize(("name", "size", "block"), ZOO, ids=[z[0] for z in ZOO])
def test_every_torchvision_model_is_found_trains_and_stays_bit_identical(name, size, block):
    plain = _small(name)
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
    # something is checkpointed within the budget: whole blocks, or parts of blocks (a ConvNeXt CNBlock's `block`),
    # which depends on the measured forward times
    assert (plan.blocks or plan.parts) and plan.held, plan.summary()
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


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


class _Head(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class _MultiHead(nn.Module):
    """A trunk of repeated blocks and repeated small heads: both repeat as elements of a chain."""

    def __init__(self, embedding: int = 0) -> None:
        super().__init__()
        self.embed = nn.Embedding(embedding, 32) if embedding else None
        self.trunk = nn.Sequential(*[_Block(32) for _ in range(4)])
        self.heads = nn.ModuleList([_Head(32) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.trunk(self.embed(x) if self.embed is not None else x)
        return sum(head(h) for head in self.heads)


def test_the_blocks_found_are_those_carrying_most_of_the_parameters():
    model = _MultiHead()
    assert [n for n, _ in find_units(model)] == ["trunk.0", "trunk.1", "trunk.2", "trunk.3"]  # not the heads
    plan = checkpoint_blocks(model)
    assert plan.blocks == ["trunk.0", "trunk.1", "trunk.2", "trunk.3"]
    # an embedding larger than everything repeated: no class carries most, so every one is a block
    names = [n for n, _ in find_units(_MultiHead(embedding=5000))]
    assert names == ["trunk.0", "trunk.1", "trunk.2", "trunk.3", "heads.0", "heads.1", "heads.2"]
    # an encoder's layers beside a decoder's, which carry more: both are blocks
    transformer = nn.Transformer(16, 2, 2, 2, 32, batch_first=True)
    kinds = [type(m).__name__ for _, m in find_units(transformer)]
    assert kinds == ["TransformerEncoderLayer"] * 2 + ["TransformerDecoderLayer"] * 2
