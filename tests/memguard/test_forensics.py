"""The memory report on its own: which modules hold a step's memory, the fixes, the files written."""

from __future__ import annotations

import json
import os
import pathlib
import re

import pytest
import torch
from torch import nn

from lightning_memguard.forensics import MemoryReport, SavedTensorRecorder, measure_step
from lightning_memguard.forensics import fixes as rules
from lightning_memguard.forensics.attribution import step_undone

JSON_KEYS = {
    "version", "why", "step", "device", "samples", "scale", "note", "peak", "peak_measured", "split", "top", "fixes",
    "timeline", "snapshot", "capacity", "other_processes", "judged_peak", "batch",
}  # fmt: skip


class Wide(nn.Module):
    """Widens its input 64 times, then squares it: a module whose saved activations dwarf the rest."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 1024)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(x) ** 2


class OneHugeActivation(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 16)
        self.huge = Wide()
        self.head = nn.Sequential(nn.Linear(1024, 8), nn.ReLU(), nn.Linear(8, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.huge(torch.relu(self.stem(x))))


def _measured(model: nn.Module, batch: int = 32):
    torch.manual_seed(0)
    x = torch.randn(batch, 8)
    optimizer = torch.optim.Adam(model.parameters())
    model(x).sum().backward()
    optimizer.step()  # its state exists, as in a run
    optimizer.zero_grad()
    return measure_step(model, lambda: model(x).sum(), [optimizer], samples=batch), optimizer


def test_the_module_with_the_huge_activation_comes_first_with_its_share_of_the_peak():
    memory, _ = _measured(OneHugeActivation())
    report = MemoryReport.from_step(memory, "spill", step=3)
    first = report.top[0]
    # `huge` saves the Linear's output (32 x 1024 floats) for the square's backward; `huge.up` saves its 16-wide input
    assert first["name"] == "huge" and first["class"] == "Wide"
    assert first["bytes"] == 32 * 1024 * 4
    assert first["share"] == pytest.approx(first["bytes"] / report.peak)
    assert [t["name"] for t in report.top][:2] == ["huge", "head.0"]  # head.0 saves its 1024-wide input
    assert "huge (Wide)" in report.verdict().splitlines()[1]


def test_the_split_adds_up_to_the_peak_and_names_weights_gradients_and_optimizer_state():
    model = OneHugeActivation()
    memory, _ = _measured(model)
    parameters = sum(p.numel() * 4 for p in model.parameters())
    assert memory.weights == parameters
    assert memory.gradients == parameters
    steps = 4 * len(list(model.parameters()))  # a float step counter per parameter
    assert memory.optimizer == 2 * parameters + steps  # and Adam's two moments
    report = MemoryReport.from_step(memory, "spill")
    assert sum(report.split.values()) == report.peak
    assert report.split["rest"] == 0 and not report.peak_measured  # on the CPU the peak is the sum of the parts


def test_a_measured_step_leaves_gradients_buffers_and_random_numbers_as_they_were():
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5))
    model(torch.randn(4, 8)).sum().backward()
    grads = [p.grad for p in model.parameters()]
    grad_values = [g.clone() for g in grads]
    statistics = model[1].running_mean.clone()
    generator = torch.get_rng_state()
    measure_step(model, lambda: model(torch.randn(4, 8)).sum())
    assert all(p.grad is g for p, g in zip(model.parameters(), grads, strict=True))
    assert all(torch.equal(g, v) for g, v in zip(grads, grad_values, strict=True))
    assert torch.equal(model[1].running_mean, statistics)
    assert torch.equal(torch.get_rng_state(), generator)


def test_the_recorder_removes_its_hooks_and_hands_saved_tensors_on_to_the_hooks_in_force():
    model = OneHugeActivation()
    outer = []

    def pack(t):
        outer.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        recorder = SavedTensorRecorder(model)
        with recorder:
            model(torch.randn(4, 8)).sum().backward()
    assert outer  # the outer hooks (the spill emulator's, say) still saw every tensor
    assert recorder.largest().saved["huge"] == 4 * 1024 * 4
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_each_storage_counts_once_and_parameters_are_not_activations():
    linear = nn.Linear(8, 8)

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = linear

        def forward(self, x):
            y = self.a(x)
            return (y * y).sum()  # y saved twice, by one product

    model = Twice()
    recorder = SavedTensorRecorder(model)
    with recorder:
        model(torch.randn(4, 8)).backward()
    forward = recorder.largest()
    assert forward.saved == {"a": 4 * 8 * 4, "": 4 * 8 * 4}  # the input in `a`; y once, outside every module


# ---------------------------------------------------------------- fixes, each rule


def test_blocks_holding_the_top_modules_are_named_for_checkpointing():
    fix = rules.checkpoint_fix(["layer1.0.conv1", "layer1.0.bn1", "fc"], ["layer1.0", "layer1.1"])
    assert fix is not None and 'units=["layer1.0"]' in fix
    assert rules.checkpoint_fix(["fc"], ["layer1.0"]) is None


def test_a_vocabulary_sized_head_with_the_loss_among_the_largest_asks_for_the_fused_loss_by_its_call():
    fix = rules.vocabulary_fix(["", "h.0"], ["lm_head"])
    assert "apply_fused_loss(model)" in fix
    assert "fused_linear_cross_entropy(hidden, model.lm_head.weight, labels, shift=True)" in fix
    assert "plan_levers(model, batch, memory_budget=...)" in fix
    assert "apply_fused_loss(model)" in rules.vocabulary_fix(["lm_head"], ["lm_head"])
    assert rules.vocabulary_fix(["h.0"], ["lm_head"]) is None
    assert rules.vocabulary_fix([""], []) is None


def test_optimizer_state_above_a_third_of_the_peak_asks_for_a_lighter_state_or_sharding():
    assert "FSDPStrategy" in rules.optimizer_fix(34, 100)
    assert rules.optimizer_fix(33, 100) is None


def test_a_smaller_micro_batch_is_always_the_last_fix_with_memguards_figures():
    found = rules.fixes(["fc"], [], [], 0, 100, advice="a batch of at most 56 fits")
    assert found == [rules.micro_batch_fix("a batch of at most 56 fits")]
    assert found[0].endswith("a batch of at most 56 fits")


def test_a_language_model_whose_logits_hold_the_peak_is_given_the_fused_loss_by_its_call():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(100, 8)
            self.lm_head = nn.Linear(8, 32_000, bias=False)

        def forward(self, tokens):
            logits = self.lm_head(self.embed(tokens))
            return nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())

    model = Tiny()
    tokens = torch.randint(0, 100, (2, 16))
    report = MemoryReport.from_step(measure_step(model, lambda: model(tokens)), "plan")
    assert report.top[0]["name"] == ""  # the logits, kept by the loss outside every module
    assert report.fixes[0].startswith("the logits of lm_head and their loss")  # the largest share: named first
    assert "apply_fused_loss(model)" in report.fixes[0] and "fused_linear_cross_entropy(" in report.fixes[0]
    assert "(outside any module: the loss)" in report.verdict()


def test_the_fix_for_the_largest_share_comes_first_not_the_blocks_holding_a_few_percent():
    """A language model with blocks and a vocabulary-sized head: the loss's logits hold most of the peak, so the
    fused loss is the first fix and the verdict's; checkpointing the blocks (a few percent) comes after it."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(8, 32), nn.Linear(32, 8)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(x)))

    class WithBlocks(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(100, 8)
            self.blocks = nn.ModuleList(Block() for _ in range(2))
            self.lm_head = nn.Linear(8, 32_000, bias=False)

        def forward(self, tokens):
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x)
            return nn.functional.cross_entropy(self.lm_head(x).flatten(0, 1), tokens.flatten())

    model = WithBlocks()
    tokens = torch.randint(0, 100, (2, 16))
    report = MemoryReport.from_step(measure_step(model, lambda: model(tokens)), "spill")
    assert report.top[0]["name"] == "" and report.top[0]["share"] > 0.5
    assert "apply_fused_loss(model)" in report.fixes[0]
    assert any(f.startswith("checkpoint the blocks") for f in report.fixes[1:-1])
    assert "Fix: the logits of lm_head and their loss: compute the loss without building the logits" in report.verdict()


def test_a_resnet_is_told_which_blocks_to_checkpoint():
    import torchvision

    model = torchvision.models.resnet18(num_classes=4)
    x = torch.randn(2, 3, 64, 64)
    report = MemoryReport.from_step(measure_step(model, lambda: model(x).sum()), "plan")
    assert report.fixes[0].startswith("checkpoint the blocks holding them")
    assert any(t["name"].startswith(("layer1.", "conv1", "bn1", "relu", "maxpool")) for t in report.top)


# ---------------------------------------------------------------- files


def _report() -> MemoryReport:
    memory, _ = _measured(OneHugeActivation(), batch=8)
    return MemoryReport.from_step(memory, "spill", step=5)


def test_the_json_has_the_documented_keys(tmp_path):
    paths = _report().write(tmp_path, "memguard-report-step=5-spill")
    assert [os.path.basename(p) for p in paths] == [
        "memguard-report-step=5-spill.json",
        "memguard-report-step=5-spill.html",
    ]
    data = json.loads(pathlib.Path(paths[0]).read_text(encoding="utf-8"))
    assert set(data) == JSON_KEYS and data["version"] == 1 and data["why"] == "spill" and data["step"] == 5
    assert set(data["split"]) == {"weights", "gradients", "optimizer", "activations", "rest", "others"}
    assert set(data["top"][0]) == {"name", "class", "bytes", "share"}
    assert set(data["timeline"][0]) == {"module", "saved", "allocated", "by_module"}
    assert data["timeline"][-1]["saved"] == data["split"]["activations"]
    from lightning_memguard.forensics import memory_report as module

    documented = set(re.findall(r"``(\w+)``", module.__doc__ or ""))
    assert documented >= JSON_KEYS


def test_the_page_is_one_file_with_its_picture_and_nothing_from_elsewhere(tmp_path):
    page = pathlib.Path(_report().write(tmp_path, "r")[1]).read_text(encoding="utf-8")
    assert page.count("<svg") == 1 and "<polygon" in page and "huge" in page
    assert "<script" not in page and not re.search(r"(src|href)=|url\(|https?://(?!www\.w3\.org/2000/svg)", page)
    assert sorted(os.listdir(tmp_path)) == ["r.html", "r.json"]


def test_a_failing_write_leaves_no_file_behind(tmp_path):
    report = _report()

    def broken(path):
        with open(path, "wb") as f:
            f.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        report.write(tmp_path, "r", snapshot=broken)
    assert os.listdir(tmp_path) == []


def test_the_snapshot_is_written_beside_the_report_and_named_in_it(tmp_path):
    report = _report()
    paths = report.write(tmp_path, "r", snapshot=lambda path: pathlib.Path(path).write_bytes(b""))
    assert [os.path.basename(p) for p in paths] == ["r.json", "r.html", "r.pickle"]
    assert json.loads(pathlib.Path(paths[0]).read_text(encoding="utf-8"))["snapshot"] == "r.pickle"


def test_an_unknown_reason_is_refused():
    memory, _ = _measured(OneHugeActivation(), batch=2)
    with pytest.raises(ValueError, match="`why` must be one of"):
        MemoryReport.from_step(memory, "boredom")


def test_step_undone_puts_gradients_back_even_when_the_step_fails():
    model = nn.Linear(2, 2)
    model(torch.randn(1, 2)).sum().backward()
    grad = model.weight.grad
    with pytest.raises(RuntimeError, match="boom"), step_undone(model):
        model(torch.randn(1, 2)).sum().backward()
        raise RuntimeError("boom")
    assert model.weight.grad is grad


# ---------------------------------------------------------------- charges, and what happened on the card


def test_a_micro_batch_cut_from_the_batch_is_the_batchs_not_an_activation():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    batch = torch.randn(16, 8)
    recorder = SavedTensorRecorder(model)
    for micro in batch.split(4):  # views of the batch's storage, as a split batch's micro-batches are
        with recorder.on(micro):  # as MemGuard's report names each micro-batch its training step is given
            model(micro).sum().backward()
    # the input Linear's input is the batch's, not an activation; the ReLU's output (the second Linear's input too)
    # holds the micro-batch's 4 samples
    assert recorder.forwards[1].saved == {"1": 4 * 8 * 4}
    with recorder:  # a batch not named is an activation, charged whole: the allocator keeps all of its storage
        model(batch[4:8]).sum().backward()
    assert recorder.forwards[-1].saved == {"0": 16 * 8 * 4, "1": 4 * 8 * 4}


def test_autocasts_low_precision_copies_of_weights_are_not_activations():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    recorder = SavedTensorRecorder(model)
    with recorder, torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(4, 8)).float().sum().backward()
    # the second Linear keeps its bf16 input (4 x 8) for the weight's gradient; the bf16 copy of its weight (8 x 8),
    # which it keeps for the input's gradient, is the weight, not an activation
    assert recorder.largest().saved["1"] == 4 * 8 * 2


def _situated(capacity, others=0, judged=None, grew_back=None):
    memory, _ = _measured(OneHugeActivation(), batch=8)
    from lightning_memguard.forensics.memory_report import Situation

    situation = Situation(capacity, others, judged, 8, grew_back)
    return memory, MemoryReport.from_step(memory, "spill", step=5, situation=situation)


def test_other_processes_holding_the_card_are_in_the_split_and_named_first_where_they_are_the_cause():
    memory, _ = _situated(None)
    own = memory.peak
    others = own // 5  # less than this process's largest part, and still what pushes the step over
    _, report = _situated(capacity=own + own // 10, others=others)  # this process's peak fits alone, not beside them
    assert report.split["others"] == others and sum(report.split.values()) == report.peak == own + others
    assert max(report.split.values()) > others
    assert report.verdict().splitlines()[1].split("= ")[1].startswith("other processes")
    assert report.fixes[0].startswith("other processes hold") and "would fit without them" in report.fixes[0]
    _, small = _situated(capacity=4 * own, others=own // 10)  # fits with them: not the cause, no such fix
    assert not any(f.startswith("other processes") for f in small.fixes)


def test_weights_gradients_and_optimizer_state_filling_the_card_get_only_the_fixes_that_shrink_them():
    memory, _ = _situated(None)
    resting = memory.weights + memory.gradients + memory.optimizer
    _, report = _situated(capacity=resting * 3 // 4)  # as examples/spill_stopped.py: 134.2 MB on a 100 MB card
    assert len(report.fixes) == 1
    fix = report.fixes[0]
    assert fix.startswith("weights, gradients and optimizer state alone hold") and "no micro-batch fits" in fix
    assert "lighter optimizer state" in fix and "smaller model" in fix and "sharding" in fix
    assert "ActivationCheckpointing" not in fix and "smaller micro-batch" not in fix
    _, beside = _situated(capacity=resting * 5 // 4, others=resting // 2)  # fits alone, not beside others
    assert beside.fixes[0].startswith("other processes hold") or "beside other processes'" in beside.fixes[0]
    assert not any("ActivationCheckpointing" in f or "smaller micro-batch" in f for f in beside.fixes)


def test_the_page_explains_the_spill_on_its_own(tmp_path):
    _, report = _situated(capacity=63_200_000, others=1_500_000, judged=72_800_000)
    page = pathlib.Path(report.write(tmp_path, "r")[1]).read_text(encoding="utf-8")
    # the spill message's own figures: its peak against the capacity, the overflow, the batch, other processes
    said = "Spill at step 5: peak 72.8 MB against 63.2 MB of physical memory, 9.6 MB over; batch 8; others 1.5 MB"
    assert said in page
    assert "What happened on the card" in page and "over the capacity by</td><td>9.6 MB" in page
    data = json.loads(pathlib.Path(tmp_path / "r.json").read_text(encoding="utf-8"))
    assert (data["capacity"], data["other_processes"], data["judged_peak"], data["batch"]) == (
        63_200_000, 1_500_000, 72_800_000, 8,
    )  # fmt: skip


def test_a_grow_back_report_names_no_fix():
    _, report = _situated(capacity=10**12, grew_back="step 80: memory freed; now 128 x 1")
    assert report.fixes == [] and "Fix:" not in report.verdict()
    assert report.verdict().endswith("(step 80: memory freed; now 128 x 1: this step fits, nothing to fix)")
