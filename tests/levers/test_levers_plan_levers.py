"""The levers' planner on real models on the CPU: a tiny GPT-2 (its logits hold the peak until the fused loss frees
them, then a block does) and a tiny conv net (no vocabulary head). The plan meets the budget as the ledger of saved
tensors measures it, the gradients are the plain model's (bit for bit where only recomputation changed; within
float32 tolerance with the fused loss), a lever built elsewhere is taken through its own measure and apply, and a
failure part-way leaves the model as it was."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from lightning_memguard.checkpointing import is_checkpointed
from lightning_memguard.checkpointing.measure import StepMeter
from lightning_memguard.levers.huggingface_loss import is_fused
from lightning_memguard.levers.plan_levers import OUTSIDE_OWNER, InjectedLever, hugging_face_loss, plan_levers

transformers = pytest.importorskip("transformers")


def gpt2() -> tuple[nn.Module, dict]:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=3, n_embd=32, n_head=2, vocab_size=2000, n_positions=128, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    tokens = torch.randint(0, 2000, (4, 128))
    return model, {"input_ids": tokens, "labels": tokens}


def gradients(model: nn.Module, example: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**example).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def checkpointed(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if is_checkpointed(m)]


@pytest.fixture(scope="module")
def planned_gpt2():
    model, example = gpt2()
    plain = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_levers(model, example, memory_budget=0.3)
    return model, plain, example, plan


def test_the_fused_loss_comes_first_and_the_blocks_are_chosen_after_it(planned_gpt2):
    model, _, example, plan = planned_gpt2
    assert plan.loss and is_fused(model)
    assert plan.owner == OUTSIDE_OWNER and plan.owner_after_loss.startswith("transformer.h.")  # the peak moved
    assert plan.tried[:2] == [("as it is", plan.baseline_bytes), ("fused loss", plan.loss_bytes)]
    assert plan.loss_bytes < 0.7 * plan.baseline_bytes  # the logits were most of the step
    assert plan.links and all(o.kind in ("block", "parts") for o in plan.links.values())
    measured = StepMeter(model, example, hugging_face_loss).peak()  # the ledger, on the model as it is left
    assert plan.held and measured == plan.measured_bytes <= plan.budget_bytes == int(0.3 * plan.baseline_bytes)
    assert "levers: the fused loss" in plan.summary() and plan.offload is None


def test_the_planned_gpt2_trains_as_the_plain_one(planned_gpt2):
    model, plain, example, _ = planned_gpt2
    loss, grads = gradients(model, example)
    plain_loss, plain_grads = gradients(plain, example)
    torch.testing.assert_close(loss, plain_loss, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, plain_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_recomputation_alone_is_the_plain_models_bit_for_bit():
    model, example = gpt2()
    plain = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_levers(model, example, memory_budget=0.75, fused_loss=False)
    assert not plan.loss and plan.loss_refused == "not offered (fused_loss=False)" and not is_fused(model)
    assert plan.held and plan.links and checkpointed(model)
    loss, grads = gradients(model, example)
    plain_loss, plain_grads = gradients(plain, example)
    assert torch.equal(loss, plain_loss)
    assert all(torch.equal(g, p) for g, p in zip(grads, plain_grads, strict=True))


class ConvBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)))


def test_a_conv_net_gets_its_blocks_and_no_fused_loss():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), *(ConvBlock(8) for _ in range(4)), nn.Flatten(),
                          nn.LazyLinear(10))  # fmt: skip
    images = torch.randn(8, 3, 16, 16)
    model(images)  # the lazy layer made
    plain = copy.deepcopy(model)
    plan = plan_levers(model, images, memory_budget=0.6, units=[ConvBlock])
    assert not plan.loss and "not a Hugging Face model" in plan.loss_refused
    assert plan.held and set(plan.kinds()) == {"block"} and checkpointed(model) == list(plan.links)
    assert StepMeter(model, images, hugging_face_loss).peak() <= plan.budget_bytes
    for m in (model, plain):
        m.zero_grad(set_to_none=True)
        m(images).sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), plain.parameters(), strict=True))


def test_a_lever_built_elsewhere_is_measured_applied_and_undone_through_its_own_calls():
    model, example = gpt2()
    calls: list[tuple[str, list[str]]] = []

    def measure(model: nn.Module, links) -> dict:
        return {links[0]: (10**9, 0.01)}  # said to free everything for nothing: taken first

    def apply(model: nn.Module, links) -> object:
        calls.append(("apply", list(links)))
        return lambda: calls.append(("undo", list(links)))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_levers(model, example, memory_budget=0.3, injected=[InjectedLever("pointwise", measure, apply)])
    assert plan.tried[2][0] == "fused loss, transformer.h.0: pointwise"
    assert calls[0] == ("apply", ["transformer.h.0"])
    applied = [c for c in calls if c[0] == "apply"]
    kept = 1 if plan.kinds().get("pointwise") else 0
    assert len([c for c in calls if c[0] == "undo"]) == len(applied) - kept  # each undone before the next


def test_a_failure_part_way_leaves_the_model_as_it_was():
    model, example = gpt2()

    def apply(model: nn.Module, links) -> object:
        raise RuntimeError("the pointwise lever broke")

    lever = InjectedLever("pointwise", lambda model, links: {links[1]: (10**9, 0.0)}, apply)
    with warnings.catch_warnings(), pytest.raises(RuntimeError, match="the pointwise lever broke"):
        warnings.simplefilter("ignore")
        plan_levers(model, example, memory_budget=0.3, injected=[lever])
    assert not is_fused(model) and checkpointed(model) == []


def test_bad_arguments_are_refused():
    model, example = gpt2()
    with pytest.raises(ValueError, match=r"`bandwidth_gb_s` must be positive, got 0"):
        plan_levers(model, example, memory_budget=0.5, bandwidth_gb_s=0)
    with pytest.raises(ValueError, match=r"`memory_budget` must be given"):
        plan_levers(model, example, memory_budget=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"`model` must be a torch.nn.Module"):
        plan_levers("gpt2", example, memory_budget=0.5)  # type: ignore[arg-type]
