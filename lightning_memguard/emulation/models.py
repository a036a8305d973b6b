"""A torchvision classifier on synthetic images, for the demo, the tests and the benchmarks."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import torchvision
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader
from typing_extensions import override


class ImageClassifier(LightningModule):
    """A torchvision classification model trained on random images.

    The images live in a pool on the model's device; each batch from the data loader is a tensor of sample
    indices into that pool. So the data loader costs nothing and timings measure the device, while batch size,
    dataloaders and ``extract_batch_size`` work as in any Lightning project.

    Args:
        arch: any torchvision classification model name (``resnet18``, ``resnet50``, ...), or, with ``net``, the
            name of that network.
        num_classes: output classes.
        image_size: height and width of the square images.
        batch_size: samples per batch (the attribute Lightning's tuners change).
        steps_per_epoch: training batches per epoch.
        val_steps: validation batches per epoch (0: no validation).
        channels_last: keep the model and the images in channels_last memory format.
        pool_size: distinct random images in the pool.
        lr: SGD learning rate.
        seed: seed for the weights and the images.
        net: a network already built (timm's, your own: images in, ``num_classes`` scores out) to train instead of
            building ``arch`` from torchvision.

    Example:
        >>> model = ImageClassifier("resnet18", image_size=32, batch_size=4, steps_per_epoch=2)
        >>> batch = next(iter(model.train_dataloader()))
        >>> batch.shape, model.training_step(batch, 0).ndim
        (torch.Size([4]), 0)
        >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
        ...                           torch.nn.Linear(4, 5))
        >>> own = ImageClassifier("tiny", num_classes=5, image_size=8, batch_size=2, steps_per_epoch=3, net=net)
        >>> own.training_step(next(iter(own.train_dataloader())), 0).ndim
        0
    """

    def __init__(
        self,
        arch: str = "resnet18",
        num_classes: int = 10,
        image_size: int = 32,
        batch_size: int = 32,
        steps_per_epoch: int = 20,
        val_steps: int = 0,
        channels_last: bool = False,
        pool_size: int = 64,
        lr: float = 0.05,
        seed: int = 0,
        net: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["net"])
        self.batch_size = batch_size
        gen = torch.Generator().manual_seed(seed)
        if net is None:
            try:
                builder = torchvision.models.get_model_builder(arch)
            except ValueError as err:
                raise ValueError(f"`arch` must be a torchvision classification model name, got {arch!r}") from err
            with torch.random.fork_rng():
                torch.manual_seed(seed)
                net = builder(weights=None, num_classes=num_classes)
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        self.net = net.to(memory_format=fmt)  # type: ignore[call-overload]
        images = torch.randn(pool_size, 3, image_size, image_size, generator=gen).contiguous(memory_format=fmt)
        self.register_buffer("images", images, persistent=False)
        self.register_buffer("labels", torch.randint(0, num_classes, (pool_size,), generator=gen), persistent=False)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        images: torch.Tensor = self.images  # type: ignore[assignment]
        labels: torch.Tensor = self.labels  # type: ignore[assignment]
        idx = batch % images.shape[0]
        return F.cross_entropy(self(images[idx]), labels[idx])

    @override
    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True, batch_size=batch.shape[0])
        return loss

    @override
    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), batch_size=batch.shape[0])

    @override
    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.hparams["lr"], momentum=0.9)

    @override
    def train_dataloader(self) -> DataLoader:
        return _index_loader(self.hparams["steps_per_epoch"] * self.batch_size, self.batch_size)

    @override
    def val_dataloader(self) -> DataLoader:
        return _index_loader(max(self.hparams["val_steps"], 0) * self.batch_size, self.batch_size)


class ShardedClassifier(ImageClassifier):
    """An :class:`ImageClassifier` sharded as ``ModelParallelStrategy`` asks: FSDP2's ``fully_shard`` on every residual
    block, then on the network, in ``configure_model`` (nothing is sharded under other strategies); AdamW, so the
    optimizer holds state. ``fully_shard`` takes contiguous weights only: leave ``channels_last`` off.

    Example:
        >>> from lightning.pytorch import Trainer
        >>> from lightning.pytorch.strategies import ModelParallelStrategy
        >>> model = ShardedClassifier("resnet18", image_size=16, batch_size=4, steps_per_epoch=2)
        >>> strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
        >>> trainer = Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=1, logger=False)
    """

    @override
    def configure_model(self) -> None:
        from torch.distributed.fsdp import FSDPModule, fully_shard
        from torchvision.models.resnet import BasicBlock, Bottleneck

        if self.device_mesh is None or isinstance(self.net, FSDPModule):  # not sharded here, or already
            return
        mesh = self.device_mesh["data_parallel"]
        for module in self.net.modules():
            if isinstance(module, BasicBlock | Bottleneck):
                fully_shard(module, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    @override
    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"] / 50)


def _index_loader(length: int, batch_size: int) -> DataLoader:
    """Batches of sample indices: ``torch.arange`` is a map-style dataset of ``length`` items."""
    return DataLoader(torch.arange(length), batch_size=batch_size)  # type: ignore[arg-type]
