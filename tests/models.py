"""Models for the spill tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch.utils.data import DataLoader, TensorDataset

from lightning_memguard.testing import ImageClassifier


class GrowingClassifier(ImageClassifier):
    """From training step ``grow_at`` on, the images are upsampled: activation memory grows mid-run."""

    def __init__(self, *args, grow_at: int = 10**9, scale: int = 4, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.grow_at = grow_at
        self.scale = scale

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        idx = batch % self.images.shape[0]
        images = self.images[idx]
        if self.training and self.trainer.global_step >= self.grow_at:
            images = F.interpolate(images, scale_factor=self.scale)
        return F.cross_entropy(self(images), self.labels[idx])


def small_classifier(**kwargs) -> ImageClassifier:
    defaults = dict(arch="resnet18", image_size=16, batch_size=8, steps_per_epoch=12, pool_size=16)
    defaults.update(kwargs)
    return ImageClassifier(**defaults)


def small_resnet(seed: int = 0, num_classes: int = 10) -> torch.nn.Module:
    """A torchvision ResNet of BasicBlocks as resnet18, one block a stage: the same stem, stages and head, half the
    blocks, so about half of resnet18's time to compile, for the tests whose checks hold for any such ResNet."""
    import torchvision
    from torchvision.models.resnet import BasicBlock

    torch.manual_seed(seed)
    return torchvision.models.ResNet(BasicBlock, [1, 1, 1, 1], num_classes=num_classes)


def one_block_a_stage(model: ImageClassifier, seed: int = 0) -> ImageClassifier:
    """``model`` with its resnet18 replaced by :func:`small_resnet`, for the compiled scenarios whose checks hold for
    any such ResNet."""
    with torch.random.fork_rng():
        model.net = small_resnet(seed, model.hparams["num_classes"])
    return model


def tiny_convnet(model: ImageClassifier, seed: int = 0) -> ImageClassifier:
    """``model`` with its network replaced by one convolution, BatchNorm and a linear head: seconds to compile, for a
    compiled scenario whose checks are about the ranks, not the network."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model.net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, model.hparams["num_classes"]),
        )  # fmt: skip
    return model


WIDTH = 256


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.act, self.down = (
            torch.nn.Linear(width, 4 * width),
            torch.nn.GELU(),
            torch.nn.Linear(4 * width, width),
        )

    def forward(self, x):
        return x + self.down(self.act(self.up(x)))


class Blocks(LightningModule):
    """Four residual MLP blocks and a wide head outside them: a step starts from 50.74 MB (weights, gradients,
    momentum) and saves 4.52 MB at batch 64 (70.7 kB a sample), 2.4 MB with every block checkpointed (the head's).

    A learning rate low enough that float32's rounding, summed in another order where a batch is split, stays at
    rounding's size over the run's 16 steps (at 0.05, a ReLU of the head flipped by it made the weights differ by 2 %
    of their change on one CPU and not on another)."""

    def __init__(self, n: int = 64 * 8) -> None:
        super().__init__()
        self.bs = 64
        self.stem = torch.nn.Linear(16, WIDTH)
        self.blocks = torch.nn.ModuleList(Block(WIDTH) for _ in range(4))
        self.head = torch.nn.Sequential(torch.nn.Linear(WIDTH, 8192), torch.nn.ReLU(), torch.nn.Linear(8192, 2))
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 16, generator=gen)
        self.y = torch.randint(0, 2, (n,), generator=gen)
        self.ooms = 0  # raise CUDA's out-of-memory error in the next training steps, this many times

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch, batch_idx):
        if self.ooms and self.training:  # not the check of the loss's weighting (in eval mode, a few samples)
            self.ooms -= 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.x, self.y), batch_size=self.bs, shuffle=True)
