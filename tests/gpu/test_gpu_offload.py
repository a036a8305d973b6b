"""Activation offload on a CUDA GPU, run with `python -m pytest -m cuda`: the real side streams and pinned buffers.
The CPU twin is tests/levers/test_offload.py (the same bookkeeping with recorded copy streams)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_memguard.levers.offload import ActivationOffload

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    blocks = [
        nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024), nn.LayerNorm(1024)) for _ in range(8)
    ]
    return nn.Sequential(*blocks).cuda()


def _step(model, x, offload=None):
    """The gradients, and the memory the forward leaves allocated once its copies are done."""
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    with offload if offload is not None else torch.enable_grad():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        torch.cuda.synchronize()
        torch.empty(1, device="cuda")  # the allocator takes back what waited for the copies
        kept = torch.cuda.memory_allocated() - start
        loss.backward()
    torch.cuda.synchronize()
    return [p.grad.clone() for p in model.parameters()], kept


def test_offloaded_blocks_train_to_the_same_gradients_keep_less_on_the_device_and_leave_nothing_behind():
    x = torch.randn(8192, 1024, device="cuda")
    plain, plain_kept = _step(_model(), x)
    model = _model()
    offload = ActivationOffload(list(model), offloaded=range(6))
    grads, kept = _step(model, x, offload)
    assert all(torch.equal(a, b) for a, b in zip(grads, plain, strict=True))
    assert offload.moved_bytes > 6 * 8192 * 4096 * 2  # at least each block's wide activation, in bf16
    assert kept <= plain_kept - 0.9 * offload.moved_bytes
    assert offload.in_use_bytes == 0 and offload.host_bytes == 0  # released on exit
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


@pytest.mark.xfail(
    strict=True,
    reason="on an H100 (2026-12-07) the plan with block inputs offloaded measured 1.024 GB, above recomputation's"
    " floor (0.72 GB) it was meant to go below: on the card the offload does not yet free what it moves",
)
def test_the_levers_plan_holds_a_budget_below_recomputations_floor_with_block_inputs_offloaded():
    """CPU twin: tests/levers/test_levers_offload_plan.py (the same plan with copies made at once)."""
    from lightning_memguard.levers.plan_levers import plan_levers

    x = torch.randn(8192, 1024, device="cuda", requires_grad=True)

    def loss(output: torch.Tensor) -> torch.Tensor:
        return output.float().square().mean()

    def gradients(model: nn.Module, offload: ActivationOffload | None = None) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        x.grad = None
        with offload if offload is not None else torch.enable_grad():
            loss(model(x)).backward()
        torch.cuda.synchronize()
        return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]

    expected = gradients(_model())
    options = {"units": [nn.Sequential], "loss_fn": loss, "pointwise": False, "fused_loss": False}
    floor = plan_levers(_model(), x, 0.01, **options)  # recomputation alone: every block, their inputs kept
    assert not floor.held and set(floor.kinds()) <= {"block", "parts"}
    model = _model()
    budget = int(0.9 * floor.measured_bytes)
    plan = plan_levers(model, x, budget, offload=True, **options)
    assert plan.held and "block_offload" in plan.kinds(), plan.summary()
    assert plan.offload is not None and plan.host_bytes > 0
    got = gradients(model, plan.offload)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert plan.offload.in_use_bytes == 0
