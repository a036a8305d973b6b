"""A process's first CUDA step allocates what later steps reuse (cuBLAS's and cuDNN's workspaces): the step's peak
is measured after one step has run, so that a plan's baseline is a step's, not the first step's. CPU twin of
``test_the_first_plan_in_a_process_measures_a_steps_peak`` (tests/gpu/test_gpu.py): a fake CUDA allocator whose
first step keeps a workspace."""

from __future__ import annotations

import torch
from torch import nn

from lightning_memguard.checkpointing import measure


class _Allocator:
    """``torch.cuda``'s memory counters, moved by :class:`_Model`: the first step keeps a workspace of 100 bytes,
    every step holds 50 bytes at its peak."""

    def __init__(self) -> None:
        self.allocated = self.peak = self.steps = 0
        self.workspace = False

    def step(self) -> None:
        self.steps += 1
        if not self.workspace:
            self.workspace, self.allocated = True, self.allocated + 100
        self.peak = max(self.peak, self.allocated + 50)

    def reset_peak(self, device: object = None) -> None:
        self.peak = self.allocated


class _Model(nn.Module):
    def __init__(self, allocator: _Allocator) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.allocator = allocator

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.allocator.step()
        return self.linear(x)


def test_the_step_peak_is_measured_after_a_first_step_and_leaves_the_model_as_it_was(monkeypatch):
    allocator = _Allocator()
    cuda = measure.torch.cuda
    monkeypatch.setattr(cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(cuda, "memory_allocated", lambda device=None: allocator.allocated)
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: allocator.peak)
    monkeypatch.setattr(cuda, "reset_peak_memory_stats", allocator.reset_peak)
    model = _Model(allocator)
    meter = measure.StepMeter(model, torch.randn(2, 4), lambda out: out.sum())
    meter.cuda = True  # the example's device, as a CUDA batch sets it
    assert meter.peak() == 50  # the step's, not 150: the first step's workspace is not the step's
    assert meter.peak() == 50
    assert allocator.steps == 3  # one step to warm up, then one per measurement
    assert all(p.grad is None for p in model.parameters())  # the warm-up step's gradients are gone
