"""A tiny Hugging Face GPT-2 held by a LightningModule, as users hold one (``self.model``, its loss from
``forward(labels=...)``), and its token data: for the levers' tests in a Trainer, one process or two."""

from __future__ import annotations

import torch
import transformers
from lightning.pytorch import LightningModule
from torch.utils.data import DataLoader, Dataset

CONFIG = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
              attn_pdrop=0.0)  # fmt: skip
"""The brief's small config, dropout off: the same numbers with and without the levers."""


class Tokens(Dataset):
    """Random token sequences, each a dict of the model's inputs and its labels."""

    def __init__(self, n: int = 16, length: int = 32) -> None:
        generator = torch.Generator().manual_seed(1)
        self.tokens = torch.randint(0, CONFIG["vocab_size"], (n, length), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


class LanguageModel(LightningModule):
    """A tiny GPT-2 as ``self.model``; ``training_step`` calls ``self.model(input_ids=..., labels=...).loss``."""

    def __init__(self, seed: int = 0, batch_size: int = 8) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**CONFIG))
        self.batch_size = batch_size

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        return self.model(input_ids=input_ids, labels=labels)

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(Tokens(), batch_size=self.batch_size)
