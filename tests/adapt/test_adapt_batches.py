"""MemGuard(on_spill="adapt") with the batches, outputs and losses Lightning users write: lists of names beside the
tensors, outputs read by callbacks, losses that are sums, token means over padded labels, or couple the samples."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import trainer_kwargs
from lightning.pytorch import Callback, Trainer
from test_adapt import TAKEN, SamplesProbe, Validated, Wide, _close, _run
from torch.utils.data import DataLoader, Dataset

from lightning_memguard import MemGuard
from lightning_memguard._lightning.batches import split_batch


def _trained(model, tmp_path) -> list[torch.Tensor]:
    """The weights of the same run (one epoch) without MemGuard, nothing spilling."""
    torch.manual_seed(0)
    plain = model()
    Trainer(**trainer_kwargs(tmp_path / "plain", max_epochs=1)).fit(plain)
    return [p.detach().clone() for p in plain.parameters()]


class Outputs(Callback):
    """What the hooks after each batch receive: the samples its outputs' predictions cover."""

    def __init__(self) -> None:
        self.train: list[int] = []
        self.validation: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.train.append(len(outputs["preds"]))

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.validation.append(len(outputs["preds"]))


class WithPredictions(Wide):
    """Returns its predictions beside its loss, in training and validation (batches of 64 to validate: they spill)."""

    def __init__(self, probe: SamplesProbe | None = None) -> None:
        super().__init__()
        self.probe = probe

    def forward(self, x):
        if self.probe is not None:
            self.probe.most = max(self.probe.most, len(x))
        return super().forward(x)

    def training_step(self, batch, batch_idx):
        out = self(batch[0])
        return {"loss": torch.nn.functional.cross_entropy(out, batch[1]), "preds": out.argmax(1)}

    def validation_step(self, batch, batch_idx):
        out = self(batch[0])
        return {"preds": out.argmax(1), "val_loss": torch.nn.functional.cross_entropy(out, batch[1])}

    val_dataloader = Validated.val_dataloader


def test_split_batches_give_every_hook_the_whole_batchs_outputs(tmp_path):
    outputs = Outputs()
    trainer, guard, events, model = _run(
        tmp_path, others={4: TAKEN}, model=WithPredictions, max_epochs=1, callbacks=[outputs]
    )
    assert guard.adaptations and events.micro_batches[-1] == [16, 16]
    assert outputs.train == [32] * 12  # before: the last micro-batch's 16 once split

    probe = SamplesProbe()  # validation batches of 64 spill, training's of 32 fit
    torch.manual_seed(0)
    model = WithPredictions(probe)
    seen = Outputs()
    guard = MemGuard(on_spill="adapt", probe=probe, read_every=1, warmup_steps=1, spill_checkpoint=False)
    kwargs = trainer_kwargs(tmp_path / "val", max_epochs=2, callbacks=[guard, seen], limit_val_batches=1.0)
    with pytest.warns(RuntimeWarning, match="validation batches now run as 32 x 2"):
        Trainer(**kwargs).fit(model)
    assert seen.validation == [64, 64] * 2  # before: [64, 64, 32, 32]


class Counting(WithPredictions):
    def validation_step(self, batch, batch_idx):
        self(batch[0])
        return {"preds": torch.zeros(len(batch[0])), "correct": 3}  # a count: halves' counts cannot be joined


def test_validation_whose_outputs_cannot_be_joined_is_not_split_saying_why(tmp_path):
    probe = SamplesProbe()
    torch.manual_seed(0)
    model = Counting(probe)
    guard = MemGuard(on_spill="adapt", probe=probe, read_every=1, warmup_steps=1, spill_checkpoint=False)
    kwargs = trainer_kwargs(tmp_path, max_epochs=2, callbacks=[guard], limit_val_batches=1.0)
    with pytest.warns(RuntimeWarning, match=r"returns output\['correct'\] .* validation batches are not split"):
        trainer = Trainer(**kwargs)
        trainer.fit(model)
    assert guard.adaptations == [] and trainer.global_step == 24


class Named(Dataset):
    def __init__(self, x, y) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i], f"sample-{i}"


class WithNames(Wide):
    """Batches of (inputs, targets, names): the default collate makes the names a list of strings."""

    def __init__(self) -> None:
        super().__init__()
        self.mismatched: list[tuple[int, int]] = []

    def training_step(self, batch, batch_idx):
        x, y, names = batch
        if len(names) != len(x) or any(n != f"sample-{int(i)}" for n, i in zip(names, self.index_of(x), strict=True)):
            self.mismatched.append((len(x), len(names)))
        return torch.nn.functional.cross_entropy(self(x), y)

    def index_of(self, x):
        return [int((self.x == row).all(1).nonzero()[0]) for row in x]

    def train_dataloader(self):
        return DataLoader(Named(self.x, self.y), batch_size=self.batch_size, shuffle=True)


def test_a_list_of_names_in_the_batch_is_split_with_its_samples(tmp_path):
    trainer, guard, events, model = _run(tmp_path, others={4: TAKEN}, model=WithNames, max_epochs=1)
    assert guard.adaptations and events.micro_batches[-1] == [16, 16]
    assert model.mismatched == []  # before: each micro-batch of 16 got all 32 names


@dataclasses.dataclass
class Inputs:
    pixels: torch.Tensor
    ids: list[str]


def test_split_batch_cuts_per_sample_sequences_in_dicts_and_dataclasses_not_records():
    x = torch.arange(8).reshape(4, 2)
    batch = {"inputs": Inputs(x, ["a", "b", "c", "d"]), "names": ("a", "b", "c", "d"), "classes": ["cat", "dog"]}
    first, second = (part for part, _ in split_batch(batch, 4, 2))
    assert first["inputs"].ids == ["a", "b"] and second["names"] == ("c", "d")
    assert torch.equal(second["inputs"].pixels, x[2:]) and first["classes"] == ["cat", "dog"]
    pair = (torch.zeros(2, 3), torch.ones(2))  # a batch of two samples: (inputs, targets) is a record, not samples
    assert [tuple(p[0].shape) for p, _ in split_batch(pair, 2, 2)] == [(1, 3), (1, 3)]


class Summed(Wide):
    def training_step(self, batch, batch_idx):
        return torch.nn.functional.cross_entropy(self(batch[0]), batch[1], reduction="sum") / 32  # a sum (scaled)


def test_a_sum_loss_keeps_the_whole_batchs_gradients_and_the_line_says_so(tmp_path):
    trainer, guard, events, model = _run(tmp_path, others={4: TAKEN}, model=Summed, max_epochs=1)
    assert events.micro_batches[-1] == [16, 16]
    assert _close(model, _trained(Summed, tmp_path))  # before: each half weighted by 1/2
    assert "each micro-batch's loss added as it is (a sum over samples)" in guard.adaptations[0].line()


class Tokens(Wide):
    """A token model: batches of {"x": tokens' features, "labels": one label a token, -100 on padding}; the loss a
    token mean over the labels (``shifted``: each token predicts the next label, as a causal LM's loss)."""

    def __init__(self, shifted: bool = False) -> None:
        super().__init__(batch_size=8, n=8 * 12)  # 8 rows of 4 tokens: the 32 rows of Wide's batch
        self.shifted = shifted
        gen = torch.Generator().manual_seed(2)
        n = len(self.x)
        self.tokens = torch.randn(n, 4, 16, generator=gen)
        self.labels = torch.randint(0, 2, (n, 4), generator=gen)
        lengths = torch.randint(1, 5, (n,), generator=gen)
        self.labels[torch.arange(4)[None, :] >= lengths[:, None]] = -100  # padding, ignored by the loss

    def training_step(self, batch, batch_idx):
        logits, labels = self(batch["x"]), batch["labels"]
        if self.shifted:
            logits, labels = logits[:, :-1], labels[:, 1:]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 2), labels.reshape(-1), ignore_index=-100)

    def train_dataloader(self):
        rows = [{"x": x, "labels": y} for x, y in zip(self.tokens, self.labels, strict=True)]
        return DataLoader(rows, batch_size=self.batch_size, shuffle=True)


@pytest.mark.parametrize(("shifted", "weighting"), [(False, "tokens"), (True, "next_tokens")])
def test_a_token_mean_over_padded_labels_keeps_the_whole_batchs_gradients(tmp_path, shifted, weighting):
    trainer, guard, events, model = _run(tmp_path, others={4: TAKEN}, model=lambda: Tokens(shifted), max_epochs=1)
    assert _close(model, _trained(lambda: Tokens(shifted), tmp_path))  # before: weighted by samples
    assert guard.adaptations[0].weighting == weighting and trainer.global_step == 12
    assert "weighted by its labelled tokens" in guard.adaptations[0].line()


class Contrastive(Wide):
    """An in-batch contrastive loss: each sample's positive is itself, every other sample of the batch a negative."""

    def training_step(self, batch, batch_idx):
        a = torch.nn.functional.normalize(self.net[0](batch[0]), dim=1)
        b = torch.nn.functional.normalize(self.net[0](batch[0] + 0.1), dim=1)
        logits = a @ b.T / 0.1
        return torch.nn.functional.cross_entropy(logits, torch.arange(len(logits)))


def test_a_loss_that_couples_the_samples_is_not_split_but_stopped_saying_why(tmp_path):
    with pytest.warns(RuntimeWarning, match="could not adapt: the loss couples the samples of a batch"):
        trainer, guard, events, _ = _run(tmp_path, others={4: TAKEN}, model=Contrastive, expect_adapting=False)
    assert guard.adaptations == [] and trainer.global_step < 24
    assert all(len(m) == 1 for m in events.micro_batches)  # never split: before, 32 x 1 became 16 x 2 in silence


def test_a_declared_weighting_is_used_as_declared(tmp_path):
    with pytest.warns(RuntimeWarning, match="could not adapt: the loss couples .*adapt_loss='coupled'"):
        trainer, guard, _, _ = _run(
            tmp_path / "coupled", others={4: TAKEN}, guard_kwargs={"adapt_loss": "coupled"}, expect_adapting=False
        )
    assert guard.adaptations == []

    def labelled(batch):
        return (batch["labels"] != -100).sum()

    _, guard, _, model = _run(
        tmp_path, others={4: TAKEN}, model=Tokens, max_epochs=1, guard_kwargs={"adapt_loss": labelled}
    )
    assert "weighted by the count declared (`adapt_loss`)" in guard.adaptations[0].line()
    assert _close(model, _trained(Tokens, tmp_path))
    with pytest.raises(ValueError, match="`adapt_loss` must be one of .* got 'tokens'"):
        MemGuard(on_spill="adapt", adapt_loss="tokens")


def test_the_weighting_is_judged_from_the_losses_of_a_sub_batch_whole_and_in_parts():
    from lightning_memguard.tuning.adapt import judge_weighting

    counts = {"samples": [1, 3], "tokens": [5, 5], "sum": [1, 3]}
    assert judge_weighting(2.5, [1.0, 3.0], counts) == "samples"  # (1 x 1 + 3 x 3) / 4
    assert judge_weighting(2.0, [1.0, 3.0], counts) == "tokens"  # (5 x 1 + 5 x 3) / 10
    assert judge_weighting(4.0, [1.0, 3.0], counts) == "sum"
    assert judge_weighting(3.4, [1.0, 3.0], counts) is None  # nothing joins them: the samples are coupled
