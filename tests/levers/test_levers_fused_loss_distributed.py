"""The fused loss on two CPU processes (gloo), ``tests/fused_loss_run.py``'s scenarios in one launch: under DDP and
under ModelParallelStrategy (FSDP2's ``fully_shard``) every step's loss and every gradient, after the all-reduce or
the reduce-scatter, equal the plain loss's under the same strategy and one process's training the plain model on the
two ranks' batches together (float32 tolerance); a sharded head it cannot fuse is refused by name."""

from __future__ import annotations

import re

import pytest
from conftest import ddp_scenario_results, ddp_scenarios

pytest.importorskip("transformers")

TOLERANCE = 1e-6  # float32 of a tiny model: the differences measured are 2e-8 to 4e-7


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """tests/fused_loss_run.py's scenarios, in one two-rank launch of their own (``conftest.ddp_scenarios``)."""
    return ddp_scenarios(tmp_path_factory, "fused-loss", ["fused_loss_run:ddp", "fused_loss_run:fsdp2"], timeout=300)


def _assert_trains_as_plain(ranks: dict[int, dict], name: str, plain: str | None, micro_batches: int = 1) -> None:
    """Each rank's gradients before every optimizer step equal one process's (and the plain loss's under the same
    strategy, where ``plain``); the two ranks' losses of a step, averaged, are one process's loss of that step."""
    for rank in (0, 1):
        r = ranks[rank][name]
        assert r["grads_from_reference"] and max(r["grads_from_reference"]) < TOLERANCE, r["grads_from_reference"]
        if plain is not None:
            assert max(r["grads_from_plain"]) < TOLERANCE and r["losses_from_plain"] < TOLERANCE
            assert r["losses"] == pytest.approx(ranks[rank][plain]["losses"], abs=TOLERANCE)
    r0, r1 = ranks[0][name], ranks[1][name]
    assert r0["reference_losses"] == r1["reference_losses"]
    steps = [
        r0["losses"][i : i + micro_batches] + r1["losses"][i : i + micro_batches]
        for i in range(0, len(r0["losses"]), micro_batches)
    ]
    assert [sum(s) / len(s) for s in steps] == pytest.approx(r0["reference_losses"], abs=TOLERANCE)


@pytest.mark.parametrize("name", ["fused", "unused", "direct", "compiled"])
def test_under_ddp_the_fused_loss_trains_as_the_plain_loss_and_as_one_process(two_ranks, name):
    """GPT-2 (its head's weight tied to the input embedding) under DDPStrategy, three steps: ``apply_fused_loss``;
    the same with ``find_unused_parameters=True``; a LightningModule calling ``fused_linear_cross_entropy`` on the
    transformer's hidden states and ``lm_head.weight``; the fused model compiled (``aot_eager``)."""
    ranks = ddp_scenario_results(two_ranks, "fused_loss_run:ddp", "ddp-rank{rank}.json")
    _assert_trains_as_plain(ranks, "plain", None)  # the reference itself: plain DDP is one process
    _assert_trains_as_plain(ranks, name, "plain")
    if name == "compiled":
        assert ranks[0][name]["frames_compiled"] > 0


def test_under_ddp_accumulated_micro_batches_sync_once_and_train_as_one_process(two_ranks):
    """``accumulate_grad_batches=2``: the first micro-batch's backward runs under DDP's ``no_sync``, the second's
    all-reduces both; each step's gradients are one process's on the four micro-batches together."""
    ranks = ddp_scenario_results(two_ranks, "fused_loss_run:ddp", "ddp-rank{rank}.json")
    assert len(ranks[0]["accumulate"]["losses"]) == 4 and len(ranks[0]["accumulate"]["grads_from_reference"]) == 2
    _assert_trains_as_plain(ranks, "accumulate", None, micro_batches=2)


@pytest.mark.parametrize(
    ("name", "plain"), [("fused", "plain"), ("llama_fused", "llama_plain"), ("head_fused", "head_plain")]
)
def test_under_fsdp2_the_head_gathered_for_its_call_trains_as_the_plain_loss_and_as_one_process(two_ranks, name, plain):
    """ModelParallelStrategy(data_parallel_size=2), every block sharded: GPT-2 with ``apply_fused_loss`` (the tied
    head in the root's group); Llama with its untied head sharded on its own, gathered for the head's call only; a
    user's head module whose forward calls ``fused_linear_cross_entropy``, sharded on its own. The sharded gradients,
    gathered whole, are the plain loss's and one process's."""
    ranks = ddp_scenario_results(two_ranks, "fused_loss_run:fsdp2", "fsdp2-rank{rank}.json")
    _assert_trains_as_plain(ranks, plain, None)
    _assert_trains_as_plain(ranks, name, plain)


@pytest.mark.parametrize("name", ["direct", "tensor_parallel"])
def test_under_model_parallel_a_sharded_head_is_refused_saying_what_to_do(two_ranks, name):
    """``direct``: a user's call of ``fused_linear_cross_entropy`` on the head's weight outside the head's forward
    (FSDP2 resharded it after that forward); ``tensor_parallel``: ``apply_fused_loss`` on a head made
    ``ColwiseParallel`` (sharded inside its forward too). Both ranks refuse at the first step, before any loss."""
    ranks = ddp_scenario_results(two_ranks, "fused_loss_run:fsdp2", "fsdp2-rank{rank}.json")
    for rank in (0, 1):
        message = ranks[rank][name]["refused"]
        assert message is not None
        assert re.search(r"`weight` is a DTensor \(placements \(Shard\(dim=0\),\) on a mesh of 2 ranks\)", message)
        assert re.search(
            r"FSDP2's fully_shard or tensor parallelism \(Lightning's ModelParallelStrategy\) leave a sharded", message
        )
        assert re.search(r"call it inside the forward of the module that holds the head", message)
        assert re.search(r"a tensor-parallel head is not supported", message)
