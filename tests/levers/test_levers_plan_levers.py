"""The levers' planner on real models on the CPU: a tiny GPT-2 (its logits hold the peak until the fused loss frees
them, then a block does) and a tiny conv net (no vocabulary head). The plan meets the budget as the ledger of saved
tensors measures it, the gradients are the plain model's (bit for bit where only recomputation changed; within
float32 tolerance with the fused loss), the pointwise lever is built in (measured, chosen where it is the cheapest way,
never stacked on a link checkpointed whole, printed as its own call), a lever built elsewhere is taken through its own
measure and apply, and a failure part-way leaves the model as it was.

Where a test needs one choice among the recomputations, it fixes the pointwise lever's cost with an injected clock (0
ms: a constant clock), never this machine's speed."""

from __future__ import annotations

import copy
import gc
import importlib
import warnings
import weakref
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_memguard.checkpointing import apply_plan, is_checkpointed
from lightning_memguard.checkpointing.measure import StepMeter
from lightning_memguard.checkpointing.model_map import map_model
from lightning_memguard.levers.choose import LeverPlan, LinkOption
from lightning_memguard.levers.huggingface_loss import FusedLossRefused, apply_fused_loss, is_fused
from lightning_memguard.levers.plan_levers import (
    OUTSIDE_OWNER,
    InjectedLever,
    apply_record,
    find_loss_target,
    hugging_face_loss,
    plan_levers,
)
from lightning_memguard.levers.pointwise import PointwiseRecomputed, measure_pointwise, recompute_pointwise

transformers = pytest.importorskip("transformers")
plan_levers_module = importlib.import_module(
    "lightning_memguard.levers.plan_levers"
)  # the package's name is the function's


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


def pointwised(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, PointwiseRecomputed)]


def still_clock() -> float:
    """A clock that does not move: the pointwise lever's recomputation measured at 0 ms."""
    return 0.0


@pytest.fixture(scope="module")
def planned_gpt2():
    model, example = gpt2()
    plain = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_levers(model, example, memory_budget=0.3, pointwise=False)  # the pointwise lever: below
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
        plan = plan_levers(model, example, memory_budget=0.75, fused_loss=False, pointwise=False)
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
    plan = plan_levers(model, images, memory_budget=0.6, units=[ConvBlock], pointwise=False)
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
        plan = plan_levers(
            model, example, memory_budget=0.3, pointwise=False, injected=[InjectedLever("pointwise", measure, apply)]
        )
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
        plan_levers(model, example, memory_budget=0.3, pointwise=False, injected=[lever])
    assert not is_fused(model) and checkpointed(model) == []


def test_bad_arguments_are_refused():
    model, example = gpt2()
    with pytest.raises(ValueError, match=r"`bandwidth_gb_s` must be positive, got 0"):
        plan_levers(model, example, memory_budget=0.5, bandwidth_gb_s=0)
    with pytest.raises(ValueError, match=r"`memory_budget` must be given"):
        plan_levers(model, example, memory_budget=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"`model` must be a torch.nn.Module"):
        plan_levers("gpt2", example, memory_budget=0.5)  # type: ignore[arg-type]


def vit() -> tuple[nn.Module, torch.Tensor]:
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, depth=3, num_classes=10)
    return model.train(), torch.randn(8, 3, 32, 32)


def sum_loss(output: torch.Tensor) -> torch.Tensor:
    return output.sum()


def plain_grads(model: nn.Module, example, loss_fn) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    args, kwargs = ((), example) if isinstance(example, dict) else ((example,), {})
    loss_fn(model(*args, **kwargs)).backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("family", ["gpt2", "vit"])
def test_pointwise_where_it_is_the_cheapest_way_meets_the_budget_bit_for_bit(family):
    """Half of what the pointwise chains free, needed: they alone are taken (0 ms each), the links given back that
    the budget does not need; the ledger's peak of the model as left is the plan's and within the budget; the
    gradients are the plain model's bit for bit (no fused loss); calls() names recompute_pointwise, and its lines
    make the same model from a fresh copy."""
    model, example = gpt2() if family == "gpt2" else vit()
    loss_fn = hugging_face_loss if family == "gpt2" else sum_loss
    plain = copy.deepcopy(model)
    links = map_model(model, "auto").links
    costs = measure_pointwise(model, example, links, loss_fn, clock=still_clock)
    assert all(c.freed_bytes > 0 for c in costs)
    baseline = StepMeter(model, example, loss_fn).peak()
    budget = baseline - sum(c.freed_bytes for c in costs) // 2
    plan = plan_levers(model, example, memory_budget=budget, loss_fn=loss_fn, fused_loss=False, clock=still_clock)

    assert set(plan.kinds()) == {"pointwise"} and plan.extra_ms == 0.0 and plan.checkpointed == []
    assert plan.pointwise == list(plan.links) == [link.name for link in links][: len(plan.links)]
    assert 1 < len(plan.links) < len(links)  # half the chains' bytes: more than one link, not every one
    assert pointwised(model) == plan.pointwise and checkpointed(model) == []
    measured = StepMeter(model, example, loss_fn).peak()  # the ledger, the model as left
    assert measured == plan.measured_bytes == plan.predicted_bytes <= budget == plan.budget_bytes
    assert plan.held and "pointwise chains recomputed in " in plan.summary()

    want = plain_grads(plain, example, loss_fn)
    got = plain_grads(model, example, loss_fn)
    assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want, strict=True))

    assert plan.calls() == [f"recompute_pointwise(model, units={plan.pointwise!r})"]
    fresh = copy.deepcopy(plain)
    for line in plan.calls():
        eval(line, {"recompute_pointwise": recompute_pointwise, "model": fresh})  # noqa: S307 - the plan's own lines
    assert pointwised(fresh) == plan.pointwise


def test_pointwise_and_whole_blocks_share_the_links_never_one_link():
    """Beyond what every chain frees: a link's chains exchanged for its whole block (frees more), the others' kept;
    each link one option, no pointwise block inside or around a checkpointed one, the gradients the plain model's."""
    model, example = gpt2()
    plain = copy.deepcopy(model)
    links = map_model(model, "auto").links
    freed = sum(c.freed_bytes for c in measure_pointwise(model, example, links, hugging_face_loss, still_clock))
    baseline = StepMeter(model, example, hugging_face_loss).peak()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_levers(model, example, memory_budget=baseline - freed - 200_000, fused_loss=False,
                           clock=still_clock)  # fmt: skip
    kinds = plan.kinds()
    assert plan.held and "pointwise" in kinds and {"block", "parts"} & set(kinds)
    assert pointwised(model) == plan.pointwise == kinds["pointwise"]
    for name in plan.pointwise:  # nothing checkpointed in it, and it inside nothing checkpointed
        assert not any(c == name or c.startswith(f"{name}.") or name.startswith(f"{c}.") for c in checkpointed(model))
    assert plan.calls() == [
        f"apply_plan(model, {[[name] for name in plan.checkpointed]!r})",
        f"recompute_pointwise(model, units={plan.pointwise!r})",
    ]
    fresh = copy.deepcopy(plain)
    namespace = {"apply_plan": apply_plan, "recompute_pointwise": recompute_pointwise, "model": fresh}
    for line in plan.calls():  # in this order: recompute_pointwise refuses a block checkpointed whole
        eval(line, namespace)  # noqa: S307 - the plan's own lines
    assert pointwised(fresh) == plan.pointwise and checkpointed(fresh) == checkpointed(model)
    loss, grads = gradients(model, example)
    plain_loss, want = gradients(plain, example)
    assert torch.equal(loss, plain_loss) and all(torch.equal(g, w) for g, w in zip(grads, want, strict=True))


def test_with_the_fused_loss_pointwise_is_measured_after_it_and_printed_after_it():
    model, example = gpt2()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_levers(model, example, memory_budget=0.3, clock=still_clock)
    assert plan.loss and is_fused(model) and plan.held
    # measured after the fused loss, every chain (0 ms) closes the gap it leaves: no block needed
    assert set(plan.kinds()) == {"pointwise"} and pointwised(model) == plan.pointwise == [
        f"transformer.h.{i}" for i in range(3)
    ]
    calls = plan.calls()
    assert calls == ["apply_fused_loss(model)", f"recompute_pointwise(model, units={plan.pointwise!r})"]
    fresh, _ = gpt2()
    namespace = {"apply_fused_loss": apply_fused_loss, "apply_plan": apply_plan,
                 "recompute_pointwise": recompute_pointwise, "model": fresh}  # fmt: skip
    for line in calls:
        eval(line, namespace)  # noqa: S307 - the plan's own lines
    assert StepMeter(fresh, example, hugging_face_loss).peak() == plan.measured_bytes


def test_a_failure_with_pointwise_applied_leaves_the_model_as_it_was(monkeypatch):
    model, example = gpt2()
    peak = plan_levers_module._Levers.peak

    def failing(self):
        if self.pointwised:
            raise RuntimeError("measuring broke")
        return peak(self)

    monkeypatch.setattr(plan_levers_module._Levers, "peak", failing)
    with pytest.raises(RuntimeError, match="measuring broke"):
        plan_levers(model, example, memory_budget=0.9, fused_loss=False, clock=still_clock)
    assert pointwised(model) == [] and checkpointed(model) == [] and not is_fused(model)


def test_an_injected_lever_of_a_kind_the_planner_offers_is_refused():
    model, example = gpt2()
    lever = InjectedLever("pointwise", lambda model, links: {}, lambda model, links: lambda: None)
    with pytest.raises(ValueError, match=r"kind 'pointwise' is one the planner offers itself; pass pointwise=False"):
        plan_levers(model, example, memory_budget=0.5, injected=[lever])
    block = InjectedLever("block", lever.measure, lever.apply)
    with pytest.raises(ValueError, match=r"kind 'block' is one the planner offers itself$"):
        plan_levers(model, example, memory_budget=0.5, injected=[block])
    with pytest.raises(ValueError, match=r"two injected levers of kind 'pointwise'"):
        plan_levers(model, example, memory_budget=0.5, pointwise=False, injected=[lever, lever])


class ChangesItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.nn.functional.gelu(torch.relu_(x)))


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.nn.functional.gelu(x))


def test_a_block_that_refuses_pointwise_gets_no_such_option_and_the_others_do():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), Plain(), ChangesItsInput(), Plain())
    x = torch.randn(64, 16)
    with pytest.raises(RuntimeError, match="changes its input in place"):  # the block itself, asked alone
        measure_pointwise(model, x, ["2"])
    plan = plan_levers(model, x, memory_budget=0.1, units=[Plain, ChangesItsInput], clock=still_clock)
    assert plan.pointwise and "2" not in plan.links  # the others' chains measured and taken; it recomputes nothing
    assert pointwised(model) == plan.pointwise and "not met" in plan.summary()  # the floor, said


def test_a_record_applies_the_same_levers_to_a_fresh_copy_measuring_nothing(planned_gpt2, monkeypatch):
    """``plan.record()`` is plain data; ``apply_record`` on a fresh copy gives the same fused loss, blocks and
    pointwise links, and trains as the planned model, with no measurement (the meter refuses to run)."""
    model, plain, example, plan = planned_gpt2
    record = plan.record()
    assert record == {"version": 1, "fused_loss": True, "loss_module": "", "checkpointed": plan.checkpointed,
                      "pointwise": []}  # fmt: skip
    fresh = copy.deepcopy(plain)

    def no_measuring(*args, **kwargs):
        raise AssertionError("apply_record measured")

    monkeypatch.setattr(StepMeter, "peak", no_measuring)
    assert apply_record(fresh, record) is fresh
    assert is_fused(fresh) and checkpointed(fresh) == checkpointed(model)
    loss, grads = gradients(fresh, example)
    want_loss, want_grads = gradients(model, example)
    assert torch.equal(loss, want_loss) and all(torch.equal(a, b) for a, b in zip(grads, want_grads, strict=True))


def test_a_record_with_pointwise_links_and_a_held_language_model():
    """A Hugging Face model held by another module (a LightningModule's ``self.model``) gets the fused loss, named in
    the record; pointwise links come back by name."""
    model, example = gpt2()
    holder = nn.Module()
    holder.model = model
    holder.forward = lambda **kw: holder.model(**kw)  # type: ignore[method-assign]
    assert find_loss_target(holder)[:2] == ("model", model)
    record = {"version": 1, "fused_loss": True, "loss_module": "model", "checkpointed": ["model.transformer.h.0"],
              "pointwise": ["model.transformer.h.1"]}  # fmt: skip
    apply_record(holder, record)
    assert is_fused(model) and checkpointed(holder) == ["model.transformer.h.0"]
    assert pointwised(holder) == ["model.transformer.h.1"]


def test_a_hugging_face_model_that_refuses_the_fused_loss_is_not_looked_into():
    """A wrapper of an unverified family (a vision-language model holding its language model) computes its loss from
    the inner model's logits: the inner model is not fused behind its back."""
    model, _ = gpt2()
    wrapper = nn.Module()
    wrapper.config = SimpleNamespace(model_type="llava")  # type: ignore[assignment]
    wrapper.language_model = model
    holder = nn.Module()
    holder.model = wrapper
    name, target, why = find_loss_target(holder)
    assert (name, target) == ("", holder) and why is not None and why.startswith("model: llava: not verified")


def test_a_bad_record_is_refused_and_leaves_the_model_as_it_was():
    model, _ = gpt2()
    with pytest.raises(ValueError, match="version 2 is not one this library reads"):
        apply_record(model, {"version": 2, "fused_loss": False, "loss_module": "", "checkpointed": [], "pointwise": []})
    with pytest.raises(ValueError, match="must be a dict with the keys"):
        apply_record(model, {"runs": []})
    bad = {"version": 1, "fused_loss": True, "loss_module": "", "checkpointed": ["transformer.h.9"], "pointwise": []}
    with pytest.raises(ValueError, match=r"transformer\.h\.9"):
        apply_record(model, bad)
    assert not is_fused(model) and not checkpointed(model)  # the fused loss applied first was taken off again
    with pytest.raises(FusedLossRefused, match="not a Hugging Face model"):
        apply_record(nn.Linear(2, 2), {**bad, "checkpointed": []})


def test_a_plan_with_offload_or_an_injected_lever_has_no_record():
    offloaded = LeverPlan(False, {"h.0": LinkOption("offload", 10, 1.0)}, 100, 50)
    with pytest.raises(ValueError, match="offload is a context around the training steps"):
        offloaded.record()
    injected = LeverPlan(False, {"h.0": LinkOption("pointwise", 10, 1.0)}, 100, 50)  # not in plan.pointwise
    with pytest.raises(ValueError, match="injected lever"):
        injected.record()


def test_a_block_that_changes_a_kept_product_in_place_gets_no_pointwise_option_and_the_others_plan():
    """A block whose ReLU(inplace=True) changes a Linear's output (a product the pointwise lever keeps: timm's
    squeeze-excite does it to a convolution's output) fails in backward under selective checkpointing; the planner
    leaves that block without the option instead of failing, and the model trains as the plain one."""
    torch.manual_seed(0)

    def block(inplace: bool) -> nn.Module:
        return nn.Sequential(nn.Linear(64, 64), nn.ReLU(inplace=inplace), nn.Linear(64, 64), nn.GELU())

    model = nn.Sequential(block(False), block(True), block(False), block(False))
    plain = copy.deepcopy(model)
    x = torch.randn(256, 64)
    plan = plan_levers(model, x, memory_budget=0.7, units=[nn.Sequential])
    assert plan.held
    assert not isinstance(model[1], PointwiseRecomputed) and "1" not in plan.pointwise
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()
    plain(x).sum().backward()
    for mine, theirs in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(mine.grad, theirs.grad)


def test_a_block_refused_while_measured_leaves_no_step_alive():
    """Each block that changes a kept product in place is refused by a measured step; each such step's graph must go
    with it. It did not: the measurement's saved-tensor hook returned each tensor as it was, a cycle only backward
    breaks, and on a GPU RegNetY's 21 refused blocks held 76 GB (an H100, out of memory)."""
    torch.manual_seed(0)

    def block(inplace: bool) -> nn.Module:
        return nn.Sequential(nn.Linear(64, 64), nn.ReLU(inplace=inplace), nn.Linear(64, 64), nn.GELU())

    model = nn.Sequential(block(False), block(True), block(False), block(True))
    outputs: list[weakref.ref[torch.Tensor]] = []
    model[0].register_forward_hook(lambda module, args, out: outputs.append(weakref.ref(out)))
    plan = plan_levers(model, torch.randn(256, 64), memory_budget=0.7, units=[nn.Sequential])
    assert plan.held and not {"1", "3"} & set(plan.pointwise)
    gc.collect()
    alive = [ref() for ref in outputs if ref() is not None]
    assert len(outputs) > 5 and alive == []


def test_a_model_that_carries_levers_already_is_refused_and_keeps_them():
    # planning starts from the model as built and undoes what it tried: over the user's own levers, it would take
    # them off without a word
    model, example = gpt2()
    apply_plan(model, [["transformer.h.1"]])
    apply_fused_loss(model)
    record = {"version": 1, "fused_loss": False, "loss_module": "", "checkpointed": ["transformer.h.0"]}
    record["pointwise"] = []
    for call in (lambda: plan_levers(model, example, memory_budget=0.5), lambda: apply_record(model, record)):
        with pytest.raises(ValueError, match=r"carries levers already \(checkpointed: transformer\.h\.1; fused loss:"):
            call()
        assert checkpointed(model) == ["transformer.h.1"] and is_fused(model)
    assert plan_levers_module.remove_levers(model) and plan_levers_module.applied_levers(model) == []
    recompute_pointwise(model, units=["transformer.h.2"])
    assert plan_levers_module.applied_levers(model) == ["pointwise chains recomputed: transformer.h.2"]
